"""fabric-bnb on one CPU process, with the real bitsandbytes: layers, training, checkpoints, bad input."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

pytest.importorskip("bitsandbytes", reason="fabric-bnb's tests need bitsandbytes (pip install fabric-bnb)")

import bitsandbytes as bnb  # noqa: E402
from fabric_bnb import BitsandbytesPrecision  # noqa: E402
from fabric_bnb.layers import LAYERS  # noqa: E402

from fabric_core import Fabric  # noqa: E402

FOUR_BIT = ("nf4", "nf4-dq", "fp4", "fp4-dq")


class Net(nn.Module):
    """Two quantizable layers, a norm (kept in `dtype`), a head."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.up = nn.Linear(32, width)
        self.norm = nn.LayerNorm(width)
        self.down = nn.Linear(width, 32)
        self.head = nn.Linear(32, 8)

    def forward(self, x):
        return self.head(self.down(torch.relu(self.norm(self.up(x)))))


class LoRA(nn.Module):
    """A frozen (quantized) base layer plus a trainable low-rank adapter, as QLoRA trains."""

    def __init__(self, base: nn.Module, rank: int = 4) -> None:
        super().__init__()
        self.base = base
        self.a = nn.Parameter(torch.randn(rank, base.in_features) * 0.02)
        self.b = nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x):
        return self.base(x) + (x @ self.a.t() @ self.b.t())


def _data(n: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 32, generator=g)
    return x, (x[:, :8] * 2).sin()


def _fabric(mode: str) -> Fabric:
    return Fabric(accelerator="cpu", devices=1, precision=f"bnb-{mode}")


def _quantized(module: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in module.named_modules() if isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))}


# ------------------------------------------------------------------------------------------------ layers
@pytest.mark.parametrize("mode", [*FOUR_BIT, "int8", "int8-training"])
def test_init_module_builds_quantized_layers(mode):
    fabric = _fabric(mode)
    precision = fabric.strategy.precision
    assert isinstance(precision, BitsandbytesPrecision) and precision.mode == mode
    with fabric.init_module():
        model = Net()
    assert nn.Linear is not LAYERS[mode], "the class replacement ends with the context"
    layers = _quantized(model)
    assert sorted(layers) == ["down", "head", "up"] and all(type(m) is LAYERS[mode] for m in layers.values())
    weight = model.up.weight
    if mode in FOUR_BIT:
        assert weight.bnb_quantized and weight.dtype == torch.uint8 and weight.numel() == 32 * 64 // 2
    elif mode == "int8":
        assert weight.dtype == torch.int8 and weight.SCB is not None
    else:
        assert weight.dtype == torch.float16 and weight.requires_grad
    assert model.norm.weight.dtype == precision.dtype  # built under the precision's dtype
    model = fabric.setup(model)
    out = model(torch.randn(4, 32))
    assert out.dtype == torch.float32 and out.shape == (4, 8) and torch.isfinite(out).all()


def test_default_dtypes_and_int8_needs_float16():
    assert BitsandbytesPrecision("int8").dtype == torch.float16
    fabric = _fabric("nf4")
    assert fabric.strategy.precision.dtype == torch.bfloat16  # the CPU computes bfloat16, not float16
    with pytest.raises(ValueError, match=r"'int8' only works with `dtype=torch.float16`"):
        BitsandbytesPrecision("int8", dtype=torch.bfloat16)


def test_empty_init_then_pretrained_weights_quantize_on_load():
    """`init_module(empty_init=True)` + a full-precision checkpoint gives exactly what setting up that model gives."""
    torch.manual_seed(0)
    pretrained = Net()
    state = {k: v.clone() for k, v in pretrained.state_dict().items()}
    fabric = _fabric("nf4")
    with fabric.init_module(empty_init=True):
        model = Net()
    model.load_state_dict(state)
    reference = fabric.setup(pretrained)  # a model built outside: replaced and quantized in setup
    for (name, a), (_, b) in zip(model.state_dict().items(), reference.module.state_dict().items()):
        assert torch.equal(a, b.to(a.dtype)), name
    x = torch.randn(4, 32)
    assert torch.equal(fabric.setup(model)(x), reference(x))


def test_setup_of_a_model_built_outside_honours_ignore_modules_and_rewires_the_optimizer():
    torch.manual_seed(0)
    model = Net()
    old_up = model.up.weight
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)  # built before setup, over the float32 weights
    fabric = Fabric(accelerator="cpu", plugins=BitsandbytesPrecision("int8-training", ignore_modules={"head"}))
    model, optimizer = fabric.setup(model, optimizer)
    assert type(model.head) is nn.Linear and model.head.weight.dtype == torch.float16
    assert type(model.up) is LAYERS["int8-training"]
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert id(model.up.weight) in params and id(old_up) not in params
    x, y = _data()
    losses = []
    for _ in range(25):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses


