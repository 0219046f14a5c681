"""The sample ledger: which samples every rank trained, at which committed step, and a report of lost and repeated ones.

Opt-in, for debugging data order and for the tests of elastic training: set ``FABRIC_SAMPLE_LEDGER=1`` to write it
into the run folder's ``samples/`` (``fabric.run_info.dir``, docs/decisions.md "Run identity"), or to a folder of
your choice. Every process of the run must reach it and see the variable (``fabric run``, torchrun and SLURM pass it
on; inside Ray Train put it in the workers' ``runtime_env``). Each process then appends JSON lines to a file of its
own there (``samples-rank<R>-<host>-<pid>.jsonl``; the first line names the run and the attempt):

* ``step``: the samples of one batch a set-up loader handed out, written when the next optimizer step is taken (a
  batch fetched but never stepped on was not trained): the loader (``loader<i>``, in the order the process set its
  loaders up), the epoch, the global batch's first and end position, this rank's share of it, the sample indices
  (pads counted apart) and the optimizer steps this process had taken. Processes that share a data-parallel rank
  (tensor, pipeline, sequence peers) train the same samples together: only the first of them (coordinate 0 on every
  model axis of the topology) writes these. A strategy may say a step did not train its batches
  (:meth:`~fabric_core.strategies.Strategy.samples_trained`: a fault-tolerant step that was not committed; they are
  drawn again and recorded then) or not yet (semi-synchronous training: at its next synchronisation), and may add
  facts, such as ``live_shares``, how many of a global batch's shares were committed;
* ``resume``: a loader restored from a checkpoint, at an epoch and global position.

Every line is flushed when written (a killed process leaves what it wrote), not forced to disk. The report
(:func:`report`, ``fabric ledger FOLDER``) replays every file's lines in time order: a ``resume`` at ``(epoch,
position)`` rolls back what that loader recorded after that point before it (steps trained after the checkpoint that a
failure undid), so what remains is what the final weights were trained on. Then per loader and epoch: positions
trained more than once are *duplicated*, positions before the furthest one reached that were never trained are *lost*;
pads are reported apart, and so are positions of global batches committed by fewer shares than they were cut into
(``live_shares`` below ``shares``: a replica group lost in a semi-synchronous window), *dropped*. Clocks order the
attempts: processes on several machines need clocks that agree to well within the time a restart takes (NTP does).
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fabric_core.runtime.run import RunInfo
    from fabric_core.utilities.global_order import Step

#: The folder a run's ledger is written to; unset: no ledger.
LEDGER_VARIABLE = "FABRIC_SAMPLE_LEDGER"
#: How every ledger file's name begins.
FILE_PREFIX = "samples-"
#: The ledger's folder inside the run folder (``FABRIC_SAMPLE_LEDGER=1``).
RUN_SUBFOLDER = "samples"

__all__ = ["LEDGER_VARIABLE", "LedgerReport", "SampleLedger", "active", "read_events", "report"]


def _plain(value: Any) -> Any:
    if isinstance(value, (int, str)) or value is None:
        return value
    item = getattr(value, "item", None)  # a tensor or NumPy scalar index
    if callable(item):
        try:
            return item()
        except (TypeError, ValueError, RuntimeError):
            pass
    return repr(value)


class SampleLedger:
    """One process's ledger file (see the module's description)."""

    def __init__(self, folder: str | os.PathLike, rank: int, run: RunInfo | None = None) -> None:
        self.folder = Path(folder)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise OSError(f"{LEDGER_VARIABLE}: cannot create the ledger's folder {str(folder)!r} ({err}).") from err
        self.rank = rank
        self.run = run
        name = f"{FILE_PREFIX}rank{rank}-{socket.gethostname()}-{os.getpid()}.jsonl"
        self.path = run.path(RUN_SUBFOLDER, name) if run is not None else self.folder / name  # run.json records it
        self._file = self.path.open("a", buffering=1)
        self._pending: list[dict[str, Any]] = []
        self._optimizer_steps = 0
        self._loaders = 0
        opened: dict[str, Any] = {"kind": "open", "rank": rank, "pid": os.getpid(), "host": socket.gethostname()}
        if run is not None:
            opened.update(run=run.id, attempt=run.attempt)
        self._write(opened)

    def _write(self, record: dict[str, Any]) -> None:
        record["t"] = time.time()
        self._file.write(json.dumps(record, default=repr) + "\n")
        self._file.flush()

    def name_loader(self) -> str:
        """The name of the next loader set up (``loader0``, ``loader1``, ...: the same in every attempt that sets its
        loaders up in the same order)."""
        name = f"loader{self._loaders}"
        self._loaders += 1
        return name

    def handed_out(self, loader: str, step: Step, size: int) -> None:
        """A loader handed out ``step``'s batch; it counts as trained at the next :meth:`commit`."""
        self._pending.append(
            {
                "kind": "step",
                "loader": loader,
                "epoch": step.epoch,
                "start": step.start,
                "end": step.end,
                "share": step.share,
                "shares": step.shares,
                "indices": [_plain(i) for i in step.indices],
                "padding": step.padding,
                "size": size,
            }
        )

    def commit(self, **facts: Any) -> None:
        """An optimizer step: what was handed out since the last one was trained (``facts``, e.g. how many replica
        groups took part, are added to each record)."""
        self._optimizer_steps += 1
        for record in self._pending:
            record["optimizer_step"] = self._optimizer_steps
            record.update(facts)
            self._write(record)
        self._pending.clear()

    def discard(self) -> None:
        """An optimizer step that did not train what was handed out since the last one (it is drawn again)."""
        self._optimizer_steps += 1
        self._pending.clear()

    def settle(self, trained: bool | Mapping[str, Any] | None) -> None:
        """An optimizer step, with the strategy's word on the batches handed out since the last one
        (:meth:`~fabric_core.strategies.Strategy.samples_trained`): commit, discard, or keep them pending."""
        if trained is None:
            self._optimizer_steps += 1
        elif trained is False:
            self.discard()
        else:
            self.commit(**(dict(trained) if isinstance(trained, Mapping) else {}))

    def resumed(self, loader: str, epoch: int, position: int, size: int) -> None:
        """A loader was restored from a checkpoint at ``(epoch, position)``."""
        self._pending.clear()
        self._write({"kind": "resume", "loader": loader, "epoch": epoch, "position": position, "size": size})

    def close(self) -> None:
        self._file.close()


