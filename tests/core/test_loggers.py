"""Tests for fabric_core.loggers, against real files read back with the csv module and TensorBoard's reader."""

from __future__ import annotations

import csv
import json
import os
import pickle
import subprocess
import sys
import textwrap
from argparse import Namespace
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from fabric_core.loggers import CSVLogger, Logger, TensorBoardLogger
from fabric_core.loggers.base import _DummyExperiment
from fabric_core.utilities.rank_zero import get_rank, set_rank

LOGGER_CLASSES = [CSVLogger, TensorBoardLogger]


def _read_csv(path: str) -> tuple[list[str], list[dict[str, str]]]:
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        rows = list(reader)
        return list(reader.fieldnames or []), rows


def _accumulator(path: str):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(path)
    accumulator.Reload()
    return accumulator


def _scalars(path: str, tag: str) -> list[tuple[int, float]]:
    return [(event.step, event.value) for event in _accumulator(path).Scalars(tag)]


@pytest.fixture
def nonzero_rank():
    previous = get_rank()
    set_rank(1)
    try:
        yield
    finally:
        set_rank(previous)


# ---------------------------------------------------------------- shared behaviour


@pytest.mark.parametrize("logger_cls", LOGGER_CLASSES)
def test_version_is_next_free_integer(tmp_path, logger_cls):
    assert logger_cls(tmp_path).version == 0  # folder missing

    base = tmp_path / "exp"
    for folder in ("version_0", "version_3", "version_x", "other"):
        (base / folder).mkdir(parents=True)
    (base / "version_9").write_text("a file, not a run folder")
    logger = logger_cls(tmp_path, name="exp")
    assert logger.version == 4
    assert logger.log_dir == os.path.join(str(tmp_path), "exp", "version_4")


@pytest.mark.parametrize("logger_cls", LOGGER_CLASSES)
def test_explicit_versions_and_empty_name(tmp_path, logger_cls):
    assert logger_cls(tmp_path, name="exp", version=5).log_dir == os.path.join(
        str(tmp_path), "exp", "version_5"
    )
    assert logger_cls(tmp_path, name="exp", version="run_a").log_dir == os.path.join(
        str(tmp_path), "exp", "run_a"
    )
    for name in (None, ""):
        logger = logger_cls(tmp_path, name=name, version=1)
        assert logger.name == ""
        assert logger.log_dir == os.path.join(str(tmp_path), "version_1")
    logger = logger_cls(tmp_path)
    assert logger.name == "fabric_logs"
    assert logger.root_dir == str(tmp_path)


@pytest.mark.parametrize("logger_cls", LOGGER_CLASSES)
def test_nothing_written_until_first_log(tmp_path, logger_cls):
    logger = logger_cls(tmp_path)
    logger.save()
    logger.finalize("success")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("logger_cls", LOGGER_CLASSES)
def test_nonzero_rank_writes_nothing(tmp_path, logger_cls, nonzero_rank):
    logger = logger_cls(tmp_path)
    logger.log_hyperparams({"lr": 0.1})
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.log_graph(nn.Linear(2, 2), torch.zeros(1, 2))
    logger.save()
    logger.finalize("success")
    assert list(tmp_path.iterdir()) == []

    experiment = logger.experiment
    assert isinstance(experiment, _DummyExperiment)
    assert experiment.add_scalar("x", 1.0) is None
    assert experiment[0].anything(1, key=2) is None


@pytest.mark.parametrize("logger_cls", LOGGER_CLASSES)
def test_pickle_round_trip_keeps_run_folder(tmp_path, logger_cls):
    logger = (
        logger_cls(tmp_path, flush_logs_every_n_steps=1) if logger_cls is CSVLogger else logger_cls(tmp_path)
    )
    logger.log_metrics({"a": 1.0}, step=0)
    logger.save()

    clone = pickle.loads(pickle.dumps(logger))
    assert clone.log_dir == logger.log_dir
    assert clone.version == 0
    if logger_cls is TensorBoardLogger:
        assert clone._experiment is None  # the writer is not carried over
    clone.log_metrics({"a": 2.0}, step=1)
    clone.finalize("success")
    logger.finalize("success")
    assert sorted(os.listdir(tmp_path / "fabric_logs")) == ["version_0"]


