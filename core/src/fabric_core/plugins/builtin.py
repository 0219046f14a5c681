"""The core's own plugin: built-in names, the names of this project's other distributions, and the default
answers to every decision hook.

It is registered first and through the same hooks as external plugins. Targets are import strings so that
building the registry imports nothing beyond this module. Default decision hooks are ``trylast`` so any
installed plugin can answer before them.

The first-party distributions are named here, and only here, with :meth:`~fabric_core.plugins.registry.Registrar.provided_by`:
asking for one of their names while the distribution is missing says what to install, and nobody else can take
those names without ``override=True``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from fabric_core.plugins.hookspecs import hookimpl

if TYPE_CHECKING:
    from fabric_core.accelerators.base import Accelerator
    from fabric_core.plugins.registry import Registrar, Registry
    from fabric_core.strategies.base import Strategy

_CORE = "fabric_core."

_BNB_MODES = ("nf4", "nf4-dq", "fp4", "fp4-dq", "int8", "int8-training")

#: What this project's other distributions provide, by kind (names or fnmatch patterns).
FIRST_PARTY: dict[str, dict[str, tuple[str, ...]]] = {
    "fabric-ddp": {
        "strategy": (
            "ddp",
            "ddp_spawn",
            "ddp_fork",
            "ddp_notebook",
            "ddp_find_unused_parameters_true",
            "ddp_find_unused_parameters_false",
            "dp",
        )
    },
    "fabric-fsdp": {
        "strategy": ("fsdp", "fsdp_cpu_offload", "fsdp_hybrid", "fsdp_no_reshard", "fsdp_*", "model_parallel"),
        "checkpoint_format": ("fsdp_sharded",),
    },
    "fabric-deepspeed": {
        "strategy": (
            "deepspeed",
            "deepspeed_stage_1",
            "deepspeed_stage_1_offload",
            "deepspeed_stage_2",
            "deepspeed_stage_2_offload",
            "deepspeed_stage_3",
            "deepspeed_stage_3_offload",
            "deepspeed_stage_3_offload_nvme",
            "deepspeed_*",
        ),
        "checkpoint_format": ("deepspeed",),
    },
    "fabric-xla": {
        "strategy": ("xla", "xla_fsdp", "single_xla", "xla_*"),
        "accelerator": ("tpu", "xla"),
        "launcher": ("xla",),
        "environment": ("xla",),
    },
    "fabric-amp": {"precision": ("16-mixed", "bf16-mixed", "16", "bf16")},
    "fabric-wandb": {"logger": ("wandb",)},
    "fabric-mlflow": {"logger": ("mlflow",)},
    "fabric-ft": {"strategy": ("ft_ddp", "ft_fsdp", "ft_*"), "launcher": ("ft",)},
    "fabric-ray": {"environment": ("ray",), "logger": ("ray",), "launcher": ("ray",)},
    "fabric-bnb": {
        "precision": tuple(f"bnb{sep}{mode}" for sep in "-." for mode in _BNB_MODES) + ("bnb-*", "bnb.*")
    },
    "fabric-ao": {"precision": ("float8", "float8-rowwise", "transformer-engine", "transformer-engine-float16")},
}


def _declare_first_party(registrar: Registrar) -> None:
    for distribution, kinds in FIRST_PARTY.items():
        names = kinds.get(registrar.kind, ())
        if names:
            registrar.provided_by(distribution, *names)


@hookimpl
def fabric_register_accelerators(registrar: Registrar) -> None:
    _declare_first_party(registrar)
    registrar.add("cpu", _CORE + "accelerators.cpu:CPUAccelerator", description="CPU processes")
    registrar.add("cuda", _CORE + "accelerators.cuda:CUDAAccelerator", description="NVIDIA GPUs")
    registrar.add("mps", _CORE + "accelerators.mps:MPSAccelerator", description="Apple Silicon GPU")


@hookimpl
def fabric_register_strategies(registrar: Registrar) -> None:
    _declare_first_party(registrar)
    registrar.add(
        "single_device",
        _CORE + "strategies.single_device:SingleDeviceStrategy",
        description="one process on one device",
    )


@hookimpl
def fabric_register_precisions(registrar: Registrar) -> None:
    _declare_first_party(registrar)
    registrar.add(
        "32-true", _CORE + "precision.full:FullPrecision", description="float32 weights and math", aliases={"32": None}
    )
    registrar.add(
        "64-true", _CORE + "precision.double:DoublePrecision", description="float64 weights and math", aliases={"64": None}
    )
    registrar.add("16-true", _CORE + "precision.half:HalfPrecision", description="float16 weights, no autocast", precision="16-true")
    registrar.add(
        "bf16-true", _CORE + "precision.half:HalfPrecision", description="bfloat16 weights, no autocast", precision="bf16-true"
    )


@hookimpl
def fabric_register_launchers(registrar: Registrar) -> None:
    registrar.add(
        "subprocess",
        _CORE + "launchers.subprocess_script:SubprocessScriptLauncher",
        description="re-runs the script for local ranks 1..N-1",
    )
    for method in ("spawn", "fork", "forkserver"):
        registrar.add(
            method,
            _CORE + "launchers.multiprocessing:MultiProcessingLauncher",
            description=f"multiprocessing ({method}) running a function",
            start_method=method,
        )


@hookimpl
def fabric_register_environments(registrar: Registrar) -> None:
    env = _CORE + "environments."
    # `detected_by`: outside such a job, detection imports none of these modules. SLURM is always asked: it warns
    # when `srun` is on the PATH but did not start the process (the usual cause of a hanging SLURM job).
    registrar.add(
        "torchelastic",
        env + "torchelastic:TorchElasticEnvironment",
        description="torchrun / fabric run",
        detected_by=("TORCHELASTIC_RUN_ID",),
    )
    registrar.add("slurm", env + "slurm:SLURMEnvironment", description="SLURM srun")
    registrar.add("lsf", env + "lsf:LSFEnvironment", description="IBM LSF jsrun", detected_by=("LSB_JOBID",))
    registrar.add(
        "mpi",
        env + "mpi:MPIEnvironment",
        description="mpirun (Open MPI / MPICH env vars)",
        detected_by=("OMPI_COMM_WORLD_SIZE", "PMI_SIZE"),
    )
    registrar.add(
        "kubeflow", env + "kubeflow:KubeflowEnvironment", description="Kubeflow PyTorchJob (explicit only)", detected_by=()
    )
    registrar.add("plain", env + "plain:PlainEnvironment", description="MASTER_ADDR/NODE_RANK/LOCAL_RANK env vars")


@hookimpl
def fabric_register_loggers(registrar: Registrar) -> None:
    _declare_first_party(registrar)
    # By name, each logs to its own folder below ./fabric_logs, so `loggers=["csv", "tensorboard"]` never share one.
    registrar.add(
        "csv", _CORE + "loggers.csv:CSVLogger", description="metrics.csv and hparams.json per run", root_dir="fabric_logs", name="csv"
    )
    registrar.add(
        "tensorboard",
        _CORE + "loggers.tensorboard:TensorBoardLogger",
        description="TensorBoard event files (needs tensorboard)",
        root_dir="fabric_logs",
        name="tensorboard",
    )


@hookimpl
def fabric_register_checkpoint_formats(registrar: Registrar) -> None:
    _declare_first_party(registrar)
    registrar.add(
        "single_file",
        _CORE + "io.single_file:SingleFileFormat",
        description="one torch.save file written by global rank 0 (every strategy's default)",
        recognised_by=_CORE + "io.single_file:is_single_file",
    )


# ---------------------------------------------------------------------------------------------- default decisions


@hookimpl(trylast=True)
def fabric_auto_accelerator(registry: Registry) -> str | None:
    for name in ("cuda", "mps"):
        if (("accelerator", name) in registry) and registry.get("accelerator", name).load().is_available():
            return name
    return "cpu"


@hookimpl(trylast=True)
def fabric_auto_strategy(
    registry: Registry, accelerator: Accelerator, num_devices: int, num_nodes: int, interactive: bool
) -> str | Strategy | None:
    if num_devices <= 1 and num_nodes <= 1:
        return "single_device"
    return None


@hookimpl(trylast=True)
def fabric_select_precision(registry: Registry, precision: str, strategy: Strategy, accelerator: Accelerator) -> Any:
    if ("precision", precision) not in registry:
        return None  # the resolver explains what is missing (e.g. `pip install fabric-amp`)
    return registry.create("precision", precision)


@hookimpl(trylast=True)
def fabric_detect_cluster_environment(registry: Registry) -> Any:
    from fabric_core.environments.base import select_environment

    classes = []
    for entry in registry.entries("environment"):
        if not entry.may_detect(os.environ):
            continue  # none of the variables its detect() needs is set: not imported
        try:
            classes.append(entry.load())
        except ImportError:
            continue  # a broken third-party environment must not stop detection of the others
    return select_environment(classes)


@hookimpl(trylast=True)
def fabric_select_launcher(registry: Registry, strategy: Strategy) -> Any:
    env = strategy.cluster_environment
    if strategy.launcher_name is None or (env is not None and env.creates_processes_externally):
        return None
    return registry.create("launcher", strategy.launcher_name, strategy)

