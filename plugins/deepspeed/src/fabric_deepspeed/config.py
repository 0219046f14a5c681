"""The DeepSpeed config: from a user's dict or JSON file, or built from the reference's keyword options.

Pure Python (no torch, no deepspeed), so every rule here is testable in isolation. Two steps:

1. :func:`user_config` is what the strategy was configured with: the ``config=`` dict or JSON file (or
   ``PL_DEEPSPEED_CONFIG_PATH``, the reference's variable), else :func:`default_config` from the keyword options,
   exactly as the well-known ``DeepSpeedStrategy`` builds it.
2. :func:`engine_config` is what the engine gets, once the precision and the device are known: a copy with the
   precision section, a batch size, and the settings that give DeepSpeed Fabric's semantics on every device
   (the caller owns the optimizer step) and avoid JIT-compiled ops on the CPU. Keys the user set are never
   changed; a combination DeepSpeed would reject late is refused here with the way out.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

from fabric_core.utilities import MisconfigurationException

#: The reference's variable: a DeepSpeed config file used when no ``config=`` is given.
CONFIG_PATH_VARIABLE = "PL_DEEPSPEED_CONFIG_PATH"
OFFLOAD_DEVICES = ("cpu", "nvme")

#: The well-known strategy's keyword options that shape the config, with its defaults.
OPTION_DEFAULTS: dict[str, Any] = {
    "zero_optimization": True,
    "stage": 2,
    "remote_device": None,
    "offload_optimizer": False,
    "offload_parameters": False,
    "offload_params_device": "cpu",
    "nvme_path": "/local_nvme",
    "params_buffer_count": 5,
    "params_buffer_size": 100_000_000,
    "max_in_cpu": 1_000_000_000,
    "offload_optimizer_device": "cpu",
    "optimizer_buffer_count": 4,
    "block_size": 1048576,
    "queue_depth": 8,
    "single_submit": False,
    "overlap_events": True,
    "thread_count": 1,
    "pin_memory": False,
    "sub_group_size": 1_000_000_000_000,
    "contiguous_gradients": True,
    "overlap_comm": True,
    "allgather_partitions": True,
    "reduce_scatter": True,
    "allgather_bucket_size": 200_000_000,
    "reduce_bucket_size": 200_000_000,
    "zero_allow_untested_optimizer": True,
    "logging_batch_size_per_gpu": None,
    "partition_activations": False,
    "cpu_checkpointing": False,
    "contiguous_memory_optimization": False,
    "synchronize_checkpoint_boundary": False,
}
#: Options that go to the ``fp16`` section when ``16-mixed``/``16-true`` is used (they also apply with a config).
FP16_OPTION_DEFAULTS: dict[str, Any] = {
    "loss_scale": 0,
    "initial_scale_power": 16,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "min_loss_scale": 1,
}
_ZERO_KEYS = (
    "stage",
    "contiguous_gradients",
    "overlap_comm",
    "allgather_partitions",
    "reduce_scatter",
    "allgather_bucket_size",
    "reduce_bucket_size",
    "sub_group_size",
)
_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def check_options(options: dict[str, Any]) -> None:
    """Refuse option values the config cannot mean (at construction, before anything runs)."""
    stage = options["stage"]
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ValueError(f"`stage` must be 0, 1, 2 or 3 (ZeRO stages), got {stage!r}.")
    for name in ("offload_params_device", "offload_optimizer_device"):
        if options[name] not in OFFLOAD_DEVICES:
            raise ValueError(f"`{name}` must be one of {OFFLOAD_DEVICES}, got {options[name]!r}.")
    if options["remote_device"] not in (None, *OFFLOAD_DEVICES):
        raise ValueError(f"`remote_device` must be None, 'cpu' or 'nvme', got {options['remote_device']!r}.")
    if options["offload_parameters"] and options["stage"] != 3:
        raise ValueError(
            "`offload_parameters=True` needs ZeRO stage 3 (only stage 3 partitions the parameters); got"
            f" `stage={options['stage']}`. Use `offload_optimizer=True` to offload the optimizer state with stage"
            " 1 or 2."
        )


def load_config(config: str | os.PathLike | dict[str, Any] | None) -> dict[str, Any] | None:
    """The user's config: a dict (copied), a JSON file, ``PL_DEEPSPEED_CONFIG_PATH`` when ``None``, or ``None``."""
    if config is None:
        config = os.environ.get(CONFIG_PATH_VARIABLE) or None
        if config is None:
            return None
    if isinstance(config, dict):
        return copy.deepcopy(config)
    if not isinstance(config, (str, os.PathLike)):
        raise TypeError(f"`config` must be a dict or the path of a JSON file, got {type(config).__name__}.")
    path = Path(config)
    if not path.is_file():
        raise MisconfigurationException(
            f"You passed in a path to a DeepSpeed config but the path does not exist: {str(config)!r}. Pass the"
            " path of an existing JSON file, or the config as a dict."
        )
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise MisconfigurationException(f"The DeepSpeed config {str(path)!r} is not valid JSON: {err}") from err
    if not isinstance(loaded, dict):
        raise MisconfigurationException(f"The DeepSpeed config {str(path)!r} must hold a JSON object, got {type(loaded).__name__}.")
    return loaded