def test_logger_base_defaults():
    with pytest.raises(TypeError):
        Logger()  # abstract

    class Minimal(Logger):
        saves = 0
        name = "m"
        version = 0

        def log_metrics(self, metrics, step=None):
            pass

        def log_hyperparams(self, params, *args, **kwargs):
            pass

        def save(self):
            self.saves += 1

    logger = Minimal()
    assert logger.root_dir is None
    assert logger.log_dir is None
    assert logger.group_separator == "/"
    assert logger.log_graph(nn.Linear(1, 1)) is None
    logger.finalize("success")
    assert logger.saves == 1


# ---------------------------------------------------------------- CSVLogger


def test_csv_metrics_round_trip(tmp_path):
    logger = CSVLogger(tmp_path, prefix="train")
    logger.log_metrics({"loss": torch.tensor(0.5), "acc": 0.25}, step=0)
    logger.log_metrics({"loss": 0.125, "acc": torch.tensor(1.0)}, step=1)
    assert not os.path.exists(os.path.join(logger.log_dir, "metrics.csv"))  # still buffered
    logger.finalize("success")

    header, rows = _read_csv(os.path.join(logger.log_dir, "metrics.csv"))
    assert header == ["step", "train-acc", "train-loss"]  # sorted; "step" sorts among the metrics
    assert rows == [
        {"step": "0", "train-acc": "0.25", "train-loss": "0.5"},
        {"step": "1", "train-acc": "1.0", "train-loss": "0.125"},
    ]


def test_csv_new_column_rewrites_header(tmp_path):
    logger = CSVLogger(tmp_path, flush_logs_every_n_steps=1)
    logger.log_metrics({"b": 1}, step=0)
    path = os.path.join(logger.log_dir, "metrics.csv")
    assert _read_csv(path)[0] == ["b", "step"]  # flushed right away

    logger.log_metrics({"a": 2, "b": 3}, step=1)
    logger.log_metrics({"a": 4}, step=2)  # a column missing from a later row stays, empty
    header, rows = _read_csv(path)
    assert header == ["a", "b", "step"]
    assert rows == [
        {"a": "", "b": "1", "step": "0"},
        {"a": "2", "b": "3", "step": "1"},
        {"a": "4", "b": "", "step": "2"},
    ]
    assert [name for name in os.listdir(logger.log_dir) if name.startswith(".tmp_")] == []


def test_csv_flush_interval_and_auto_step_keeps_counting(tmp_path):
    logger = CSVLogger(tmp_path, flush_logs_every_n_steps=2)
    path = os.path.join(logger.log_dir, "metrics.csv")
    logger.log_metrics({"x": 0})
    assert not os.path.exists(path)
    logger.log_metrics({"x": 1})  # automatic step 1 -> (1 + 1) % 2 == 0 -> flush
    assert len(_read_csv(path)[1]) == 2
    for value in range(2, 5):
        logger.log_metrics({"x": value})
    logger.finalize("success")
    # deviation from Lightning: steps do not restart at 0 after a flush
    assert [row["step"] for row in _read_csv(path)[1]] == ["0", "1", "2", "3", "4"]


def test_csv_buffer_is_bounded_when_explicit_steps_skip_the_interval(tmp_path):
    logger = CSVLogger(tmp_path, flush_logs_every_n_steps=3)
    for step in (10, 12, 15):  # (step + 1) % 3 is never 0
        logger.log_metrics({"x": step}, step=step)
    assert [row["step"] for row in _read_csv(os.path.join(logger.log_dir, "metrics.csv"))[1]] == [
        "10",
        "12",
        "15",
    ]
    with pytest.raises(ValueError, match="flush_logs_every_n_steps"):
        CSVLogger(tmp_path, flush_logs_every_n_steps=0)


