"""fabric-fsdp: the reference's FSDPStrategy arguments mapped onto FSDP2, its guard rails, and its messages.

Construction and policy selection are checked in this process (no process group needed); what needs sharding
runs on 2 real ranks over gloo (``scripts/argument_checks.py``), with the assertions here.
"""

from __future__ import annotations

import functools
import sys
import warnings
from pathlib import Path

import pytest
import torch
from jobs import read_json, run_ranks
from torch import nn
from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffload,
    CPUOffloadPolicy,
    MixedPrecision,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ShardingStrategy,
)
from torch.distributed.fsdp.wrap import CustomPolicy, ModuleWrapPolicy, size_based_auto_wrap_policy

from fabric_core import Fabric
from fabric_core.io.checkpoint_io import TorchCheckpointIO
from fabric_core.precision.base import Precision
from fabric_core.precision.double import DoublePrecision
from fabric_core.precision.half import HalfPrecision
from fabric_fsdp import FSDPPrecision, FSDPStrategy
from fabric_fsdp import arguments as fsdp_arguments
from fabric_fsdp.sharding import as_policy

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.append(str(SCRIPTS))
import fsdp_common as common  # noqa: E402


def _names(model: nn.Module, modules: list[nn.Module]) -> list[str]:
    names = {id(m): n for n, m in model.named_modules()}
    return [names[id(m)] for m in modules]


def _descendants_first(names: list[str]) -> bool:
    """No module comes after one of its ancestors (FSDP2 needs inner units sharded first)."""
    return all(not (b == "" or a.startswith(b + ".")) for i, b in enumerate(names) for a in names[i + 1 :])


# ----------------------------------------------------------------------------------------------------- policies
BLOCK_POLICIES = {
    "classes": {common.Block},
    "one class": common.Block,
    "predicate": lambda m: isinstance(m, common.Block),
    "ModuleWrapPolicy": ModuleWrapPolicy({common.Block}),
    "CustomPolicy": CustomPolicy(lambda m: isinstance(m, common.Block)),
    "FSDP1 callable": lambda module, recurse, nonwrapped_numel: recurse or isinstance(module, common.Block),
}


@pytest.mark.parametrize("name", list(BLOCK_POLICIES))
@pytest.mark.parametrize("argument", ["auto_wrap_policy", "activation_checkpointing_policy"])
def test_every_policy_form_selects_the_blocks(name: str, argument: str) -> None:
    model = common.make_model()
    select = as_policy(BLOCK_POLICIES[name], argument)
    assert _names(model, select(model, frozenset())) == ["blocks.1", "blocks.0"]
    # The strategy accepts it under both names (construction converts and validates it).
    FSDPStrategy(**{argument: BLOCK_POLICIES[name]})


def _fsdp1_wraps(model: nn.Module, policy, ignored: frozenset = frozenset()) -> list[str]:
    """What torch's own FSDP1 recursive wrapping would wrap (the oracle), recorded instead of wrapped."""
    from torch.distributed.fsdp.wrap import _recursive_wrap

    wrapped: list[nn.Module] = []

    def record(module: nn.Module, **kwargs) -> nn.Module:
        wrapped.append(module)
        return module

    _recursive_wrap(model, policy, record, ignored_modules=set(), ignored_params=set(ignored), only_wrap_children=True)
    return _names(model, wrapped)


def test_size_based_policy_is_run_the_way_fsdp1_runs_it() -> None:
    """Numbers of parameters: inp 144, each Block 304 (blocks 608), enc.self_attn 1088, enc.linear1 544,
    enc.linear2 528, enc 2224 in all, out 68. A parent counts only what its picked children left over;
    `nn.MultiheadAttention` is a leaf of size_based_auto_wrap_policy (never recursed into, never wrapped)."""
    model = common.make_model()
    for min_num_params in (1, 100, 300, 600, 1100, 2300, 4000):
        policy = functools.partial(size_based_auto_wrap_policy, min_num_params=min_num_params)
        picked = _names(model, as_policy(policy, "auto_wrap_policy")(model, frozenset()))
        assert sorted(picked) == sorted(_fsdp1_wraps(model, policy)), min_num_params  # the modules FSDP1 wraps
        assert _descendants_first(picked), min_num_params
    small_policy = functools.partial(size_based_auto_wrap_policy, min_num_params=300)
    small = as_policy(small_policy, "auto_wrap_policy")
    picked = _names(model, small(model, frozenset()))
    # `blocks` holds 608 >= 300, but both Blocks were picked: nothing is left for it. The root is never picked;
    # enc keeps 2224 - 544 - 528 = 1152 after its linears.
    assert sorted(picked) == ["blocks.0", "blocks.1", "enc", "enc.linear1", "enc.linear2"]
    assert _descendants_first(picked)
    large = as_policy(functools.partial(size_based_auto_wrap_policy, min_num_params=600), "auto_wrap_policy")
    # Now the Blocks are too small, so `blocks` has its 608.
    assert sorted(_names(model, large(model, frozenset()))) == ["blocks", "enc"]
    # Ignored parameters are not counted, and a module holding only ignored ones is never picked.
    ignored = frozenset(model.blocks[0].parameters())
    assert sorted(_names(model, small(model, ignored))) == ["blocks.1", "enc", "enc.linear1", "enc.linear2"]
    assert sorted(_names(model, small(model, ignored))) == sorted(_fsdp1_wraps(model, small_policy, ignored))
    assert _names(model, as_policy({common.Block}, "auto_wrap_policy")(model, ignored)) == ["blocks.1"]


