"""bf16-mixed under a real 2-process DDP run (``ddp_spawn``, gloo), when fabric-ddp is installed.

The run happens in a child interpreter with a timeout, so a hung rendezvous fails the test instead of the suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("fabric_ddp", reason="fabric-ddp is not installed: the DDP + bf16-mixed check needs it")

SCRIPT = textwrap.dedent(
    """
    import json

    import torch
    from torch import nn

    from fabric_core import Fabric


    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(8, 4)
            self.seen = {}

        def forward(self, x):
            y = self.linear(x)
            self.seen["linear_dtype"] = str(y.dtype)
            self.seen["autocast"] = torch.is_autocast_enabled("cpu")
            return y


    def run(fabric):
        torch.manual_seed(0)
        probe = Probe()
        model, optimizer = fabric.setup(probe, torch.optim.SGD(probe.parameters(), lr=0.1))
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(fabric.global_rank))  # different per rank
        out = model(x)
        try:
            out.sum().backward()
            guard = False
        except RuntimeError as err:
            guard = "fabric.backward(loss)" in str(err)
        optimizer.zero_grad()
        out = model(x)
        fabric.backward(out.square().mean())
        grads = fabric.all_gather(probe.linear.weight.grad)
        optimizer.step()
        params = fabric.all_gather(probe.linear.weight.detach())
        return {
            "world_size": fabric.world_size,
            "precision": type(fabric.strategy.precision).__name__ + ":" + fabric.strategy.precision.precision,
            "seen": probe.seen,
            "out_dtype": str(out.dtype),
            "param_dtype": str(probe.linear.weight.dtype),
            "grad_dtype": str(probe.linear.weight.grad.dtype),
            "grads_synced": bool(torch.equal(grads[0], grads[1])),
            "params_equal": bool(torch.equal(params[0], params[1])),
            "guard": guard,
        }


    if __name__ == "__main__":
        fabric = Fabric(accelerator="cpu", strategy="ddp_spawn", devices=2, precision="bf16-mixed")
        print("RESULT " + json.dumps(fabric.launch(run)))
    """
)


@pytest.mark.multiprocess
def test_bf16_mixed_with_ddp_spawn(tmp_path):
    script = tmp_path / "amp_ddp_run.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FABRIC_")}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, done.stdout + done.stderr
    result = json.loads(lines[0][len("RESULT ") :])
    assert result == {
        "world_size": 2,
        "precision": "MixedPrecision:bf16-mixed",
        "seen": {"linear_dtype": "torch.bfloat16", "autocast": True},
        "out_dtype": "torch.float32",
        "param_dtype": "torch.float32",
        "grad_dtype": "torch.float32",
        "grads_synced": True,
        "params_equal": True,
        "guard": True,
    }