#: This process's ledger once :func:`active` opened it (read by every Fabric optimizer step).
open_ledger: SampleLedger | None = None
_open_folder: str | None = None
_ON = ("1", "true", "on", "yes")
_OFF = ("", "0", "false", "off", "no")


def ledger_folder(run: RunInfo | None = None) -> Path | None:
    """Where this run's ledger goes: ``None`` unless ``FABRIC_SAMPLE_LEDGER`` asks for one; ``1`` (``true``, ``on``)
    means the run folder's ``samples/`` (``run``, else the run this process resolves alone), any other value is
    the folder itself."""
    value = os.environ.get(LEDGER_VARIABLE, "").strip()
    if value.lower() in _OFF:
        return None
    if value.lower() in _ON:
        from fabric_core.runtime.run import resolve_run

        return (run or resolve_run()).dir / RUN_SUBFOLDER
    return Path(value)


def active(run: RunInfo | None = None) -> SampleLedger | None:
    """This process's ledger when ``FABRIC_SAMPLE_LEDGER`` asks for one (opened on first use), else ``None``.
    ``run``: the Fabric's run (``fabric.run_info``), whose folder ``FABRIC_SAMPLE_LEDGER=1`` means."""
    global open_ledger, _open_folder
    value = os.environ.get(LEDGER_VARIABLE, "").strip()
    if value.lower() in _OFF:
        return None
    in_run = value.lower() in _ON
    if in_run and run is None and open_ledger is not None and open_ledger.run is not None:
        return open_ledger  # the run folder's ledger, opened when the loader was set up
    folder = ledger_folder(run)
    assert folder is not None
    if open_ledger is None or _open_folder != str(folder):
        from fabric_core.utilities.rank_zero import get_rank

        if open_ledger is not None:
            open_ledger.close()
        if in_run and run is None:
            from fabric_core.runtime.run import resolve_run

            run = resolve_run()
        open_ledger = SampleLedger(folder, get_rank(), run if in_run else None)
        _open_folder = str(folder)
    return open_ledger


# ------------------------------------------------------------------------------------------------------ the report
def read_events(folder: str | os.PathLike) -> list[dict[str, Any]]:
    """Every line of every ledger file in ``folder``, in time order."""
    root = Path(folder)
    if not root.is_dir():
        raise FileNotFoundError(f"No ledger folder at {str(root)!r} (the folder {LEDGER_VARIABLE} named for the run).")
    files = sorted(root.glob(f"{FILE_PREFIX}*.jsonl"))
    if not files:
        raise FileNotFoundError(
            f"{str(root)!r} holds no ledger files ({FILE_PREFIX}*.jsonl): was the run started with {LEDGER_VARIABLE}"
            " set to it?"
        )
    events: list[dict[str, Any]] = []
    for path in files:
        with path.open() as handle:
            for number, line in enumerate(handle, 1):
                line = line.strip()
                if not line:
                    continue
                try:
                    event = json.loads(line)
                except json.JSONDecodeError:
                    # the last line of a process killed while writing it
                    continue
                event["file"] = path.name
                event["line"] = number
                events.append(event)
    events.sort(key=lambda e: (e.get("t", 0.0), e["file"], e["line"]))
    return events