def test_malformed_policies_are_refused_at_construction() -> None:
    with pytest.raises(TypeError, match="auto_wrap_policy"):
        FSDPStrategy(auto_wrap_policy={"Linear"})
    with pytest.raises(TypeError, match=r"takes neither `\(module\)` nor FSDP1's"):
        FSDPStrategy(activation_checkpointing_policy=lambda a, b: True)
    with pytest.raises(TypeError, match="activation_checkpointing_policy"):
        FSDPStrategy(activation_checkpointing_policy=3)
    # A CustomPolicy that returns FSDP1 arguments for a module has nothing to map onto: refused when applied.
    with_kwargs = as_policy(CustomPolicy(lambda m: {"sharding_strategy": "NO_SHARD"} if isinstance(m, common.Block) else False), "auto_wrap_policy")
    with pytest.raises(ValueError, match="FSDP2 has no per-module FSDP1 arguments"):
        with_kwargs(common.make_model(), frozenset())
    # An empty set selects nothing (no activation checkpointing).
    assert as_policy(set(), "activation_checkpointing")(common.make_model(), frozenset()) == []


def test_activation_checkpointing_and_its_policy_are_exclusive() -> None:
    with pytest.raises(ValueError, match="You cannot set both `activation_checkpointing` and `activation_checkpointing_policy`. Use the latter"):
        FSDPStrategy(activation_checkpointing=[nn.Linear], activation_checkpointing_policy={nn.Linear})


# ----------------------------------------------------------------------------------------------------- mixed precision
def test_fsdp1_mixed_precision_maps_field_by_field() -> None:
    policy = fsdp_arguments.as_mixed_precision(
        MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)
    )
    root, unit = policy(True), policy(False)
    assert (root.param_dtype, root.reduce_dtype, root.output_dtype) == (torch.bfloat16, torch.float32, None)
    assert root.cast_forward_inputs is True  # cast_root_forward_inputs (default True) is the root's
    assert (unit.param_dtype, unit.reduce_dtype, unit.cast_forward_inputs) == (torch.bfloat16, torch.float32, False)
    both = fsdp_arguments.as_mixed_precision(MixedPrecision(param_dtype=torch.float16, cast_forward_inputs=True, cast_root_forward_inputs=False))
    assert both(True).cast_forward_inputs is True and both(False).cast_forward_inputs is True
    fsdp2 = MixedPrecisionPolicy(param_dtype=torch.float16, output_dtype=torch.float32)
    assert fsdp_arguments.as_mixed_precision(fsdp2)(True) is fsdp2 and fsdp_arguments.as_mixed_precision(fsdp2)(False) is fsdp2
    assert fsdp_arguments.as_mixed_precision(None) is None


def test_tied_weights_split_across_units_are_found() -> None:
    """An embedding and an output layer sharing one tensor, wrapped in different units (the reference warns too)."""
    from fabric_fsdp.sharding import tied_across_units

    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4), nn.Linear(4, 10, bias=False))
    model[2].weight = model[0].weight
    assert tied_across_units(model, [model[0]]) == [(["0.weight", "2.weight"], ["", "0"])]
    assert tied_across_units(model, [model[0], model[2]]) == [(["0.weight", "2.weight"], ["0", "2"])]
    assert tied_across_units(model, [model[1]]) == []  # both users in the root: one owner


