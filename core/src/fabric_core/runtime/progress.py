"""A training progress bar that only global rank 0 shows, with loss and throughput, fit for terminals and log files.

::

    from fabric_core.runtime.progress import ProgressBar

    with ProgressBar(total=max_steps, desc="train", unit="step", items_unit="tokens") as bar:
        for step in range(max_steps):
            ...
            bar.update(loss=loss, items=tokens_per_step)

* **Rank 0 only**: on every other rank (and with ``enabled=False``) the bar does nothing at all, so the loop needs
  no rank check. The rank is the one the strategy set (``fabric_core.utilities.rank_zero``).
* **In a terminal** it is a ``tqdm`` bar (tqdm is imported on the first update, never at import), refreshed at
  most every ``refresh_s`` seconds, with the fields after the counter: ``loss=2.31, tokens/s=10,854``.
* **In a log file, CI or a notebook's captured output** (standard error is not a terminal) a tqdm bar would write a
  ``\\r``-separated line per refresh into the log. The bar prints a plain line instead, at the first update, then
  every ``log_every_s`` seconds (30 by default) and when it closes::

      train step 120/250 (48%) | loss 2.314 | 5.31 step/s, 10,854 tokens/s | 0:00:22 elapsed, ~0:00:24 left

* **Cheap per step**: ``update`` stores values; a tensor loss is turned into a number only when it is shown (no
  device synchronisation on the steps in between).
* **Throughput** is measured over the period since the previous refresh (warm-up does not drag it down forever); the
  closing line gives the whole run's average.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import IO, Any

from fabric_core.utilities.rank_zero import get_rank


def _number(value: Any) -> Any:
    """A plain number for display; tensors and numpy scalars are converted here, only when shown."""
    if hasattr(value, "item") and callable(value.item):
        try:
            return value.item()
        except (ValueError, RuntimeError):
            return value
    return value


def _format(value: Any) -> str:
    value = _number(value)
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:,.0f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def _rate(count: float, seconds: float) -> str:
    if seconds <= 0:
        return "?"
    rate = count / seconds
    return f"{rate:,.0f}" if rate >= 100 else f"{rate:.3g}"


def _duration(seconds: float) -> str:
    return str(timedelta(seconds=int(seconds)))


class ProgressBar:
    """Progress of a loop on global rank 0: a tqdm bar in a terminal, periodic plain lines in logs.

    Args:
        total: number of updates expected (``None`` when unknown: no percentage or time left).
        desc: the label in front (``"train"``).
        unit: what one update counts (``"step"``, ``"batch"``).
        items_unit: name of what ``update(items=...)`` counts (``"tokens"``, ``"samples"``): shown as a rate.
        enabled: ``None`` means "on global rank 0 only"; ``True``/``False`` force it on this rank.
        interactive: ``None`` decides by whether ``file`` is a terminal; ``False`` forces plain lines.
        refresh_s: how often the terminal bar refreshes its fields at most.
        log_every_s: how often a plain line is printed in non-interactive output.
        file: where to write (default: standard error, as tqdm does).
    """

    def __init__(
        self,
        total: int | None = None,
        *,
        desc: str = "",
        unit: str = "step",
        items_unit: str = "items",
        enabled: bool | None = None,
        interactive: bool | None = None,
        refresh_s: float = 0.5,
        log_every_s: float = 30.0,
        file: IO[str] | None = None,
    ) -> None:
        if total is not None and total < 0:
            raise ValueError(f"`total` must be a non-negative number of updates or None, got {total}.")
        if log_every_s <= 0 or refresh_s < 0:
            raise ValueError("`log_every_s` must be positive and `refresh_s` non-negative.")
        self.total = total
        self.desc = desc
        self.unit = unit
        self.items_unit = items_unit
        self.enabled = get_rank() == 0 if enabled is None else bool(enabled)
        self._file = file
        self._interactive = interactive
        self.refresh_s = refresh_s
        self.log_every_s = log_every_s
        self.n = 0
        self.items = 0.0
        self.fields: dict[str, Any] = {}
        self._bar: Any = None
        self._start: float | None = None
        self._last_shown: float = 0.0
        self._window = (0.0, 0, 0.0)  # (time, n, items) at the last refresh
        self._window_rates = ""
        self._closed = False
        self._lines = 0

    # ------------------------------------------------------------------------------------------------ updating
    def update(self, n: int = 1, *, items: float | None = None, loss: Any = None, **fields: Any) -> None:
        """Count ``n`` more updates (and ``items`` more items) and remember the fields to show (``loss=...``)."""
        if not self.enabled or self._closed:
            return
        now = time.perf_counter()
        if self._start is None:
            self._start = now
            self._window = (now, 0, 0.0)
        self.n += n
        if items is not None:
            self.items += items
        if loss is not None:
            self.fields["loss"] = loss
        self.fields.update(fields)
        if self._is_interactive():
            self._update_bar(n, now)
        elif self._lines == 0 or now - self._last_shown >= self.log_every_s:
            self._print_line(now)

    def set_fields(self, **fields: Any) -> None:
        """Change the shown fields without counting an update."""
        if self.enabled:
            self.fields.update(fields)

    def close(self) -> None:
        """Finish: the terminal bar shows its final state; in logs a last line with the run's average rates."""
        if not self.enabled or self._closed:
            return
        self._closed = True
        now = time.perf_counter()
        if self._bar is not None:
            self._bar.set_postfix_str(self._postfix(now, whole_run=True), refresh=False)
            self._bar.close()
        elif self._start is not None:
            self._print_line(now, whole_run=True)

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------------ output
    @property
    def file(self) -> IO[str]:
        return self._file if self._file is not None else sys.stderr

    def _is_interactive(self) -> bool:
        if self._interactive is None:
            isatty = getattr(self.file, "isatty", None)
            self._interactive = bool(isatty and isatty())
        return self._interactive

    def _update_bar(self, n: int, now: float) -> None:
        if self._bar is None:
            try:
                from tqdm.auto import tqdm
            except ImportError:  # no tqdm: plain lines are still useful
                self._interactive = False
                self._print_line(now)
                return
            self._bar = tqdm(total=self.total, desc=self.desc, unit=self.unit, file=self.file, dynamic_ncols=True, mininterval=self.refresh_s)
        if now - self._last_shown >= self.refresh_s:
            self._bar.set_postfix_str(self._postfix(now), refresh=False)
            self._last_shown = now
        self._bar.update(n)

    def _rates(self, now: float, whole_run: bool) -> str:
        start, n0, items0 = ((now if self._start is None else self._start), 0, 0.0) if whole_run else self._window
        seconds = now - start
        if not whole_run and seconds < 1e-3:
            return self._window_rates
        rates = [f"{_rate(self.n - n0, seconds)} {self.unit}/s"]
        if self.items:
            rates.append(f"{_rate(self.items - items0, seconds)} {self.items_unit}/s")
        if not whole_run:
            self._window = (now, self.n, self.items)
            self._window_rates = ", ".join(rates)
        return ", ".join(rates)

    def _fields(self) -> Mapping[str, str]:
        return {key: _format(value) for key, value in self.fields.items()}

    def _postfix(self, now: float, whole_run: bool = False) -> str:
        parts = [f"{key}={value}" for key, value in self._fields().items()]
        if self.items:
            start, _, items0 = ((now if self._start is None else self._start), 0, 0.0) if whole_run else self._window
            if now - start > 1e-3:
                parts.append(f"{self.items_unit}/s={_rate(self.items - items0, now - start)}")
            if not whole_run:
                self._window = (now, self.n, self.items)
        return ", ".join(parts)

    def _print_line(self, now: float, whole_run: bool = False) -> None:
        count = f"{self.n}/{self.total}" if self.total is not None else f"{self.n}"
        head = f"{self.desc} {self.unit} {count}".strip()
        if self.total:
            head += f" ({100 * self.n / self.total:.0f}%)"
        parts = [head]
        fields = self._fields()
        if fields:
            parts.append(", ".join(f"{key} {value}" for key, value in fields.items()))
        elapsed = now - (now if self._start is None else self._start)
        if self.n and (elapsed > 0 or whole_run):
            parts.append(self._rates(now, whole_run) + (" (average)" if whole_run else ""))
        timing = f"{_duration(elapsed)} elapsed"
        if self.total and 0 < self.n < self.total and not whole_run and elapsed > 0:
            timing += f", ~{_duration(elapsed / self.n * (self.total - self.n))} left"
        parts.append(timing)
        self.file.write(" | ".join(parts) + "\n")
        self.file.flush()
        self._last_shown = now
        self._lines += 1