def _bnb_int8_reference(weight: torch.Tensor, bias: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """What bitsandbytes itself computes for ``weight``: its own int8 training layer, fresh (no gradient, so it
    quantizes the weight it is given)."""
    layer = bnb.nn.Linear8bitLt(weight.shape[1], weight.shape[0], has_fp16_weights=True, threshold=6.0)
    layer.weight = bnb.nn.Int8Params(weight.detach().clone().half(), requires_grad=True, has_fp16_weights=True)
    layer.bias = nn.Parameter(bias.detach().clone().half())
    with torch.no_grad():
        return layer.train()(x.half()).float()


def test_int8_training_requantizes_without_zero_grad_first():
    """bitsandbytes reuses the last int8 weights while `.grad` is set; our layer quantizes the current weights.

    After a step, with `.grad` still set, the layer's output equals bitsandbytes' own int8 result for the updated
    weights (the same quantization: equal to float16 rounding) and is far from its result for the weights before the
    step (a stale quantization), and from a plain float matmul of those."""
    fabric = _fabric("int8-training")
    with fabric.init_module():
        model = Net()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.5))
    x, y = _data()
    before = model.up.weight.detach().clone()
    fabric.backward(nn.functional.mse_loss(model(x), y))
    optimizer.step()  # .grad stays set: no zero_grad before the next forward
    assert model.up.weight.grad is not None
    with torch.no_grad():
        got = model.module.up(x.half()).float()
    bias = model.up.bias
    current, stale = _bnb_int8_reference(model.up.weight, bias, x), _bnb_int8_reference(before, bias, x)
    plain = nn.functional.linear(x.half().float(), model.up.weight.detach().float(), bias.detach().float())
    tolerance = 5e-3
    # the step moved the output far more than the tolerance (measured 0.079 against bitsandbytes' result)
    assert (stale - current).abs().max() > 10 * tolerance
    assert (got - current).abs().max() <= tolerance, (got - current).abs().max()
    # and int8 rounding stays well inside the step's change against plain torch (measured 0.009)
    assert (got - plain).abs().max() < 0.3 * (stale - current).abs().max()


def test_qlora_with_8bit_adamw_reduces_the_loss():
    fabric = _fabric("nf4-dq")
    with fabric.init_module():
        model = Net(width=128)
    for name in ("up", "down"):
        setattr(model, name, LoRA(getattr(model, name)))
    trainable = [p for p in model.parameters() if p.requires_grad]
    model, optimizer = fabric.setup(model, bnb.optim.AdamW8bit(trainable, lr=1e-2, min_8bit_size=16))
    assert isinstance(model.up.base, bnb.nn.Linear4bit) and not model.up.base.weight.requires_grad
    x, y = _data()
    losses = []
    for _ in range(30):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses


# ------------------------------------------------------------------------------------------------ checkpoints
@pytest.mark.parametrize("mode", ["nf4-dq", "fp4", "int8", "int8-training"])
def test_quantized_checkpoint_round_trips_bit_exactly(tmp_path, mode):
    fabric = _fabric(mode)
    with fabric.init_module():
        model = Net(width=128)
    model.head = LoRA(model.head)  # something trainable in every mode
    trainable = [p for p in model.parameters() if p.requires_grad]
    model, optimizer = fabric.setup(model, bnb.optim.AdamW8bit(trainable, lr=1e-2, min_8bit_size=16))
    x, y = _data()
    for _ in range(3):
        optimizer.zero_grad()
        fabric.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
    model.eval()
    with torch.no_grad():
        before = model(x)  # a forward first: bitsandbytes moves int8 scales and repacks 4-bit weights for the CPU
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    assert any(k.endswith(("weight.absmax", "SCB")) for k in saved) or mode == "int8-training"
    fabric.save(tmp_path / "ckpt.pt", {"model": model, "optimizer": optimizer, "step": 3})

    fresh_fabric = _fabric(mode)
    with fresh_fabric.init_module(empty_init=True):
        fresh = Net(width=128)
    fresh.head = LoRA(fresh.head)
    trainable = [p for p in fresh.parameters() if p.requires_grad]
    fresh, fresh_opt = fresh_fabric.setup(fresh, bnb.optim.AdamW8bit(trainable, lr=1e-2, min_8bit_size=16))
    state = {"model": fresh, "optimizer": fresh_opt, "step": 0}
    fresh_fabric.load(tmp_path / "ckpt.pt", state)
    assert state["step"] == 3
    loaded = fresh.state_dict()
    assert saved.keys() == loaded.keys()
    for key, value in saved.items():
        assert value.dtype == loaded[key].dtype and torch.equal(value, loaded[key]), key
    fresh.eval()
    with torch.no_grad():
        assert torch.equal(fresh(x), before)
    a, b = optimizer.state_dict()["state"], fresh_opt.state_dict()["state"]
    assert a.keys() == b.keys() and a
    for index in a:
        for name, value in a[index].items():
            assert _same(value, b[index][name]), (index, name)
    # the quantized 8-bit state: uint8 moments with their block scales
    nested = [s["__bnb_optimizer_quant_state__"] for s in a.values()]
    assert any(q["state1"].dtype == torch.uint8 and q["state2"].dtype == torch.uint8 for q in nested)  # small ones: 32-bit
    assert _same(fresh_opt.state[next(iter(fresh_opt.state))]["state1"], optimizer.state[next(iter(optimizer.state))]["state1"])


