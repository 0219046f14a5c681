"""fabric-ao on one CPU process, with the real torchao: float8 layers (emulated), training, checkpoints, bad input,
the Transformer Engine names."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch
from torch import nn

pytest.importorskip("torchao", reason="fabric-ao's tests need torchao (pip install fabric-ao)")

from fabric_ao import Float8Precision  # noqa: E402
from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

from fabric_core import Fabric  # noqa: E402


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32)
        self.odd = nn.Linear(32, 10)  # 10 is not a multiple of 16: skipped, with a warning naming it

    def forward(self, x):
        return self.odd(torch.relu(self.down(torch.relu(self.up(x)))))


def _data(n: int = 64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 32, generator=g)
    return x, (x[:, :10] * 2).sin()


def _train(fabric: Fabric, model: nn.Module, steps: int = 30) -> list[float]:
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    x, y = _data()
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_float8_by_name_converts_eligible_layers_and_warns_about_the_rest():
    fabric = Fabric(accelerator="cpu", precision="float8")
    precision = fabric.strategy.precision
    assert isinstance(precision, Float8Precision) and precision.emulate is True  # no float8 matmuls on a CPU
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match=r"odd \(32->10\)"):
        model = fabric.setup(Net())
    assert isinstance(model.up, Float8Linear) and isinstance(model.down, Float8Linear)
    assert type(model.odd) is nn.Linear
    assert model.up.config.emulate and model.up.weight.dtype == torch.float32  # master weights stay float32


def _float8_emulated(t: torch.Tensor, rowwise: bool = False) -> torch.Tensor:
    """Plain torch: ``t`` through a float8 (e4m3) cast and back, with a dynamic scale that maps the amax to 448: one
    scale for the tensor, or (rowwise) one per row rounded down to a power of 2, as torchao's recipes do."""
    amax = t.abs().amax(dim=-1, keepdim=True) if rowwise else t.abs().max()
    scale = (448.0 / amax.double().clamp(min=1e-12)).float()
    if rowwise:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return (t * scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() / scale


def _library_losses(model: nn.Module, recipe: str, steps: int = 30) -> list[float]:
    """torchao's own conversion (emulated, the odd layer left out) trained by a plain torch loop, as in `_train`."""
    import dataclasses

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    model = convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fqn != "odd")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = _data()
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _three_copies() -> tuple[Net, Net, Net]:
    torch.manual_seed(0)
    first = Net()
    second, third = Net(), Net()
    second.load_state_dict(first.state_dict())
    third.load_state_dict(first.state_dict())
    return first, second, third


def test_float8_training_tracks_full_precision():
    """float8 happens: a converted layer's output is the float8 cast of its input times the float8 cast of its weight
    (recomputed here in plain torch), 0.09 away from the float32 layer; training equals torchao's own conversion
    trained by a plain loop, step for step; and it ends near the float32 run."""
    reference, float8, library = _three_copies()
    x, _ = _data()
    with pytest.warns(UserWarning, match="not multiples of 16"):
        fabric = Fabric(accelerator="cpu", precision="float8")
        model = fabric.setup(float8)
    with torch.no_grad():
        out = model.up(x)
        emulated = _float8_emulated(x) @ _float8_emulated(reference.up.weight).t() + reference.up.bias
        full_out = reference.up(x)
    torch.testing.assert_close(out, emulated, rtol=0, atol=1e-6)
    assert (out - full_out).abs().max() > 0.01  # the casts change the result (measured 0.09)

    full = _train(Fabric(accelerator="cpu"), reference)
    ours = _train(fabric, float8)
    assert ours == pytest.approx(_library_losses(library, "tensorwise"), rel=1e-6, abs=1e-7)
    assert ours[-1] < 0.5 * ours[0], ours
    assert abs(ours[-1] - full[-1]) < 0.1 * full[0], (ours[-1], full[-1])


def test_float8_rowwise_training():
    """`precision="float8-rowwise"`: one scale per row (of the input, of the weight), rounded to a power of 2, as
    recomputed here in plain torch (and unlike the tensorwise cast); training equals torchao's own rowwise recipe."""
    reference, float8, library = _three_copies()
    x, _ = _data()
    with pytest.warns(UserWarning, match="not multiples of 16"):
        fabric = Fabric(accelerator="cpu", precision="float8-rowwise")
        model = fabric.setup(float8)
    assert fabric.strategy.precision.recipe == "rowwise" and isinstance(model.up, Float8Linear)
    with torch.no_grad():
        out = model.up(x)
        rowwise = _float8_emulated(x, True) @ _float8_emulated(reference.up.weight, True).t() + reference.up.bias
        tensorwise = _float8_emulated(x) @ _float8_emulated(reference.up.weight).t() + reference.up.bias
    torch.testing.assert_close(out, rowwise, rtol=0, atol=1e-6)
    assert (out - tensorwise).abs().max() > 1e-3
    ours = _train(fabric, float8, steps=15)
    assert ours == pytest.approx(_library_losses(library, "rowwise", steps=15), rel=1e-6, abs=1e-7)
    assert ours[-1] < 0.7 * ours[0], ours