def default_config(options: dict[str, Any]) -> dict[str, Any]:
    """The config the well-known ``DeepSpeedStrategy`` builds from its keyword options (same keys and values)."""
    cfg: dict[str, Any] = {
        "activation_checkpointing": {
            "partition_activations": options["partition_activations"],
            "cpu_checkpointing": options["cpu_checkpointing"],
            "contiguous_memory_optimization": options["contiguous_memory_optimization"],
            "synchronize_checkpoint_boundary": options["synchronize_checkpoint_boundary"],
        },
        "aio": {
            "block_size": options["block_size"],
            "queue_depth": options["queue_depth"],
            "single_submit": options["single_submit"],
            "overlap_events": options["overlap_events"],
            "thread_count": options["thread_count"],
        },
    }
    if options["zero_optimization"]:
        zero: dict[str, Any] = {key: options[key] for key in _ZERO_KEYS}
        if options["stage"] < 2:
            # Nothing to overlap below stage 2, and DeepSpeed refuses it when the caller owns the step (see
            # `engine_config`): the reference's default `overlap_comm=True` would make stage 0/1 unusable.
            zero.pop("overlap_comm")
        if options["offload_optimizer"]:
            zero["offload_optimizer"] = {
                "device": options["offload_optimizer_device"],
                "nvme_path": options["nvme_path"],
                "buffer_count": options["optimizer_buffer_count"],
                "pin_memory": options["pin_memory"],
            }
        if options["offload_parameters"]:
            zero["offload_param"] = {
                "device": options["offload_params_device"],
                "nvme_path": options["nvme_path"],
                "buffer_count": options["params_buffer_count"],
                "buffer_size": options["params_buffer_size"],
                "max_in_cpu": options["max_in_cpu"],
                "pin_memory": options["pin_memory"],
            }
        cfg = {"zero_allow_untested_optimizer": options["zero_allow_untested_optimizer"], "zero_optimization": zero, **cfg}
    if options["logging_batch_size_per_gpu"] is not None:
        cfg = {"train_micro_batch_size_per_gpu": options["logging_batch_size_per_gpu"], **cfg}
    return cfg