def _same(a, b) -> bool:
    """Equal to the bit, through nested dicts/lists of tensors."""
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


# ------------------------------------------------------------------------------------------------ bad input
def test_unknown_mode_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"Valid modes: nf4, nf4-dq, fp4, fp4-dq, int8, int8-training"):
        BitsandbytesPrecision("int4")


def test_init_module_with_ignore_modules_is_refused():
    fabric = Fabric(accelerator="cpu", plugins=BitsandbytesPrecision("nf4", ignore_modules={"head"}))
    with pytest.raises(RuntimeError, match="is not supported"), fabric.init_module():
        Net()


def test_a_model_without_linear_layers_is_refused():
    fabric = _fabric("nf4")
    with pytest.raises(TypeError, match="has none"):
        fabric.setup(nn.Sequential(nn.Conv1d(2, 2, 1)))


def test_missing_bitsandbytes_gives_the_pip_line():
    code = (
        "import sys; sys.modules['bitsandbytes'] = None\n"
        "from fabric_core import Fabric\n"
        "try:\n"
        "    Fabric(accelerator='cpu', precision='bnb-nf4')\n"
        "except Exception as err:\n"
        "    print(type(err).__name__, err)\n"
        "from fabric_core.cli import collect_plugins\n"
        "from fabric_core.plugins import get_registry\n"
        "rows = collect_plugins(get_registry(), check=True, kinds=['precision'])['entries']\n"
        "print('LISTED', *next((e['status'], e['reason']) for e in rows if e['name'] == 'bnb-nf4'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert 'pip install "bitsandbytes>=0.50.2"' in out.stdout, out.stdout + out.stderr
    # `fabric plugins --check` says the same instead of "available"
    assert 'LISTED unavailable needs the `bitsandbytes` package: `pip install "bitsandbytes>=0.50.2"`' in out.stdout, out.stdout


def test_fsdp_refuses_a_quantized_model_up_front():
    pytest.importorskip("fabric_fsdp")
    with pytest.raises((TypeError, ValueError), match="FSDP"):
        Fabric(accelerator="cpu", strategy="fsdp", devices=2, plugins=BitsandbytesPrecision("nf4"))


def test_names_are_registered_and_listed_without_importing_bitsandbytes():
    code = (
        "import sys\n"
        "from fabric_core import Fabric\n"
        "from fabric_core.plugins import get_registry\n"
        "names = set(get_registry().names('precision'))\n"
        "assert 'bitsandbytes' not in sys.modules, 'listing names imported bitsandbytes'\n"
        "print(sorted(n for n in names if n.startswith('bnb')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for mode in (*FOUR_BIT, "int8", "int8-training"):
        assert f"'bnb-{mode}'" in out.stdout
    listing = subprocess.run(
        [sys.executable, "-m", "fabric_core", "plugins"], capture_output=True, text=True, timeout=120
    )
    assert "bnb-nf4" in listing.stdout and "fabric-bnb" in listing.stdout, listing.stdout + listing.stderr


def test_alias_of_the_llm_library_spelling():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a silent alias
        fabric = Fabric(accelerator="cpu", precision="bnb.nf4")
    assert fabric.strategy.precision.mode == "nf4"


def _keep(model, mesh):
    return model


def test_sharding_strategies_refuse_quantized_models_up_front():
    """FSDP and model_parallel would shard bitsandbytes' packed weights: refused when the Fabric is created, by name
    and as a plugin object; DDP (whole replicas) takes them."""
    fabric_fsdp = pytest.importorskip("fabric_fsdp", reason="the sharding strategies come from fabric-fsdp")
    with pytest.raises(TypeError, match="can only work with the `FSDPPrecision` plugin"):
        Fabric(accelerator="cpu", devices=2, strategy="fsdp", plugins=BitsandbytesPrecision("nf4"))
    with pytest.raises(TypeError, match=r"`ModelParallelStrategy` cannot run BitsandbytesPrecision\(mode='int8'"):
        Fabric(
            accelerator="cpu", devices=2, strategy=fabric_fsdp.ModelParallelStrategy(_keep), plugins=BitsandbytesPrecision("int8")
        )
    with pytest.raises(ValueError, match=r"does not support `Fabric\(\.\.\., precision='bnb-nf4'\)`"):
        Fabric(accelerator="cpu", devices=2, strategy=fabric_fsdp.ModelParallelStrategy(_keep), precision="bnb-nf4")
    if importlib.util.find_spec("fabric_ddp") is not None:
        assert isinstance(Fabric(accelerator="cpu", devices=2, strategy="ddp", precision="bnb-nf4").strategy.precision, BitsandbytesPrecision)