def test_init_module_empty_init_and_checkpoint_round_trip(tmp_path):
    fabric = Fabric(accelerator="cpu", plugins=Float8Precision(module_filter_fn=lambda m, fqn: fqn != "odd"))
    with fabric.init_module(empty_init=True):
        model = Net()
    torch.manual_seed(1)
    model.load_state_dict(Net().state_dict())
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    assert isinstance(model.up, Float8Linear) and type(model.odd) is nn.Linear
    x, y = _data()
    for _ in range(3):
        optimizer.zero_grad()
        fabric.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
    fabric.save(tmp_path / "ckpt.pt", {"model": model, "optimizer": optimizer})
    fresh_fabric = Fabric(accelerator="cpu", precision="float8")
    fresh = Net()
    with pytest.warns(UserWarning):
        fresh, fresh_opt = fresh_fabric.setup(fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-2))
    fresh_fabric.load(tmp_path / "ckpt.pt", {"model": fresh, "optimizer": fresh_opt})
    for (k, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a, b), k
    with torch.no_grad():
        assert torch.equal(model(x), fresh(x))


def test_bad_input():
    with pytest.raises(ValueError, match=r"Valid: tensorwise, rowwise, rowwise_with_gw_hp"):
        Float8Precision(recipe="blockwise")
    with pytest.raises(ValueError, match="needs the 'tensorwise' recipe"):
        Float8Precision(recipe="rowwise", enable_fsdp_float8_all_gather=True)
    with pytest.raises(ValueError, match="emulate=True"):
        Fabric(accelerator="cpu", plugins=Float8Precision(emulate=False))
    with pytest.raises(TypeError, match="wrap it in a container"):
        Fabric(accelerator="cpu", precision="float8").setup(nn.Linear(16, 16))


def test_missing_torchao_gives_the_pip_line():
    code = (
        "import sys; sys.modules['torchao'] = None\n"
        "from fabric_core import Fabric\n"
        "try:\n"
        "    Fabric(accelerator='cpu', precision='float8')\n"
        "except Exception as err:\n"
        "    print(type(err).__name__, err)\n"
        "print('torchao imported' if sys.modules.get('torchao') else 'ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert 'pip install "torchao>=0.18.0,<0.19"' in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize("name", ["transformer-engine", "transformer-engine-float16"])
def test_transformer_engine_says_what_is_missing(name):
    try:
        import transformer_engine  # noqa: F401

        missing = "CUDA GPU" if not torch.cuda.is_available() else None
    except ImportError:
        missing = "pip install --no-build-isolation"
    if missing is None:
        pytest.skip("Transformer Engine and a CUDA GPU are present: nothing is missing to name (the GPU lane gives"
                    " Transformer Engine a dry check only)")
    with pytest.raises((ModuleNotFoundError, RuntimeError)) as info:
        Fabric(accelerator="cpu", precision=name)
    message = str(info.value)
    assert missing in message and "transformer_engine" in message.lower().replace("-", "_")
    assert "precision='float8'" in message  # what works here instead


def test_listing_precisions_imports_no_torchao():
    code = (
        "import sys\n"
        "from fabric_core.plugins import get_registry\n"
        "names = get_registry().names('precision')\n"
        "assert 'torchao' not in sys.modules and 'transformer_engine' not in sys.modules\n"
        "print(names)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for name in ("float8", "float8-rowwise", "transformer-engine", "transformer-engine-float16"):
        assert f"'{name}'" in out.stdout


def _no_sharding(model, mesh):
    return model


def test_model_parallel_accepts_float8_by_name_and_still_refuses_casting_precisions():
    """float8 only rewrites modules (before `parallelize_fn`), so `model_parallel` takes it by name; precisions that
    cast or quantize the weights themselves stay refused."""
    fabric_fsdp = pytest.importorskip("fabric_fsdp", reason="the model_parallel check needs fabric-fsdp")
    strategy = fabric_fsdp.ModelParallelStrategy(_no_sharding)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, precision="float8-rowwise")
    assert isinstance(fabric.strategy.precision, Float8Precision) and fabric.strategy.precision.recipe == "rowwise"
    refused = ["16-mixed"] + (["bnb-nf4"] if _installed("fabric_bnb") and _installed("bitsandbytes") else [])
    for name in refused:
        with pytest.raises(ValueError, match=rf"does not support `Fabric\(\.\.\., precision='{name}'\)`"):
            Fabric(accelerator="cpu", devices=2, strategy=fabric_fsdp.ModelParallelStrategy(_no_sharding), precision=name)


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _checked_precisions(hide: str | None = None) -> dict[str, dict]:
    """`fabric plugins --check --kind precision` as data, in a fresh process (optionally without a package)."""
    code = (
        "import json, sys\n"
        + (f"sys.modules[{hide!r}] = None\n" if hide else "")
        + "from fabric_core.cli import collect_plugins\n"
        "from fabric_core.plugins import get_registry\n"
        "print(json.dumps(collect_plugins(get_registry(), check=True, kinds=['precision'])['entries']))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return {e["name"]: e for e in json.loads(out.stdout.strip().splitlines()[-1])}


def test_plugins_check_says_what_transformer_engine_and_float8_lack():
    entries = _checked_precisions()
    for name in ("transformer-engine", "transformer-engine-float16"):
        entry = entries[name]
        if importlib.util.find_spec("transformer_engine") is None:
            assert entry["status"] == "unavailable" and entry["error"] is None, entry
            assert 'pip install --no-build-isolation "transformer_engine[pytorch]"' in entry["reason"], entry
        elif not torch.cuda.is_available():
            assert entry["status"] == "unavailable" and "needs a CUDA GPU" in entry["reason"], entry
        else:
            assert entry["status"] == "available", entry
    assert entries["float8"]["status"] == "available" and entries["float8"]["reason"] is None
    without = _checked_precisions(hide="torchao")["float8-rowwise"]
    assert without["status"] == "unavailable" and 'pip install "torchao>=0.18.0,<0.19"' in without["reason"], without
