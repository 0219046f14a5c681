"""Peak dense FLOP/s of NVIDIA GPUs per dtype, for model FLOPs utilisation (MFU).

Every figure is the **dense** peak from NVIDIA's datasheets and architecture whitepapers (the datasheets print the
Tensor Core figures "with sparsity", twice the dense rate; MFU divides the FLOPs a dense model does by the
dense peak). ``"tf32"`` is what float32 matmuls reach on Ampere and newer when
``torch.get_float32_matmul_precision()`` is not ``"highest"``. A GPU or dtype missing here gives ``None``.
"""

from __future__ import annotations

import torch

TF32 = "tf32"

_HOPPER_SXM = {  # H100 SXM5, H200 SXM, GH200: the same Tensor Cores at the same clocks
    torch.float64: 34e12,
    torch.float32: 67e12,
    TF32: 494.7e12,
    torch.bfloat16: 989.4e12,
    torch.float16: 989.4e12,
    torch.int8: 1978.9e12,
}
_HOPPER_NVL = {  # H100 NVL and H200 NVL
    torch.float64: 30e12,
    torch.float32: 60e12,
    TF32: 417.5e12,
    torch.bfloat16: 835.5e12,
    torch.float16: 835.5e12,
    torch.int8: 1670.5e12,
}

#: chip -> dtype -> dense FLOP/s
CUDA_FLOPS: dict[str, dict[torch.dtype | str, float]] = {
    # Hopper
    "h200 sxm": _HOPPER_SXM,
    "h200 nvl": _HOPPER_NVL,
    "h100 sxm": _HOPPER_SXM,
    "h100 nvl": _HOPPER_NVL,
    "h100 pcie": {
        torch.float64: 25.6e12,
        torch.float32: 51.2e12,
        TF32: 378e12,
        torch.bfloat16: 756e12,
        torch.float16: 756e12,
        torch.int8: 1513e12,
    },
    # Ada
    "l4": {torch.float32: 30.3e12, TF32: 60e12, torch.bfloat16: 121e12, torch.float16: 121e12, torch.int8: 242e12},
    "l40": {torch.float32: 90.5e12, TF32: 90.5e12, torch.bfloat16: 181e12, torch.float16: 181e12, torch.int8: 362e12},
    # GeForce Tensor Cores run half-precision matmuls with float32 accumulation (what torch uses) at half the
    # rate of float16 accumulation: these are the float32-accumulate figures.
    "rtx 4090": {torch.float32: 82.6e12, TF32: 82.6e12, torch.bfloat16: 165.2e12, torch.float16: 165.2e12, torch.int8: 660.6e12},
    "rtx 4080 super": {torch.float32: 52.2e12, TF32: 52.2e12, torch.bfloat16: 104.4e12, torch.float16: 104.4e12, torch.int8: 417.6e12},
    "rtx 4080": {torch.float32: 48.7e12, TF32: 48.7e12, torch.bfloat16: 97.5e12, torch.float16: 97.5e12, torch.int8: 389.9e12},
    # Ampere
    "a100": {torch.float64: 9.7e12, torch.float32: 19.5e12, TF32: 156e12, torch.bfloat16: 312e12, torch.float16: 312e12, torch.int8: 624e12},
    "a6000": {torch.float32: 38.7e12, TF32: 77.4e12, torch.bfloat16: 154.8e12, torch.float16: 154.8e12, torch.int8: 309.7e12},
    "a40": {torch.float32: 37.4e12, TF32: 74.8e12, torch.bfloat16: 149.7e12, torch.float16: 149.7e12, torch.int8: 299.3e12},
    "a10g": {torch.float32: 31.2e12, TF32: 62.5e12, torch.bfloat16: 125e12, torch.float16: 125e12, torch.int8: 250e12},
    "rtx 3090 ti": {torch.float32: 40e12, TF32: 40e12, torch.bfloat16: 80e12, torch.float16: 80e12, torch.int8: 320e12},
    "rtx 3090": {torch.float32: 35.6e12, TF32: 35.6e12, torch.bfloat16: 71e12, torch.float16: 71e12, torch.int8: 284e12},
    "rtx 3080 ti": {torch.float32: 34.1e12, TF32: 34.1e12, torch.bfloat16: 68.2e12, torch.float16: 68.2e12, torch.int8: 272.8e12},
    "rtx 3080": {torch.float32: 29.8e12, TF32: 29.8e12, torch.bfloat16: 59.5e12, torch.float16: 59.5e12, torch.int8: 238e12},
    "rtx 3070": {torch.float32: 20.3e12, TF32: 20.3e12, torch.bfloat16: 40.6e12, torch.float16: 40.6e12, torch.int8: 162.6e12},
    # Turing (no bfloat16 Tensor Cores)
    "t4": {torch.float32: 8.1e12, torch.float16: 65e12, torch.int8: 130e12},
    # Volta
    "v100 sxm": {torch.float64: 7.8e12, torch.float32: 15.7e12, torch.float16: 125e12},
    "v100 pcie": {torch.float64: 7e12, torch.float32: 14e12, torch.float16: 112e12},
    "v100s pcie": {torch.float64: 8.2e12, torch.float32: 16.4e12, torch.float16: 130e12},
}


def chip_of(device_name: str) -> str | None:
    """The table's key for a name as ``torch.cuda.get_device_name`` reports it, or ``None`` when unknown.

    Examples: ``"NVIDIA H200"`` and ``"NVIDIA GH200 480GB"`` -> ``"h200 sxm"``, ``"NVIDIA H200 NVL"`` -> ``"h200
    nvl"``, ``"NVIDIA H100 80GB HBM3"`` -> ``"h100 sxm"``, ``"NVIDIA H100 PCIe"`` -> ``"h100 pcie"``,
    ``"NVIDIA A100-SXM4-80GB"`` -> ``"a100"``, ``"NVIDIA GeForce RTX 4090"`` -> ``"rtx 4090"``,
    ``"Tesla V100-SXM2-16GB"`` -> ``"v100 sxm"``.
    """
    name = " ".join(device_name.lower().replace("-", " ").split())
    words = set(name.split())
    if "h200" in words or "gh200" in words:
        return "h200 nvl" if "nvl" in words else "h200 sxm"
    if "h100" in words:
        if "nvl" in words:
            return "h100 nvl"
        if "pcie" in words or "hbm2e" in words:
            return "h100 pcie"
        return "h100 sxm"  # "NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM5 ..."
    if "l40s" in words:
        return None  # not in the table: its figures differ from the L40's
    for chip in ("a100", "a6000", "a40", "a10g", "l40", "l4", "t4"):
        if f" {chip} " in f" {name} ":
            return chip
    if "rtx" in words and "geforce" in words and "laptop" not in words:
        number = next((w for w in name.split() if w.isdigit()), None)
        suffix = " super" if "super" in words else " ti" if "ti" in words else ""
        chip = f"rtx {number}{suffix}"
        return chip if chip in CUDA_FLOPS else None
    if "v100s" in words:
        return "v100s pcie"
    if "v100" in words:
        return "v100 sxm" if any(w.startswith("sxm") for w in words) else "v100 pcie"
    return None


def cuda_flops(device_name: str, dtype: torch.dtype | str, tf32_matmuls: bool) -> float | None:
    """Dense peak FLOP/s of ``device_name`` for ``dtype`` (float32 counts as TF32 when ``tf32_matmuls``)."""
    chip = chip_of(device_name)
    if chip is None:
        return None
    table = CUDA_FLOPS[chip]
    if dtype is torch.float32 and tf32_matmuls and TF32 in table:
        dtype = TF32
    return table.get(dtype)