@dataclass
class EpochReport:
    size: int
    reached: int = 0
    trained: int = 0
    padding: int = 0
    lost: list[int] = field(default_factory=list)
    #: positions of global batches committed by fewer shares than they were cut into (a replica group lost in a
    #: semi-synchronous window: its samples since the last synchronisation count as dropped, not replayed)
    dropped: list[int] = field(default_factory=list)
    duplicated: dict[int, int] = field(default_factory=dict)
    samples: dict[int, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "size": self.size,
            "reached": self.reached,
            "trained": self.trained,
            "padding": self.padding,
            "lost": self.lost,
            "dropped": self.dropped,
            "duplicated": {str(p): n for p, n in self.duplicated.items()},
            "duplicated_samples": sorted({str(self.samples.get(p)) for p in self.duplicated}),
        }


@dataclass
class LedgerReport:
    loaders: dict[str, dict[int, EpochReport]]
    resumes: dict[str, list[tuple[int, int]]]
    rolled_back: int

    @property
    def ok(self) -> bool:
        return all(not e.lost and not e.duplicated for epochs in self.loaders.values() for e in epochs.values())

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "rolled_back": self.rolled_back,
            "loaders": {
                name: {
                    "resumes": [list(r) for r in self.resumes.get(name, [])],
                    "epochs": {str(e): report.as_dict() for e, report in sorted(epochs.items())},
                }
                for name, epochs in sorted(self.loaders.items())
            },
        }

    def text(self) -> str:
        lines = []
        for name, epochs in sorted(self.loaders.items()):
            resumes = self.resumes.get(name, [])
            lines.append(f"{name}: {len(resumes)} resume(s){': ' if resumes else ''}{', '.join(f'epoch {e} at {p}' for e, p in resumes)}")
            for epoch, e in sorted(epochs.items()):
                state = "complete" if e.reached >= e.size else f"reached {e.reached} of {e.size}"
                dropped = f", {len(e.dropped)} dropped with a lost replica group" if e.dropped else ""
                lines.append(
                    f"  epoch {epoch} ({state}): {e.trained} trained, {len(e.lost)} lost, {len(e.duplicated)} duplicated,"
                    f" {e.padding} pads{dropped}"
                )
                if e.lost:
                    lines.append(f"    lost positions: {_ranges(e.lost)}")
                if e.duplicated:
                    shown = ", ".join(f"{p} (sample {e.samples.get(p)!s}) x{n}" for p, n in sorted(e.duplicated.items())[:20])
                    lines.append(f"    duplicated positions: {shown}{' ...' if len(e.duplicated) > 20 else ''}")
        lines.append(f"rolled back (trained after a checkpoint a failure undid): {self.rolled_back} batch record(s)")
        lines.append("OK: every sample trained once" if self.ok else "NOT OK: samples lost or trained twice")
        return "\n".join(lines)


def _ranges(values: Iterable[int]) -> str:
    ordered = sorted(values)
    parts: list[str] = []
    start = prev = None
    for value in ordered:
        if start is None:
            start = prev = value
        elif value == prev + 1:  # type: ignore[operator]
            prev = value
        else:
            parts.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = value
    if start is not None:
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ", ".join(parts)


def report(folder: str | os.PathLike) -> LedgerReport:
    """Replay a run's ledger (see the module's description) and count, per loader and epoch, what was lost or repeated."""
    kept: dict[str, list[dict[str, Any]]] = defaultdict(list)
    resumes: dict[str, list[tuple[int, int]]] = defaultdict(list)
    rolled_back = 0
    for event in read_events(folder):
        kind = event.get("kind")
        if kind == "resume":
            loader, point = event["loader"], (event["epoch"], event["position"])
            before = len(kept[loader])  # every rank writes the resume: the second and later ones remove nothing
            kept[loader] = [s for s in kept[loader] if (s["epoch"], s["end"]) <= point]
            rolled_back += before - len(kept[loader])
            if not resumes[loader] or resumes[loader][-1] != point:
                resumes[loader].append(point)
        elif kind == "step":
            kept[event["loader"]].append(event)
    loaders: dict[str, dict[int, EpochReport]] = {}
    for loader, steps in kept.items():
        by_epoch: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for step in steps:
            by_epoch[step["epoch"]].append(step)
        loaders[loader] = {}
        for epoch, records in by_epoch.items():
            size = records[-1]["size"]
            report_ = EpochReport(size=size)
            counts: Counter[int] = Counter()
            short: set[int] = set()  # positions of global batches committed by fewer shares than they were cut into
            for record in records:
                if record.get("live_shares", record["shares"]) < record["shares"]:
                    short.update(range(record["start"], record["end"]))
                report_.reached = max(report_.reached, record["end"])
                indices = record["indices"]
                for i, sample in enumerate(indices):
                    position = record["start"] + record["share"] + i * record["shares"]
                    if position >= size:
                        report_.padding += 1
                        continue
                    counts[position] += 1
                    report_.samples[position] = sample
            report_.trained = len(counts)
            untrained = [p for p in range(report_.reached) if p not in counts]
            report_.lost = [p for p in untrained if p not in short]
            report_.dropped = [p for p in untrained if p in short]
            report_.duplicated = {p: n for p, n in counts.items() if n > 1}
            loaders[loader][epoch] = report_
    return LedgerReport(loaders, dict(resumes), rolled_back)
