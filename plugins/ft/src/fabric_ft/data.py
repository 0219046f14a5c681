"""The data position of a job of replica groups: which samples each step trains, whatever fails.

Every set-up loader with a global sample order (``fabric.setup_dataloaders``, docs/decisions.md "Elastic training")
gets a :class:`GroupCursor` from the strategy (``Strategy.data_cursor``). The position it keeps, per loader, is the
one the replica groups *committed*: the epoch, and the end of the last global batch a committed step trained (the
frontier). Each global batch is drawn there, cut into shares by the latest quorum the group saw: the replica axis's
live size and this group's place in it, times the data axes inside the group (FSDP's shards).

* **Synchronous steps.** Before its commit vote a group checks that the batches of the step are the ones the quorum
  of that step should train: they start at the frontier and were cut into as many shares as the quorum has members,
  this group's share being its place in the quorum. Otherwise (a group died or joined since the batch was drawn)
  the group votes no, so the step is dropped everywhere it was drawn that way. A dropped step leaves the frontier
  where it was: the next batch is drawn there again, with the new quorum's shares. So every committed step trains a
  whole global batch, split among exactly the groups that averaged it, and no sample is lost or trained twice. A
  change of the quorum costs one dropped step (the batch drawn before the change); with loader workers, the
  batches they drew ahead are dropped too (their position is stale), then drawing resumes at the frontier.
* **A rejoining group** receives the position with the rest of the state, and takes the step it healed in as the
  others commit it (its own batch of that step was zeroed by torchft and is not recorded as trained). A loader that
  is in an earlier epoch than the received one ends its passes at once until it reaches that epoch.
* **Semi-synchronous training** (LocalSGD, DiLoCo): the frontier moves at synchronisations. A committed
  synchronisation commits every batch trained since the last one; one that is not committed (an error) leaves the
  frontier, and the whole window is drawn again. A group that dies between two synchronisations takes its
  inner steps with it: its share of that window is **counted as lost, not replayed** (the survivors' synchronisation
  averages what the live groups trained; replaying the dead group's share would train the survivors on it after
  their own update of the same window). The ledger records the window's batches with ``live_shares``, how many of
  their shares were committed, and reports the missing ones as *dropped* (apart from lost).
* **The job's first step** is torchft's weight synchronisation (``init_sync``: every group but the first receives the
  first one's weights, its own gradients zeroed). Synchronous: nothing is applied in it and its batches are drawn
  again (one step per job). Semi-synchronous: the first synchronisation averages the first group's window alone; the
  others' shares of it are recorded as dropped.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fabric_core.utilities import Step

__all__ = ["GroupCursor", "ReplicatedPosition"]

#: A start past any epoch: ends the pass of a loader that is behind the others' epoch.
_END_OF_PASS = sys.maxsize


class GroupCursor:
    """One loader's position as the replica groups committed it (:class:`~fabric_core.utilities.DataCursor`)."""

    def __init__(self, owner: ReplicatedPosition) -> None:
        self.owner = owner
        self.epoch = 0
        self.frontier = 0  # the end of the last committed global batch in `epoch`
        self.redraw = False  # the next global batch starts at the frontier (a step was dropped)
        self.pending: list[Step] = []  # handed out since the last settle, in order
        self.received: dict[str, Any] | None = None  # the position a live group sent this one while it healed

    # ------------------------------------------------------------------------------------------ the sampler's side
    def plan(self, epoch: int, position: int) -> tuple[int, int, int]:
        share, shares = self.owner.shares()
        if epoch < self.epoch:
            return _END_OF_PASS, share, shares  # the others are in a later epoch: this pass has nothing left
        if epoch > self.epoch:  # the loader began the next epoch
            self.epoch, self.frontier, self.redraw = epoch, 0, False
        if self.redraw:
            self.redraw = False
            return self.frontier, share, shares
        return position, share, shares

    def handed_out(self, step: Step) -> None:
        self.pending.append(step)

    # ------------------------------------------------------------------------------------------ the step's side
    def matches(self, share: int, shares: int) -> str | None:
        """Why the batches handed out since the last settle are not what a step of this quorum trains, or ``None``."""
        expected = self.frontier
        for step in self.pending:
            if step.epoch != self.epoch or step.start != expected:
                return f"its batch starts at {step.epoch}:{step.start}, the committed position is {self.epoch}:{expected}"
            if (step.share, step.shares) != (share, shares):
                return f"its batch was cut into {step.shares} shares (this one {step.share}), the quorum has {shares}"
            expected = step.end
        return None

    def settle(self, outcome: str) -> None:
        """``"committed"``: the pending batches were trained; ``"healed"``: the step committed with the position a live
        group sent; ``"dropped"``: draw them again from the frontier; ``"open"``: not decided yet."""
        if outcome == "open":
            return
        received = self.received
        if outcome == "committed" and self.pending:
            self.epoch, self.frontier = self.pending[-1].epoch, self.pending[-1].end
        elif outcome == "healed" and received is not None:  # the step in flight committed: where the sender is after it
            self.epoch, self.frontier = received["end_epoch"], received["end"]
            self.redraw = True
        elif outcome == "dropped":
            if received is not None:  # the sender's committed position
                self.epoch, self.frontier = received["epoch"], received["frontier"]
            self.redraw = True
        self.received = None
        self.pending = []

    # ------------------------------------------------------------------------------------------ state
    def state(self) -> dict[str, Any]:
        """What a healing group takes: the committed position, and where it is once the step (or window) in flight
        commits."""
        last = self.pending[-1] if self.pending else None
        return {
            "epoch": self.epoch,
            "frontier": self.frontier,
            "end_epoch": last.epoch if last is not None else self.epoch,
            "end": last.end if last is not None else self.frontier,
        }

    def load(self, state: dict[str, Any]) -> None:
        self.received = dict(state)


