"""fabric-bnb never holds the model in full precision: ``fabric.init_module(empty_init=True)`` then loading a
full-precision checkpoint adds, per layer, only that layer's quantized weight to the process's peak resident memory.

Measured in a fresh process (Linux: the peak RSS is reset through ``/proc/self/clear_refs`` before each step,
glibc returns freed blocks at once with a fixed mmap threshold). bitsandbytes' CPU quantization has a transient of
its own that grows with one layer's size, so the check compares two depths: the slope of the peak over the number of
layers is what the model costs per layer (a model materialised in full precision costs at least 1 bf16 layer)."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
from jobs import run_script

pytest.importorskip("bitsandbytes", reason="fabric-bnb's tests need bitsandbytes (pip install fabric-bnb)")
if not sys.platform.startswith("linux") or not Path("/proc/self/clear_refs").exists():
    pytest.skip("resetting the peak resident memory needs Linux's /proc/self/clear_refs", allow_module_level=True)

SCRIPT = textwrap.dedent(
    """
    import gc, json, sys

    import torch
    from torch import nn

    from fabric_core import Fabric

    WIDTH = 2048
    precision = sys.argv[1]
    fabric = Fabric(accelerator="cpu", precision=precision)


    def status(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


    def peak_of(fn):
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # peak RSS := current RSS
        before = status("VmRSS")
        out = fn()
        return out, status("VmHWM") - before


    def build(depth):
        with fabric.init_module(empty_init=True):
            return nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(depth)])


    torch.manual_seed(0)
    pretrained = {f"{i}.weight": torch.randn(WIDTH, WIDTH, dtype=torch.bfloat16) for i in range(6)}
    warm = build(1)  # bitsandbytes' one-off allocations (its kernels' tables) happen here, not in the measurement
    warm.load_state_dict({"0.weight": pretrained["0.weight"]})
    del warm
    result = {}
    for depth in (2, 6):
        model, result[f"init{depth}"] = peak_of(lambda: build(depth))
        state = {k: v for k, v in pretrained.items() if int(k.split(".")[0]) < depth}
        _, result[f"load{depth}"] = peak_of(lambda: model.load_state_dict(state))
        result["kinds"] = sorted({type(m).__name__ for m in model})
        del model
    reference = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(2)]).to(torch.bfloat16)
    reference.load_state_dict({k: pretrained[k] for k in ("0.weight", "1.weight")})
    model = build(2)
    model.load_state_dict({k: pretrained[k] for k in ("0.weight", "1.weight")})
    x = torch.randn(4, WIDTH)
    out = fabric.setup(model)(x)
    result["close"] = float((out - reference(x.bfloat16()).float()).abs().mean() / out.abs().mean())
    layer = WIDTH * WIDTH * 2  # bytes of one weight in bfloat16
    result["init_per_layer"] = (result["init6"] - result["init2"]) / (4 * layer)
    result["load_per_layer"] = (result["load6"] - result["load2"]) / (4 * layer)
    print("RESULT " + json.dumps(result))
    """
)


def _measure(tmp_path: Path, precision: str) -> dict:
    script = tmp_path / "bnb_memory.py"
    script.write_text(SCRIPT)
    out = run_script(script, precision, timeout=300, tmp_path=tmp_path, env={"MALLOC_MMAP_THRESHOLD_": "65536"})
    return next(json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT "))


@pytest.mark.parametrize(("precision", "layer", "most"), [("bnb-nf4", "NF4Linear", 0.45), ("bnb-int8", "Int8InferenceLinear", 0.7)])
def test_empty_init_and_load_cost_a_quantized_layer_per_layer(tmp_path, precision, layer, most):
    result = _measure(tmp_path, precision)
    assert result["kinds"] == [layer], result
    # nf4 keeps 0.28 and int8 0.5 of a bfloat16 weight; a full-precision copy of the model would add >= 1 per layer
    assert result["init_per_layer"] < most and result["load_per_layer"] < most, result
    assert result["close"] < 0.2, result  # the loaded checkpoint, quantized: close to the bfloat16 model's output


def test_the_measurement_sees_a_full_precision_model(tmp_path):
    """The same measurement with `bf16-true`: loading materialises every bfloat16 weight, 1 layer per layer."""
    result = _measure(tmp_path, "bf16-true")
    assert result["load_per_layer"] > 0.9, result
