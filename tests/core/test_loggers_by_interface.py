"""Loggers and callbacks are accepted as the reference accepts them: loggers by interface, callbacks as any objects.
Plus what Fabric does for loggers at the end of a run (finalize on teardown and on failure, at exit) and the
checkpoint hook of our Logger base class."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import types
from unittest.mock import Mock

import pytest
import torch

from fabric_core import Fabric
from fabric_core.io import CheckpointLocation
from fabric_core.loggers import CSVLogger, Logger


class ForeignLogger:
    """A logger written to the reference's Logger interface by another project: no base class of ours."""

    def __init__(self, with_finalize: bool = True) -> None:
        self.metrics: list[tuple[dict, int | None]] = []
        self.statuses: list[str] = []
        if not with_finalize:
            self.finalize = None  # some loggers have no finalize: Fabric must not need one

    @property
    def name(self) -> str:
        return "foreign"

    @property
    def version(self) -> str:
        raise AssertionError("checking the interface must not run properties (they may start an experiment)")

    def log_metrics(self, metrics, step=None):
        self.metrics.append((dict(metrics), step))

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def finalize(self, status):
        self.statuses.append(status)


def test_a_logger_by_interface_receives_metrics_and_is_finalized():
    logger = ForeignLogger()
    fabric = Fabric(accelerator="cpu", loggers=[logger])
    fabric.log_dict({"loss": torch.tensor(0.5)}, step=3)
    assert logger.metrics == [({"loss": 0.5}, 3)]
    assert fabric.logger is logger
    fabric.teardown()
    assert logger.statuses == ["success"]


def test_a_logger_without_finalize_is_skipped_at_the_end():
    """finalize is optional, as on the reference's base class: the logger without it gets its metrics and is left
    out at the end; the logger beside it that has one is still finalized."""
    bare, full = ForeignLogger(with_finalize=False), ForeignLogger()
    fabric = Fabric(accelerator="cpu", loggers=[bare, full])
    fabric.log("loss", torch.tensor(1.5), step=2)
    fabric.teardown()  # no error from the missing finalize
    assert bare.metrics == full.metrics == [({"loss": 1.5}, 2)]
    assert bare.finalize is None and bare.statuses == []
    assert full.statuses == ["success"]


@pytest.mark.parametrize("missing", ["log_metrics", "log_hyperparams", "name", "version"])
def test_a_missing_member_is_named(missing):
    members = {
        "name": "x", "version": 0, "log_metrics": lambda self, metrics, step=None: None,
        "log_hyperparams": lambda self, params: None,
    }  # fmt: skip
    del members[missing]
    cls = type("HalfLogger", (), members)
    with pytest.raises(TypeError, match=rf"HalfLogger has no `{missing}`\. A logger needs the members"):
        Fabric(accelerator="cpu", loggers=cls())


def test_a_mock_is_a_logger():
    """How most people test code that logs: ``Mock()`` answers every name, so the object is asked, not its class."""
    logger = Mock()
    fabric = Fabric(accelerator="cpu", loggers=logger)
    fabric.log("loss", torch.tensor(2.0), step=1)
    logger.log_metrics.assert_called_once_with(metrics={"loss": 2.0}, step=1)
    fabric.teardown()
    logger.finalize.assert_called_once_with("success")


def test_an_object_whose_getattr_answers_every_name_is_a_logger():
    received = []

    class Proxy:
        def __getattr__(self, name):
            return lambda *args, **kwargs: received.append((name, kwargs))

    fabric = Fabric(accelerator="cpu", loggers=[Proxy()])
    fabric.log_dict({"a": 1}, step=0)
    assert received == [("log_metrics", {"metrics": {"a": 1}, "step": 0})]


def test_a_getattr_that_refuses_a_member_is_still_refused():
    class Partial:
        name, version = "p", 0

        def __getattr__(self, name):
            if name == "log_metrics":
                return lambda **kwargs: None
            raise AttributeError(name)

    with pytest.raises(TypeError, match="Partial has no `log_hyperparams`"):
        Fabric(accelerator="cpu", loggers=Partial())


def test_a_non_callable_log_metrics_is_refused():
    cls = type("Odd", (), {"name": "x", "version": 0, "log_metrics": 3, "log_hyperparams": lambda self, p: None})
    with pytest.raises(TypeError, match="Odd has no `log_metrics`"):
        Fabric(accelerator="cpu", loggers=cls())