class ReplicatedPosition:
    """The cursors of one strategy's loaders, their place in the state a rejoining group receives, and the outcome of
    each step for them and for the sample ledger."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self.cursors: list[GroupCursor] = []
        self.steps_dropped = 0
        self.samples_requeued = 0
        self.verdict: bool | dict[str, Any] | None = True
        self._place: tuple[int, int] | None = None

    def cursor(self) -> GroupCursor:
        cursor = GroupCursor(self)
        self.cursors.append(cursor)
        return cursor

    def register(self, manager: Any) -> None:
        manager.register_state_dict_fn("data_position", self._load, self._save)

    def _save(self) -> list[dict[str, Any]]:
        return [cursor.state() for cursor in self.cursors]

    def _load(self, states: list[dict[str, Any]]) -> None:
        for cursor, state in zip(self.cursors, states):
            cursor.load(state)

    # ------------------------------------------------------------------------------------------ shares
    def note_quorum(self, rank: int, size: int) -> None:
        """After a step: this group's place among all groups of its quorum (those that healed in it included, who take
        part fully in the next one), the membership the next batches are cut for."""
        if size > 0:
            self._place = (rank, size)

    def shares(self) -> tuple[int, int]:
        """This process's share of a global batch and how many there are: this group's place in the latest quorum
        (every group of it; before any quorum, the configured replica group and count), times the data axes inside the
        group."""
        share, shares = 0, 1
        for axis in self.strategy.topology.data_axes:
            coordinate, size = (self._place or (axis.coordinate, axis.size)) if axis.fault_tolerant else (axis.coordinate, axis.size)
            share, shares = share * size + coordinate, shares * size
        return share, shares

    def _inner_size(self) -> int:
        inner = 1
        for axis in self.strategy.topology.data_axes:
            if not axis.fault_tolerant:
                inner *= axis.size
        return inner

    # ------------------------------------------------------------------------------------------ synchronous steps
    def before_commit(self, manager: Any, quorum_size: int) -> None:
        """Before this group's commit vote (``quorum_size``: the groups in the step's quorum, those that heal in it
        included): vote no when the step's batches are not what its quorum trains.

        A quorum in which a group heals trains nothing: the healing group's gradients are zeroed (torchft), so a
        global batch cut among all members would lose its share, and one cut among the others would leave the healing
        group with a different position. Every group then votes no (the healing one too: it has the live state once
        the vote is taken), all stay at the same step, and the next quorum draws again with everyone."""
        if not self.cursors:
            return  # no global-order loader: torchft's own decision
        if not manager.is_participating():
            return self._vote_no(manager, "this group receives the live state in this step")
        rank, participants = manager.participating_rank(), manager.num_participants()
        if participants != quorum_size:
            return self._vote_no(manager, f"{quorum_size - participants} group(s) receive the live state in this step")
        inner = self._inner_size()
        share, shares = rank * inner + self.shares()[0] % inner, participants * inner
        for cursor in self.cursors:
            why = cursor.matches(share, shares)
            if why is not None:
                return self._vote_no(manager, why)

    def _vote_no(self, manager: Any, why: str) -> None:
        manager.report_error(RuntimeError(f"fabric-ft: the step's data is drawn again ({why})"))

    def after_commit(self, committed: bool, healed: bool, trained: bool = True) -> None:
        """After the commit vote: move the frontier (committed), take the received one (healed), or draw again (not
        committed, or committed without training: the job's first step, which only synchronises the weights)."""
        if committed and not trained:
            outcome, self.verdict = "dropped", False
        elif committed and not healed:
            outcome, self.verdict = "committed", True
        elif committed and healed:
            outcome, self.verdict = "healed", False
        else:
            outcome, self.verdict = "dropped", False
            self.steps_dropped += 1
            self.samples_requeued += sum(len(step.indices) for cursor in self.cursors for step in cursor.pending)
        for cursor in self.cursors:
            cursor.settle(outcome)

    # ------------------------------------------------------------------------------------------ semi-synchronous
    def after_inner_step(
        self, synchronised: bool, committed: bool, healed: bool, participants: int, first: bool = False
    ) -> None:
        """After an inner step of LocalSGD/DiLoCo: nothing decided yet, unless it ended with a synchronisation."""
        if not synchronised:
            self.verdict = None
            for cursor in self.cursors:
                cursor.settle("open")
            return
        if committed and not healed:
            inner = self._inner_size()
            # torchft's first synchronisation (init_sync) averages only the first group's window: the others receive
            # its weights with their own pseudo-gradients discarded
            live = (1 if first else participants) * inner
            shares = max((step.shares for cursor in self.cursors for step in cursor.pending), default=live)
            self.verdict = {"live_shares": min(live, shares)}
            outcome = "committed"
        elif committed:
            self.verdict, outcome = False, "healed"
        else:
            self.verdict, outcome = False, "dropped"
            self.steps_dropped += 1
            self.samples_requeued += sum(len(step.indices) for cursor in self.cursors for step in cursor.pending)
        for cursor in self.cursors:
            cursor.settle(outcome)
