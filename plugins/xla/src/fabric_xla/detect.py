"""Is there an XLA device here, and how many? Answered from files and environment variables only.

Importing torch_xla takes seconds, and asking its runtime initialises it (after which ``torch_xla.launch`` refuses
to start replicas), so every question the resolver asks before a run starts is answered here, with the standard
library: whether torch_xla is installed (``importlib.util.find_spec``, no import), which PJRT device the user
chose (``PJRT_DEVICE``), and how many TPU chips the PCI bus shows (the scan ``torch_xla._internal.tpu`` does).

We never ask the GCE metadata server: the reference's ``XLAAccelerator.is_available()`` reaches it through
``tpu.num_available_devices()`` -> ``tpu.version()`` even on machines without a TPU.
"""

from __future__ import annotations

import glob
import importlib.util
import os

#: Google's PCI vendor id, and the device ids of TPU chips (v2/v3, v4, v5e, v5p, v6e, 7x and two lite parts).
GOOGLE_PCI_VENDOR = "0x1ae0"
TPU_PCI_DEVICES = {"0x0027": 2, "0x005e": 1, "0x0063": 1, "0x006f": 1, "0x0076": 1, "0x0056": 1, "0x0062": 1}
#: PJRT device types whose device count an environment variable sets (torch_xla's ``<TYPE>_NUM_DEVICES``).
_COUNT_VARIABLES = {"CPU": "CPU_NUM_DEVICES", "CUDA": "GPU_NUM_DEVICES", "GPU": "GPU_NUM_DEVICES", "NEURON": "NEURON_NUM_DEVICES"}


def torch_xla_installed() -> bool:
    return importlib.util.find_spec("torch_xla") is not None


def pjrt_device() -> str:
    """``PJRT_DEVICE`` as the user set it, upper-cased (``""`` when unset)."""
    return os.environ.get("PJRT_DEVICE", "").strip().upper()


def tpu_chips() -> dict[str, int]:
    """TPU chips on the PCI bus: PCI device id -> how many of them."""
    found: dict[str, int] = {}
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            with open(vendor) as f:
                if f.read().strip() != GOOGLE_PCI_VENDOR:
                    continue
            with open(os.path.join(os.path.dirname(vendor), "device")) as f:
                device = f.read().strip()
        except OSError:
            continue
        if device in TPU_PCI_DEVICES:
            found[device] = found.get(device, 0) + 1
    return found


def libtpu_installed() -> bool:
    return bool(os.environ.get("TPU_LIBRARY_PATH")) or importlib.util.find_spec("libtpu") is not None


def tpu_present() -> bool:
    """A TPU that torch_xla can drive: torch_xla and libtpu installed, chips on the bus, ``PJRT_DEVICE`` not
    pointing elsewhere. What ``accelerator="auto"`` asks."""
    if pjrt_device() not in ("", "TPU") or not torch_xla_installed() or not libtpu_installed():
        return False
    return bool(tpu_chips()) or bool(glob.glob("/dev/accel*"))


def xla_available() -> bool:
    """What ``accelerator="tpu"`` needs: a TPU, or torch_xla with another PJRT device chosen explicitly
    (``PJRT_DEVICE=CPU`` runs the XLA strategies on the CPU, which is how they are tested)."""
    if not torch_xla_installed():
        return False
    return tpu_present() if pjrt_device() in ("", "TPU") else True


def device_count() -> int:
    """Devices of this host that one process can address: TPU cores (2 per v2/v3 chip, else 1 per chip; limited
    by ``TPU_VISIBLE_CHIPS``), or ``<TYPE>_NUM_DEVICES`` for another PJRT device (default 1)."""
    kind = pjrt_device()
    if kind in ("", "TPU"):
        visible = os.environ.get("TPU_VISIBLE_CHIPS", "").strip()
        chips = tpu_chips()
        per_chip = max(TPU_PCI_DEVICES[d] for d in chips) if chips else 1
        if visible:
            return per_chip * len([c for c in visible.split(",") if c.strip()])
        return sum(TPU_PCI_DEVICES[d] * n for d, n in chips.items()) or len(glob.glob("/dev/accel*"))
    variable = _COUNT_VARIABLES.get(kind)
    value = os.environ.get(variable, "").strip() if variable else ""
    return int(value) if value.isdigit() and int(value) > 0 else 1


def tpu_generation() -> str | None:
    """``"v4"``, ``"v5e"``, ``"v5p"``, ... from the accelerator type (``"v5litepod-8"`` is a v5e), or ``None``.

    Read from ``TPU_ACCELERATOR_TYPE``/``ACCELERATOR_TYPE`` when set, else from torch_xla's TPU environment, asked
    only when torch_xla is already imported (a running XLA job), since that query may reach the metadata server.
    """
    import sys

    name = os.environ.get("TPU_ACCELERATOR_TYPE") or os.environ.get("ACCELERATOR_TYPE") or ""
    if not name and "torch_xla" in sys.modules and pjrt_device() in ("", "TPU"):
        try:
            from torch_xla._internal import tpu

            name = str(tpu.get_tpu_env().get("ACCELERATOR_TYPE", ""))
        except Exception:  # the metadata server's reply (requests, yaml, torch_xla's internals) may fail in any way
            name = ""
    kind = name.strip().lower().split("-", 1)[0]
    if not kind:
        return None
    return {"v5litepod": "v5e", "v5lite": "v5e", "v6litepod": "v6e", "v6lite": "v6e"}.get(kind, kind)