def test_csv_hyperparams_json(tmp_path):
    logger = CSVLogger(tmp_path)
    logger.log_hyperparams(Namespace(lr=0.1, layers=[1, 2], nested={"depth": torch.tensor(3)}))
    logger.log_hyperparams({"lr": 0.01, "device": torch.device("cpu")})  # merged; later values win

    with open(os.path.join(logger.log_dir, "hparams.json")) as handle:
        assert json.load(handle) == {"lr": 0.01, "layers": [1, 2], "nested": {"depth": 3}, "device": "cpu"}


def test_csv_existing_log_dir_warns_and_replaces_old_metrics(tmp_path):
    log_dir = tmp_path / "fabric_logs" / "version_0"
    log_dir.mkdir(parents=True)
    (log_dir / "metrics.csv").write_text("old,step\n1,0\n")
    logger = CSVLogger(tmp_path, version=0)
    with pytest.warns(UserWarning, match="exists and is not empty"):
        logger.log_metrics({"new": 1.0}, step=0)
    logger.finalize("success")
    header, rows = _read_csv(str(log_dir / "metrics.csv"))
    assert header == ["new", "step"]
    assert rows == [{"new": "1.0", "step": "0"}]


# ---------------------------------------------------------------- TensorBoardLogger


def test_tensorboard_scalars_and_prefix(tmp_path):
    logger = TensorBoardLogger(tmp_path, prefix="train")
    logger.log_metrics({"loss": torch.tensor(0.5)}, step=3)
    logger.log_metrics({"loss": 0.25}, step=7)
    logger.finalize("success")

    assert any(name.startswith("events.out.tfevents.") for name in os.listdir(logger.log_dir))
    assert _scalars(logger.log_dir, "train-loss") == [(3, 0.5), (7, 0.25)]


def test_tensorboard_dict_value_uses_add_scalars(tmp_path):
    logger = TensorBoardLogger(tmp_path)
    logger.log_metrics({"acc": {"train": 0.75, "val": torch.tensor(0.5)}}, step=2)
    logger.finalize("success")
    # add_scalars keeps one sub-writer per curve so TensorBoard overlays them in one chart
    assert _scalars(os.path.join(logger.log_dir, "acc_train"), "acc") == [(2, 0.75)]
    assert _scalars(os.path.join(logger.log_dir, "acc_val"), "acc") == [(2, 0.5)]


@pytest.mark.parametrize("value", ["not a number", [1.0, 2.0], torch.ones(3)])
def test_tensorboard_unsupported_value_raises(tmp_path, value):
    logger = TensorBoardLogger(tmp_path)
    with pytest.raises(ValueError, match="You tried to log .* under 'bad'"):
        logger.log_metrics({"bad": value}, step=0)
    logger.finalize("failed")


def test_tensorboard_save_flushes_before_close(tmp_path):
    logger = TensorBoardLogger(tmp_path, flush_secs=3600, max_queue=1000)  # kwargs reach SummaryWriter
    logger.log_metrics({"x": 1.0}, step=0)
    logger.save()
    assert _scalars(logger.log_dir, "x") == [(0, 1.0)]
    logger.finalize("success")


@dataclass
class _OptimConfig:
    name: str = "sgd"
    momentum: float = 0.9