def user_config(config: Any, options: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The strategy's config and the keyword options it ignores (non-default options next to ``config=``).

    As in the reference, a given config replaces every default; unlike the reference, options that were set and
    would be ignored are reported (the strategy warns), so nothing is dropped silently.
    """
    loaded = load_config(config)
    if loaded is None:
        return default_config(options), []
    ignored = [name for name, default in OPTION_DEFAULTS.items() if options.get(name, default) != default]
    return loaded, ignored


def zero_stage(cfg: dict[str, Any]) -> int:
    zero = cfg.get("zero_optimization")
    if not isinstance(zero, dict):
        return 0
    return int(zero.get("stage", 0) or 0)


def offload_devices(cfg: dict[str, Any]) -> set[str]:
    """The devices the config offloads optimizer state or parameters to (``{"cpu"}``, ``{"nvme"}``, ...)."""
    zero = cfg.get("zero_optimization")
    if not isinstance(zero, dict):
        return set()
    found = set()
    for key in ("offload_optimizer", "offload_param"):
        section = zero.get(key)
        if isinstance(section, dict) and section.get("device") not in (None, "none"):
            found.add(str(section["device"]))
    return found


def nvme_paths(cfg: dict[str, Any]) -> list[str]:
    zero = cfg.get("zero_optimization")
    if not isinstance(zero, dict):
        return []
    paths = []
    for key in ("offload_optimizer", "offload_param"):
        section = zero.get(key)
        if isinstance(section, dict) and section.get("device") == "nvme":
            paths.append(str(section.get("nvme_path", OPTION_DEFAULTS["nvme_path"])))
    return paths


def precision_section(precision: str, fp16_options: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """``("bf16", {...})``/``("fp16", {...})`` for the precision name, ``None`` for float32."""
    if precision in ("16-mixed", "16-true"):
        return "fp16", {"enabled": True, **fp16_options}
    if precision in ("bf16-mixed", "bf16-true"):
        return "bf16", {"enabled": True}
    return None


def engine_config(
    base: dict[str, Any], precision: str, device_type: str, fp16_options: dict[str, Any]
) -> dict[str, Any]:
    """The config the engine gets: ``base`` plus what Fabric needs, never overriding a key the user set.

    * the precision's ``bf16``/``fp16`` section (unless the config has one);
    * ``train_micro_batch_size_per_gpu: 1`` when no batch size is given (DeepSpeed requires one; it only feeds
      its own dataloader and throughput logs) and ``gradient_accumulation_steps: 1`` likewise;
    * ``managed_gradient_accumulation: false``: every ``optimizer.step()`` is an optimizer step, as in any Fabric
      loop (DeepSpeed's default would count micro-steps and skip updates until its own boundary);
    * ``gradient_clipping: 0.0``: no clipping unless asked for, as with every other strategy (DeepSpeed 0.19
      clips the gradient norm at 1.0 by default, which silently changes every update whose norm exceeds 1);
    * on the CPU with offloading, ``zero_force_ds_cpu_optimizer: false``, so the user's torch optimizer is kept
      (otherwise DeepSpeed swaps in ``DeepSpeedCPUAdam``, a JIT-compiled op: a C++ compiler and ~1.5 min).
    """
    cfg = copy.deepcopy(base)
    section = precision_section(precision, fp16_options)
    wanted = section[0] if section is not None else None
    enabled = [key for key in ("fp16", "bf16") if isinstance(cfg.get(key), dict) and cfg[key].get("enabled") is True]
    if enabled and enabled != [wanted]:
        raise ValueError(
            f"The DeepSpeed config enables {' and '.join(enabled)}, but the precision is {precision!r}: the engine and"
            " the inputs Fabric casts would disagree. Pass the matching precision"
            f" (`Fabric(precision={'bf16-mixed' if enabled == ['bf16'] else '16-mixed'!r})`), or remove the section"
            " from the config and let `precision=` decide."
        )
    if section is not None and not enabled:
        cfg[section[0]] = {**section[1], **(cfg.get(section[0]) or {}), "enabled": True}
    if device_type == "cpu" and precision in ("16-mixed", "16-true"):
        raise ValueError(
            f"`precision={precision!r}` is not supported by DeepSpeed on the CPU (its fp16 needs a GPU). Use"
            " `precision='bf16-mixed'` (or 'bf16-true') on the CPU."
        )
    if not any(key in cfg for key in _BATCH_KEYS):
        cfg["train_micro_batch_size_per_gpu"] = 1
    if "gradient_accumulation_steps" not in cfg and "train_batch_size" not in cfg:
        cfg["gradient_accumulation_steps"] = 1
    zero = cfg.get("zero_optimization")
    if "managed_gradient_accumulation" not in cfg:
        if zero_stage(cfg) < 2 and isinstance(zero, dict) and zero.get("overlap_comm"):
            raise ValueError(
                f"The DeepSpeed config sets `overlap_comm: true` with ZeRO stage {zero_stage(cfg)}. Fabric steps the"
                " optimizer on every `optimizer.step()` (`managed_gradient_accumulation: false`), which DeepSpeed"
                " allows with `overlap_comm` only for ZeRO stages 2 and 3. Remove `overlap_comm`, or set"
                " `managed_gradient_accumulation: true` yourself and step as DeepSpeed's own loop does."
            )
        cfg["managed_gradient_accumulation"] = False
    if "gradient_clipping" not in cfg:
        cfg["gradient_clipping"] = 0.0
    if device_type == "cpu" and offload_devices(cfg) and "zero_force_ds_cpu_optimizer" not in cfg:
        cfg["zero_force_ds_cpu_optimizer"] = False
    return cfg

