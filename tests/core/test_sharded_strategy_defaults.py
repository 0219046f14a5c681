"""The core's defaults with a strategy we did not write that shards parameters (``scripts/tp_strategy.py``, a small
tensor-parallel strategy over DTensors): each result that used to be silently wrong is now right, or a clear error.

* an optimizer created before the strategy replaced the parameters is pointed at the new ones (joint and separate
  setup), or refused when the replacement cannot be followed;
* the sampler shards data over the data-parallel ranks the strategy declares (tensor-parallel peers get the same
  batches), and a sharding strategy that declares none is refused at setup;
* ``clip_gradients`` returns a plain tensor;
* the default checkpoint (one file from rank 0) holds whole tensors and loads each rank's part back;
* the launcher's messages name the strategy in use.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from jobs import job_env, read_json, run_ranks
from torch import nn

from fabric_core import Fabric
from fabric_core.strategies import SingleDeviceStrategy

SCRIPTS = Path(__file__).parent / "scripts"


@pytest.mark.multiprocess
def test_a_tensor_parallel_strategy_trains_right_with_the_core_defaults(tmp_path: Path) -> None:
    run_ranks(SCRIPTS / "sharded_defaults.py", str(tmp_path), tmp_path=tmp_path, timeout=180)
    r = read_json(tmp_path / "result.json")
    assert r["world"] == 2
    # Joint setup: the optimizer was rewired to the DTensor parameters the strategy put in the model.
    assert r["optimizer_params_are_dtensors"] and r["optimizer_params_are_model_params"]
    assert r["trained"]
    # The sampler follows the declared data-parallel size (1): both peers read the same shuffled batches.
    assert r["sampler_replicas"] == 1 and r["same_batches"] == [True] * 4
    # Training with clipping matches one process on the same batches.
    assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5, abs=1e-6)
    assert r["norms"] == pytest.approx(r["ref_norms"], rel=1e-5)
    assert r["norm_types"] == ["Tensor"]  # a plain tensor, not a DTensor
    assert r["param_diff"] < 1e-5
    assert r["separate_rewired"]
    # The default single-file checkpoint gathers DTensors whole and gives each rank its part back.
    assert r["file_is_whole"] and r["loaded_shards_equal"] and r["load_remainder"] == {"step": 1}
    assert r["resumed_bit_exact"]  # optimizer state came back too
    assert "`UndeclaredTensorParallelStrategy` set the model up with sharded (DTensor) parameters" in r["undeclared_error"]
    assert "data_parallel_size" in r["undeclared_error"]


def test_launcher_message_names_the_strategy_in_use(tmp_path: Path) -> None:
    """Under ``python -c`` there is no script to re-run: the error names the third party's strategy, not ``ddp``."""
    # multiprocess-check: single process (launch() is refused under `python -c`)
    code = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(SCRIPTS)!r})
        from tp_strategy import TensorParallelStrategy
        from fabric_core import Fabric
        Fabric(accelerator="cpu", strategy=TensorParallelStrategy(), devices=2).launch()
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=job_env(OMP_NUM_THREADS="1")
    )
    assert done.returncode != 0
    message = done.stderr.strip().splitlines()[-1]
    assert message.startswith("RuntimeError: `TensorParallelStrategy` starts its other local ranks by re-running your")
    assert "sys.argv[0]='-c'" in message and "`TensorParallelStrategy(start_method='spawn')`" in message
    assert "ddp" not in message


class _InPlaceReplacing(SingleDeviceStrategy):
    """Replaces every parameter object in place, as sharding does (same module, new parameters)."""

    def setup_module(self, module: nn.Module) -> nn.Module:
        for owner in module.modules():
            for name, param in list(owner._parameters.items()):
                if param is not None:
                    owner._parameters[name] = nn.Parameter(param.detach().clone())
        return module


class _Copying(SingleDeviceStrategy):
    """Trains a copy of the model: parameters Fabric cannot trace back to the user's."""

    def setup_module(self, module: nn.Module) -> nn.Module:
        return copy.deepcopy(module)


def _setup_with_optimizer_first(strategy: SingleDeviceStrategy, joint: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    fabric = Fabric(accelerator="cpu", strategy=strategy)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    if joint:
        return fabric.setup(model, optimizer)
    model = fabric.setup_module(model)
    return model, fabric.setup_optimizers(optimizer)


@pytest.mark.parametrize("joint", [True, False], ids=["setup", "setup_module+setup_optimizers"])
def test_an_optimizer_follows_parameters_the_strategy_replaced(joint: bool) -> None:
    model, optimizer = _setup_with_optimizer_first(_InPlaceReplacing(), joint)
    assert [id(p) for p in optimizer.param_groups[0]["params"]] == [id(p) for p in model.parameters()]
    before = model.weight.detach().clone()
    model(torch.ones(4, 3)).sum().backward()
    optimizer.step()
    assert not torch.equal(model.weight, before)  # the model trains


def test_an_optimizer_left_with_untraceable_parameters_is_refused() -> None:
    with pytest.raises(ValueError, match=r"updates none of the model's parameters after `_Copying` set the model up"):
        _setup_with_optimizer_first(_Copying(), joint=True)


def test_an_optimizer_with_state_for_replaced_parameters_is_refused() -> None:
    fabric = Fabric(accelerator="cpu", strategy=_InPlaceReplacing())
    model = nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()  # state for the old parameters
    with pytest.raises(RuntimeError, match="already has state for parameters that the strategy replaced"):
        fabric.setup(model, optimizer)