@pytest.mark.multiprocess
def test_tied_weights_split_by_the_wrap_policy_warn_on_two_ranks(tmp_path: Path) -> None:
    run_ranks(SCRIPTS / "tied_weights.py", str(tmp_path), timeout=240, tmp_path=tmp_path)
    seen = read_json(tmp_path / "tied.json")
    assert len(seen["split"]) == 1 and "`embed.weight`, `head.weight` are one tensor (tied weights)" in seen["split"][0]
    assert "different units (`embed`, `head`)" in seen["split"][0]
    assert seen["together"] == []


def test_mixed_precision_config_has_the_references_name() -> None:
    """``strategy.mixed_precision_config`` / ``precision.mixed_precision_config``: the policy FSDP applies to blocks."""
    given = MixedPrecisionPolicy(param_dtype=torch.float16)
    assert FSDPStrategy(mixed_precision=given).mixed_precision_config is given
    assert FSDPPrecision("bf16-mixed").mixed_precision_config.param_dtype == torch.bfloat16
    assert FSDPPrecision("32-true").mixed_precision_config is None
    assert FSDPStrategy().mixed_precision_config is None  # no precision attached yet, nothing given


def test_mixed_precision_fields_without_fsdp2_equivalent() -> None:
    with pytest.raises(ValueError, match="keep_low_precision_grads=True.*no FSDP2 equivalent"):
        FSDPStrategy(mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, keep_low_precision_grads=True))
    with pytest.warns(UserWarning, match="FSDP2 does not cast buffers"):
        FSDPStrategy(mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="MixedPrecisionPolicy"):
        FSDPStrategy(mixed_precision="bf16-mixed")
    # FSDP1 keeps BatchNorm in float32 under MixedPrecision; FSDP2 does not: said when the model has one.
    bn_model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    with pytest.warns(UserWarning, match="FSDP1 keeps BatchNorm1d in full precision"):
        fsdp_arguments.warn_unkept_modules(MixedPrecision(param_dtype=torch.bfloat16), bn_model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fsdp_arguments.warn_unkept_modules(MixedPrecision(param_dtype=torch.bfloat16), nn.Linear(2, 2))
        fsdp_arguments.warn_unkept_modules(MixedPrecisionPolicy(param_dtype=torch.bfloat16), bn_model)


# ----------------------------------------------------------------------------------------------------- offload, sharding
@pytest.mark.parametrize(
    ("value", "offloads"),
    [(None, False), (False, False), (True, True), (CPUOffload(offload_params=False), False), (CPUOffload(offload_params=True), True), (OffloadPolicy(), False)],
)
def test_cpu_offload_forms(value, offloads: bool) -> None:
    strategy = FSDPStrategy(cpu_offload=value)
    assert strategy.cpu_offload is offloads
    assert isinstance(strategy.offload_policy, CPUOffloadPolicy) is offloads


def test_cpu_offload_policy_is_kept_and_bad_values_refused() -> None:
    policy = CPUOffloadPolicy(pin_memory=False)
    assert FSDPStrategy(cpu_offload=policy).offload_policy is policy
    strategy = FSDPStrategy()
    strategy.cpu_offload = CPUOffload(offload_params=True)
    assert strategy.cpu_offload is True
    with pytest.raises(TypeError, match="CPUOffload"):
        FSDPStrategy(cpu_offload="yes")


@pytest.mark.parametrize(
    ("value", "name", "reshards", "mesh"),
    [
        (ShardingStrategy.FULL_SHARD, "FULL_SHARD", True, (1,)),
        (ShardingStrategy.SHARD_GRAD_OP, "SHARD_GRAD_OP", False, (1,)),
        (ShardingStrategy.HYBRID_SHARD, "HYBRID_SHARD", True, (1, 1)),
        (ShardingStrategy._HYBRID_SHARD_ZERO2, "_HYBRID_SHARD_ZERO2", False, (1, 1)),
        ("_hybrid_shard_zero2", "_HYBRID_SHARD_ZERO2", False, (1, 1)),
        (ShardingStrategy.NO_SHARD, "NO_SHARD", True, (1, 1)),
    ],
)
def test_sharding_strategy_enum_and_hybrid_zero2(value, name: str, reshards: bool, mesh: tuple) -> None:
    strategy = FSDPStrategy(sharding_strategy=value)
    assert strategy.sharding_strategy == name
    assert (strategy.reshard_after_forward is not False) is reshards
    assert strategy.mesh_shape == mesh


# ----------------------------------------------------------------------------------------------------- FSDP1 kwargs
_IGNORED_MODULE = nn.Linear(2, 2)
_IGNORED_PARAMS = list(nn.Linear(2, 2).parameters())


@pytest.mark.parametrize(
    ("kwargs", "honoured"),
    [
        # what FSDP2 does anyway: accepted, nothing left for the strategy to do
        ({"use_orig_params": True}, {}),
        ({"limit_all_gathers": True}, {}),
        ({"backward_prefetch": BackwardPrefetch.BACKWARD_PRE}, {}),
        ({"forward_prefetch": False}, {}),
        ({"param_init_fn": None}, {}),
        ({"process_group": None}, {}),
        # what the strategy carries out at setup (tests/plugins/fsdp/scripts/argument_checks.py runs each on 2 ranks)
        ({"sync_module_states": True}, {"sync_module_states": True}),
        ({"ignored_modules": [_IGNORED_MODULE]}, {"ignored_modules": [_IGNORED_MODULE]}),
        ({"ignored_states": _IGNORED_PARAMS}, {"ignored_params": _IGNORED_PARAMS}),
        ({"device_id": 0}, {"device_id": 0}),
    ],
    ids=lambda v: next(iter(v)) if isinstance(v, dict) and v else None,
)
def test_fsdp1_keyword_arguments_fsdp2_honours(kwargs: dict, honoured: dict) -> None:
    """Each FSDP1 keyword argument FSDP2 can honour is accepted and lands where setup reads it: a no-op one leaves
    the defaults, the others set exactly their field (nothing dropped, nothing else changed)."""
    options = fsdp_arguments.fsdp1_options(kwargs)
    assert options == fsdp_arguments.FSDP1Options(**honoured), (kwargs, options)
    ignored = _IGNORED_MODULE.parameters() if "ignored_modules" in kwargs else honoured.get("ignored_params", ())
    assert options.resolve_ignored() == frozenset(ignored)
    assert FSDPStrategy(**kwargs)._fsdp1 == options  # what the strategy's setup reads


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"use_orig_params": False}, ValueError, "FSDP2 has no flat parameters"),
        ({"limit_all_gathers": False}, ValueError, "always bounds the all-gathers"),
        ({"backward_prefetch": None}, ValueError, "set_modules_to_backward_prefetch"),
        ({"backward_prefetch": BackwardPrefetch.BACKWARD_POST}, ValueError, "set_modules_to_backward_prefetch"),
        ({"forward_prefetch": True}, ValueError, "set_modules_to_forward_prefetch"),
        ({"param_init_fn": lambda m: None}, ValueError, r"fabric.init_module\(empty_init=True\)"),
        ({"process_group": object()}, ValueError, "device_mesh="),
        ({"ignored_modules": [nn.Linear(2, 2)], "ignored_states": [nn.Linear(2, 2)]}, ValueError, "not both"),
        ({"ignored_modules": [1]}, TypeError, "iterable of modules"),
        ({"ignored_states": [nn.Linear(2, 2), nn.Parameter(torch.ones(1))]}, TypeError, "only modules or only parameters"),
        ({"sync_module_states": "yes"}, TypeError, "bool"),
        ({"device_id": "cuda:0"}, TypeError, "device_id"),
        ({"auto_wrap_polcy": {nn.Linear}}, TypeError, r"unexpected keyword argument\(s\) \['auto_wrap_polcy'\].*use_orig_params"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_fsdp1_keyword_arguments_fsdp2_cannot_honour_name_its_way(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        FSDPStrategy(**kwargs)


def test_device_id_must_match_the_rank_device() -> None:
    fsdp_arguments.check_device_id(None, torch.device("cpu"))
    fsdp_arguments.check_device_id(torch.device("cpu"), torch.device("cpu"))
    fsdp_arguments.check_device_id(1, torch.device("cuda", 1))
    fsdp_arguments.check_device_id(torch.device("cuda"), torch.device("cuda", 1))
    with pytest.raises(ValueError, match="does not match this rank's device"):
        fsdp_arguments.check_device_id(torch.device("cuda", 0), torch.device("cpu"))
    with pytest.raises(ValueError, match="does not match this rank's device"):
        fsdp_arguments.check_device_id(0, torch.device("cuda", 1))


# ----------------------------------------------------------------------------------------------------- guard rails
class RecordingIO(TorchCheckpointIO):
    pass


def test_precision_plugins_of_other_strategies_are_refused() -> None:
    from fabric_amp.precision import MixedPrecision as AutocastPrecision

    match = r"The FSDP strategy can only work with the `FSDPPrecision` plugin, found"
    with pytest.raises(TypeError, match=match + r".*FSDPPrecision\('bf16-mixed'\)"):
        Fabric(accelerator="cpu", strategy="fsdp", devices=2, plugins=[AutocastPrecision("bf16-mixed")])
    with pytest.raises(TypeError, match=match + r".*FSDPPrecision\('bf16-true'\)"):
        Fabric(accelerator="cpu", strategy="fsdp", devices=2, plugins=[HalfPrecision("bf16-true")])
    with pytest.raises(TypeError, match=match):
        FSDPStrategy(precision=HalfPrecision("16-true"))
    strategy = FSDPStrategy()
    with pytest.raises(TypeError, match=match):
        strategy.precision = HalfPrecision("bf16-true")
    assert type(strategy.precision) is Precision  # unchanged: the default
    # FSDP's own precision and the core's 32-true/64-true (FSDP2 shards what they leave) are accepted.
    for ok in (FSDPPrecision("bf16-mixed"), Precision(), DoublePrecision()):
        assert FSDPStrategy(precision=ok).precision is ok
    assert isinstance(Fabric(accelerator="cpu", strategy="fsdp", devices=2, precision="64-true").strategy.precision, DoublePrecision)


def test_a_custom_checkpoint_io_is_for_full_checkpoints_only() -> None:
    match = r"The `FSDPStrategy` does not support setting a `CheckpointIO` plugin for sharded checkpoints"
    with pytest.raises(NotImplementedError, match=match + r".*state_dict_type='full'"):
        FSDPStrategy(checkpoint_io=RecordingIO())
    with pytest.raises(NotImplementedError, match=match):
        Fabric(accelerator="cpu", strategy="fsdp", devices=2, plugins=[RecordingIO()])
    sharded = FSDPStrategy()
    with pytest.raises(NotImplementedError, match=match):
        sharded.checkpoint_io = RecordingIO()
    sharded.checkpoint_io = TorchCheckpointIO()  # the default kind is fine
    # Full checkpoints are written through it; switching such a strategy to sharded is refused.
    io = RecordingIO()
    fabric = Fabric(accelerator="cpu", strategy=FSDPStrategy(state_dict_type="full"), devices=2, plugins=[io])
    assert fabric.strategy.checkpoint_io is io
    with pytest.raises(NotImplementedError, match=match):
        fabric.strategy.state_dict_type = "sharded"
    assert fabric.strategy.state_dict_type == "full"
    with pytest.raises(ValueError, match="state_dict_type"):
        fabric.strategy.state_dict_type = "local"


# ----------------------------------------------------------------------------------------------------- 2 ranks
@pytest.mark.multiprocess
def test_arguments_on_two_ranks(tmp_path: Path) -> None:
    run_ranks(SCRIPTS / "argument_checks.py", str(tmp_path), timeout=240, tmp_path=tmp_path)
    r = read_json(tmp_path / "arguments.json")
    ref = r["ref_losses"]

    # FSDP1 policy objects and callables, for wrapping and for activation checkpointing (recomputed: 2 calls).
    blocks = ["", "blocks.0", "blocks.1"]
    for name in ("module_wrap_policy", "custom_and_fsdp1_callable"):
        assert r[name]["units"] == blocks, name
        assert r[name]["block_calls_per_step"] == 4, name
        assert r[name]["losses"] == pytest.approx(ref, rel=1e-5), name
    size = r["size_based"]
    assert size["units"] == ["", "blocks.0", "blocks.1", "enc", "enc.linear1", "enc.linear2"]
    assert size["block_calls_per_step"] == 4 and size["losses"] == pytest.approx(ref, rel=1e-5)
    assert r["custom_policy_with_kwargs"].startswith("The `auto_wrap_policy` policy returned FSDP1 arguments")

    # FSDP1 MixedPrecision: compute in bf16, float32 master weights, outputs not cast back (as FSDP1).
    fsdp1 = r["fsdp1_mixed_precision"]
    assert fsdp1["compute_dtype"] == "torch.bfloat16" and fsdp1["param_dtype"] == "torch.float32"
    assert fsdp1["output_dtype"] == "torch.bfloat16"
    assert fsdp1["losses"] == pytest.approx(ref, rel=2e-2)
    # `mixed_precision=` wins over the precision plugin's policy (bf16-mixed would compute in bf16).
    wins = r["mixed_precision_wins"]
    assert wins["precision"] == "FSDPPrecision" and wins["compute_dtype"] == "torch.float16"
    assert wins["output_dtype"] == "torch.float16"

    # CPUOffload(offload_params=False) is no offloading: no "no effect on CPU" warning; True is offloading.
    assert r["cpu_offload_false"]["offload_warnings"] == []
    assert len(r["cpu_offload_true"]["offload_warnings"]) == 1

    # _HYBRID_SHARD_ZERO2: a (replicate, shard) mesh whose units keep their parameters gathered after forward.
    zero2 = r["hybrid_zero2"]
    assert zero2["mesh"] == [1, 2] and zero2["enc_gathered_after_forward"] is True
    assert r["hybrid"]["enc_gathered_after_forward"] is False  # the control: HYBRID_SHARD reshards
    assert zero2["losses"] == pytest.approx(ref, rel=1e-5)

    # sync_module_states: every rank starts from rank 0's weights; without it each rank's shard came from its own.
    assert r["sync_module_states"]["diff_to_rank0_model"] == 0.0
    assert r["no_sync_module_states"]["diff_to_rank0_model"] > 0.0

    # ignored_modules/ignored_states: those parameters stay whole plain tensors on every rank; the rest is sharded.
    for name in ("ignored_modules", "ignored_states"):
        v = r[name]
        assert v["ignored_plain_full"] and v["others_sharded"] and v["ignored_have_grads"], name
        assert v["finite"], name
        assert v["ignored_same_objects"], name  # moved in place: an optimizer built before setup still has them
    assert r["ignored_modules"]["units"] == ["", "blocks.0"]  # an ignored module is not a unit
    # Their gradients are not reduced across ranks (as with FSDP1), so the copies drift apart; a sharded checkpoint
    # keeps one rank's copy (DCP stores a tensor that is not sharded once) and gives it to every rank.
    ignored = r["ignored_modules"]
    assert ignored["ranks_differed"] and ignored["restored_same_on_ranks"] and ignored["restored_is_a_rank_copy"]
    assert ignored["restored_sharded_diff"] == 0.0
    assert r["ignored_meta_init_equal_across_ranks"]  # meta init: rank 0's values for the unsharded ones

    # device_id must match this rank's device.
    assert "does not match this rank's device" in r["device_id_mismatch"]
    assert r["device_id_cpu_ok"]

    # Pre-sharding a module yourself (the way the CustomPolicy/BatchNorm messages give) keeps its own policy.
    pre = r["presharded"]
    assert pre["units"] == blocks and pre["block_dtypes"] == ["torch.float32", "torch.bfloat16"]
    assert pre["finite"]

    # Checkpoints: a custom CheckpointIO writes full checkpoints (rank 0) and receives storage_options.
    assert r["io_calls_per_rank"] == [1, 0] and r["io_storage_options"] == {"bucket": "b"}
    assert r["sharded_storage_options"].startswith(  # the reference's whole sentence, then ours
        "`FSDPStrategy.save_checkpoint(..., storage_options=...)` is not supported because `FSDPStrategy` does not"
        " use the `CheckpointIO`. "
    )
    # load_raw of a plain PyTorch optimizer state into the sharded optimizer works (the reference refuses it).
    assert r["load_raw_optimizer_exp_avg_diff"] == 0.0 and r["load_raw_optimizer_step"] == 3.0
    # Several FSDP models when loading: the reference's words.
    assert r["two_models_load"].startswith("Found multiple FSDP models in the given state")
    assert "Loading checkpoints with FSDP is limited to a single model" in r["two_models_load"]


@pytest.mark.multiprocess
def test_blocks_compiled_in_place_are_sharded_and_checkpointed_per_block(tmp_path: Path) -> None:
    """``fabric_core.loop.compile.compile_blocks`` before FSDP2 with activation checkpointing trains as eager does."""
    run_ranks(SCRIPTS / "compile_blocks_checks.py", str(tmp_path), timeout=300, tmp_path=tmp_path)
    seen = read_json(tmp_path / "compile_blocks.json")
    assert seen["compiled"] == ["1", "2", "3"] and seen["still_compiled"] == [True, True, True]
    assert seen["checkpointed"] == [True, True, True]  # the strategy's activation checkpointing took the same blocks
    assert seen["losses"] == pytest.approx(seen["reference"], rel=1e-5)
    assert seen["losses"][-1] < seen["losses"][0]
