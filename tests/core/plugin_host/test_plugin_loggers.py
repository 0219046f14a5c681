"""Loggers as a plugin kind: ``fabric_register_loggers``, the core's ``csv``/``tensorboard``, names with options,
mixed with objects, and errors that teach."""

from __future__ import annotations

import pytest

from fabric_core import Fabric
from fabric_core.loggers import CSVLogger, TensorBoardLogger
from fabric_core.plugins import hookimpl


class OutsideLogger:
    """A logger class of another project (no base class of ours), registered by a plugin."""

    def __init__(self, project: str = "default", name: str | None = None, flush_every: int = 10) -> None:
        self.project, self.name_given, self.flush_every = project, name, flush_every
        self.rows: list[tuple[dict, int | None]] = []

    @property
    def name(self) -> str:
        return self.project

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics, step=None):
        self.rows.append((dict(metrics), step))

    def log_hyperparams(self, params):
        pass


class LoggerPlugin:
    @hookimpl
    def fabric_register_loggers(self, registrar):
        # `name` is a logger option here: registration's own name is positional-only
        registrar.add("outside", OutsideLogger, description="a test logger", project="registered", name="from-plugin")


def test_hook_fabric_register_loggers(use_registry):
    registry = use_registry(LoggerPlugin())
    assert registry.names("logger") == ["csv", "outside", "tensorboard"]
    fabric = Fabric(accelerator="cpu", loggers="Outside")  # names are case-insensitive
    (logger,) = fabric.loggers
    assert type(logger) is OutsideLogger
    assert (logger.project, logger.name_given, logger.flush_every) == ("registered", "from-plugin", 10)
    fabric.log("loss", 1.0, step=2)
    assert logger.rows == [({"loss": 1.0}, 2)]

    # The user's options win over the registered defaults.
    (logger,) = Fabric(accelerator="cpu", loggers={"outside": {"project": "mine", "flush_every": 1}}).loggers
    assert (logger.project, logger.name_given, logger.flush_every) == ("mine", "from-plugin", 1)


def test_builtin_csv_and_tensorboard_by_name_log_to_their_own_folders(use_registry, tmp_path, monkeypatch):
    use_registry()
    monkeypatch.chdir(tmp_path)
    csv, tensorboard = Fabric(accelerator="cpu", loggers=["csv", "tensorboard"]).loggers
    assert type(csv) is CSVLogger and type(tensorboard) is TensorBoardLogger
    assert csv.log_dir == "fabric_logs/csv/version_0"
    assert tensorboard.log_dir == "fabric_logs/tensorboard/version_0"
    (csv,) = Fabric(accelerator="cpu", loggers={"csv": {"root_dir": tmp_path / "logs", "name": "run", "version": 3}}).loggers
    assert csv.log_dir == str(tmp_path / "logs" / "run" / "version_3")


def test_names_options_and_objects_mix_in_order(use_registry, tmp_path):
    use_registry(LoggerPlugin())
    mine = OutsideLogger("object")
    loggers = Fabric(accelerator="cpu", loggers=[{"csv": {"root_dir": tmp_path}}, mine, "outside"]).loggers
    assert [type(x) for x in loggers] == [CSVLogger, OutsideLogger, OutsideLogger]
    assert loggers[1] is mine and loggers[2].project == "registered"


def test_unknown_names_teach(use_registry, install_hint):
    use_registry()
    with pytest.raises(ValueError, match=r"got 'cvs': You selected an invalid logger name.*Did you mean 'csv'\?"):
        Fabric(accelerator="cpu", loggers="cvs")
    # A typo of a name that a first-party distribution provides suggests it, with how to get it.
    with pytest.raises(ValueError, match=rf"Did you mean 'wandb'\? It is provided by .*{install_hint('fabric-wandb')}"):
        Fabric(accelerator="cpu", loggers="wnadb")
    with pytest.raises(ValueError, match=install_hint("fabric-mlflow")):
        Fabric(accelerator="cpu", loggers=["csv", "mlflow"])


def test_bad_options_name_the_logger_and_its_options(use_registry):
    use_registry()
    with pytest.raises(TypeError, match=r"The logger 'csv' \(fabric_core.loggers.csv.CSVLogger, from fabric-core\).*'rootdir'.*Its options: root_dir, name"):
        Fabric(accelerator="cpu", loggers={"csv": {"rootdir": "x"}})
    with pytest.raises(TypeError, match=r"options go as \{name: \{option: value\}\}"):
        Fabric(accelerator="cpu", loggers={"csv": "logs"})