def test_tensorboard_hyperparams_are_flattened_and_written(tmp_path):
    from tensorboard.plugins.hparams import metadata, plugin_data_pb2

    logger = TensorBoardLogger(tmp_path)
    params = {
        "lr": 0.1,
        "model": {"depth": 3, "act": nn.ReLU},
        "args": Namespace(seed=7),
        "optim": _OptimConfig(),
        "blocks": [{"width": 8}, {"width": 16}],
        "sizes": [1, 2],
        "scale": torch.tensor(2.5),
        "flag": True,
        "nothing": None,
    }
    logger.log_hyperparams(params)
    logger.finalize("success")

    accumulator = _accumulator(logger.log_dir)
    content = accumulator.PluginTagToContent(metadata.PLUGIN_NAME)
    assert metadata.EXPERIMENT_TAG in content and metadata.SESSION_START_INFO_TAG in content
    start = plugin_data_pb2.HParamsPluginData.FromString(content[metadata.SESSION_START_INFO_TAG])
    hparams = start.session_start_info.hparams
    assert hparams["lr"].number_value == pytest.approx(0.1)
    assert hparams["model/depth"].number_value == 3
    assert hparams["model/act"].string_value == str(nn.ReLU)
    assert hparams["args/seed"].number_value == 7
    assert hparams["optim/name"].string_value == "sgd"
    assert hparams["blocks/1/width"].number_value == 16
    assert hparams["sizes"].string_value == "[1, 2]"
    assert hparams["scale"].number_value == pytest.approx(2.5)
    assert hparams["flag"].number_value == 1  # torch's hparams() stores bools as numbers
    assert hparams["nothing"].string_value == "None"
    assert _scalars(logger.log_dir, "hp_metric") == [(0, -1.0)]


def test_tensorboard_hyperparams_with_metric_and_without_default(tmp_path):
    logger = TensorBoardLogger(tmp_path, name="with_metric")
    logger.log_hyperparams({"lr": 0.1}, metrics=0.75, step=4)
    logger.finalize("success")
    assert _scalars(logger.log_dir, "hp_metric") == [(4, 0.75)]

    silent = TensorBoardLogger(tmp_path, name="silent", default_hp_metric=False)
    silent.log_hyperparams({"lr": 0.1})
    silent.finalize("success")
    assert not os.path.exists(silent.log_dir)


class _WithExample(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 2)
        self.example_input_array = torch.zeros(1, 4)

    def forward(self, x):
        return self.layer(x)


def test_tensorboard_log_graph(tmp_path):
    logger = TensorBoardLogger(tmp_path)
    logger.log_graph(_WithExample())
    logger.finalize("success")
    graph = _accumulator(logger.log_dir).Graph()
    assert any("Linear" in node.op or "linear" in node.name.lower() for node in graph.node)


def test_tensorboard_log_graph_warns_without_usable_input(tmp_path):
    logger = TensorBoardLogger(tmp_path)
    with pytest.warns(UserWarning, match="example_input_array"):
        logger.log_graph(nn.Linear(4, 2))
    with pytest.warns(UserWarning, match="can't be traced"):
        logger.log_graph(nn.Linear(4, 2), input_array=[0.0] * 4)
    assert not os.path.exists(logger.log_dir)


def test_tensorboard_sub_dir_and_expansion(tmp_path, monkeypatch):
    monkeypatch.setenv("FABRIC_TEST_ROOT", str(tmp_path))
    logger = TensorBoardLogger("$FABRIC_TEST_ROOT/logs", name="exp", version=2, sub_dir="train")
    assert logger.root_dir == "$FABRIC_TEST_ROOT/logs"  # returned as given
    assert logger.log_dir == os.path.join(str(tmp_path), "logs", "exp", "version_2", "train")
    logger.log_metrics({"x": 1.0}, step=0)
    logger.finalize("success")
    assert _scalars(logger.log_dir, "x") == [(0, 1.0)]


def test_tensorboard_missing_package_hint(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # makes the package look uninstalled
    with pytest.raises(ModuleNotFoundError, match="pip install tensorboard"):
        TensorBoardLogger(tmp_path)


def test_importing_loggers_does_not_import_tensorboard(tmp_path):
    script = textwrap.dedent(
        f"""
        import sys
        from fabric_core.loggers import TensorBoardLogger
        logger = TensorBoardLogger({str(tmp_path)!r})
        logger.log_dir
        before = sorted(m for m in sys.modules if m == "tensorboard" or m.startswith(("tensorboard.", "torch.utils.tensorboard")))
        logger.log_metrics({{"x": 1.0}}, step=0)
        logger.finalize("success")
        after = "torch.utils.tensorboard" in sys.modules
        print(before, after)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[] True"