def test_callbacks_are_any_objects():
    calls = []

    class WithStatic:
        @staticmethod
        def on_train_start(**kwargs):
            calls.append(("class", kwargs))

    module = types.ModuleType("my_callbacks")
    module.on_train_start = lambda value: calls.append(("module", value))
    fabric = Fabric(accelerator="cpu", callbacks=[WithStatic, module, {"a": "dict"}, None, 3])
    assert len(fabric._callbacks) == 5
    fabric.call("on_train_start", value=1)
    assert calls == [("class", {"value": 1}), ("module", 1)]
    assert Fabric(accelerator="cpu", callbacks=module)._callbacks == [module]


@pytest.mark.parametrize("callbacks", ["EarlyStopping", ["EarlyStopping"], [object(), b"x"]])
def test_a_callback_given_by_name_is_refused(callbacks):
    """A string has none of the hooks ``fabric.call`` runs: it would silently do nothing."""
    with pytest.raises(TypeError, match=r"callbacks are objects whose methods `fabric.call\(name\)` runs, not names"):
        Fabric(accelerator="cpu", callbacks=callbacks)


def test_launch_function_that_raises_finalizes_loggers_as_failed():
    logger = ForeignLogger()
    fabric = Fabric(accelerator="cpu", loggers=logger)

    def train(fabric):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fabric.launch(train)
    assert logger.statuses == ["failed"]


def test_a_failing_finalize_does_not_hide_the_run_error():
    class Broken(ForeignLogger):
        def finalize(self, status):
            raise OSError("server gone")

    fabric = Fabric(accelerator="cpu", loggers=[Broken(), other := ForeignLogger()])

    def train(fabric):
        raise RuntimeError("the real error")

    with pytest.raises(RuntimeError, match="the real error") as raised:
        fabric.launch(train)
    assert other.statuses == ["failed"]  # the next logger was still finalized
    assert "Finalizing a logger failed as well: OSError: server gone" in raised.value.__notes__[0]


def test_teardown_finalizes_every_logger_then_raises_the_first_error():
    class Broken(ForeignLogger):
        def finalize(self, status):
            raise OSError("server gone")

    other = ForeignLogger()
    fabric = Fabric(accelerator="cpu", loggers=[Broken(), other])
    with pytest.raises(OSError, match="server gone"):
        fabric.teardown()
    assert other.statuses == ["success"]


def test_loggers_of_our_base_class_hear_about_saved_checkpoints(tmp_path):
    class Recording(CSVLogger):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.saved: list[str] = []

        def checkpoint_saved(self, location):
            self.saved.append(location)

    ours, foreign = Recording(tmp_path), ForeignLogger()
    fabric = Fabric(accelerator="cpu", loggers=[ours, foreign])
    fabric.save(tmp_path / "a.ckpt", {"model": torch.nn.Linear(1, 1)})
    fabric.save(str(tmp_path / "b.ckpt"), {"step": 1})
    # the location the save decided, not a string to parse again
    assert ours.saved == [CheckpointLocation.of(tmp_path / "a.ckpt"), CheckpointLocation.of(tmp_path / "b.ckpt")]
    assert all(isinstance(saved, CheckpointLocation) and not saved.is_url for saved in ours.saved)
    assert Logger.checkpoint_saved(ours, ours.saved[0]) is None  # the base class's default does nothing


_AT_EXIT = textwrap.dedent(
    """
    import json, sys
    from fabric_core.loggers.base import Logger, finalize_at_exit

    class FileLogger(Logger):
        name = "file"
        version = 0
        def log_metrics(self, metrics, step=None): pass
        def log_hyperparams(self, params, *args, **kwargs): pass
        def finalize(self, status):
            with open(sys.argv[1], "a") as f:
                f.write(json.dumps(status) + "\\n")

    def main():
        logger = FileLogger()      # dropped when main returns: its run must still be closed
        finalize_at_exit(logger)
        if sys.argv[2] == "raise":
            raise RuntimeError("uncaught")
        if sys.argv[2] == "exit0":
            sys.exit(0)

    main()
    """
)


@pytest.mark.parametrize(("how", "code", "status"), [("return", 0, "success"), ("exit0", 0, "success"), ("raise", 1, "failed")])
def test_finalize_at_exit_reports_how_the_script_ended(tmp_path, how, code, status):
    out = tmp_path / "statuses.jsonl"
    done = subprocess.run([sys.executable, "-c", _AT_EXIT, str(out), how], capture_output=True, text=True, timeout=120)
    assert done.returncode == code, done.stderr
    assert [json.loads(line) for line in out.read_text().splitlines()] == [status]
