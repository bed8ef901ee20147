"""One iteration's book: what each optimizer did since the last `update()`, under torch's rules.

An iteration runs from one `update()` to the next: scale, backward, then per optimizer at most
one `unscale_` (before its `step`) and one `step`; `update()` consumes the agreed overflow
flags. The book enforces those rules, raising torch's own errors in torch's words (users'
`match=` strings keep working), and remembers what `clip_grad_norm_` already unscaled and
agreed, and which local checks of `unscale_` still wait for the agreement. The synchronous
scaler keeps one book at a time; the async scaler one per iteration in flight, each with its own
copy of the scale its losses were multiplied by.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum

import torch

from shardscale._optimizers import optimizer_params

__all__ = [
    "Clipped",
    "InFlightIteration",
    "IterationBook",
    "OptimizerRecord",
    "PendingCheck",
    "Stage",
]


class Stage(Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


@dataclass(slots=True)
class OptimizerRecord:
    """Where one optimizer is in the iteration, and its agreed overflow flag."""

    optimizer: torch.optim.Optimizer
    stage: Stage = Stage.READY
    found_inf: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class Clipped:
    """What `clip_grad_norm_` unscaled and agreed on in this iteration, for steps to reuse."""

    param_ids: frozenset[int]
    found_inf: torch.Tensor


@dataclass(slots=True)
class PendingCheck:
    """Gradients `unscale_()` checked and unscaled locally, whose flags await the agreement.

    The agreement waits for the next point that needs it (`step`, `clip_grad_norm_`,
    `update`), so `unscale_` + clip + step still cost one collective.
    """

    records: list[OptimizerRecord] = field(default_factory=list)
    flags: list[torch.Tensor] = field(default_factory=list)
    holds: bool = False


class IterationBook:
    """The records of one iteration.

    Args:
        step: the number (1-based) of the step this iteration takes; error messages name it.
        loss_scale: the scale this iteration's losses were multiplied by (None: not yet, or never
            on this rank: a pipeline stage that computes no loss).
        on_agreed: called with the book each time some of its optimizers' flags are agreed.
    """

    def __init__(
        self,
        step: int,
        loss_scale: torch.Tensor | None = None,
        on_agreed: Callable[[IterationBook], None] | None = None,
    ) -> None:
        self.step = step
        self.loss_scale = loss_scale
        self.records: dict[int, OptimizerRecord] = {}
        self.clipped: Clipped | None = None
        self.pending: PendingCheck | None = None
        self._on_agreed = on_agreed

    def record(self, optimizer: torch.optim.Optimizer) -> OptimizerRecord:
        """This iteration's record for `optimizer` (made at first sight)."""
        record = self.records.get(id(optimizer))
        if record is None:
            record = self.records[id(optimizer)] = OptimizerRecord(optimizer)
        return record

    def begin_unscale(
        self, leaves: Iterable[torch.optim.Optimizer]
    ) -> tuple[list[OptimizerRecord], list[OptimizerRecord]]:
        """The records `unscale_` must check now, and those that took `clip_grad_norm_`'s
        unscale and verdict instead.

        Raises:
            RuntimeError: an optimizer was unscaled already, or stepped, since the last update.
        """
        records = [self.record(leaf) for leaf in leaves]
        to_check, adopted = [], []
        for record in records:
            if self.adopt_clip(record):
                adopted.append(record)
                continue
            if record.stage is Stage.UNSCALED:
                raise RuntimeError(
                    "unscale_() has already been called on this optimizer since the last update()."
                )
            if record.stage is Stage.STEPPED:
                raise RuntimeError("unscale_() is being called after step().")
            to_check.append(record)
        return to_check, adopted

    def begin_step(
        self, leaves: Iterable[torch.optim.Optimizer]
    ) -> tuple[list[OptimizerRecord], list[OptimizerRecord]]:
        """The records of `step`'s optimizers, and those that took `clip_grad_norm_`'s
        unscale and verdict just now.

        Raises:
            RuntimeError: one of them was stepped already since the last update.
        """
        records = [self.record(leaf) for leaf in leaves]
        if any(record.stage is Stage.STEPPED for record in records):
            raise RuntimeError("step() has already been called since the last update().")
        adopted = [record for record in records if self.adopt_clip(record)]
        return records, adopted

    def adopt_clip(self, record: OptimizerRecord) -> bool:
        """Take `clip_grad_norm_`'s unscale and flag for `record` if the clip covered it.

        Raises:
            RuntimeError: the clip covered some, but not all, of the optimizer's gradients.
        """
        clipped = self.clipped
        if clipped is None or record.stage is not Stage.READY:
            return False
        with torch._C.DisableTorchFunctionSubclass():  # DTensor .grad: 0.1 us, not 0.25
            mine = {id(p) for p in optimizer_params(record.optimizer) if p.grad is not None}
        if mine <= clipped.param_ids:
            record.found_inf = clipped.found_inf
            record.stage = Stage.UNSCALED
            return True
        if mine & clipped.param_ids:
            raise RuntimeError(
                "clip_grad_norm_() unscaled some, but not all, of this optimizer's gradients: "
                "pass every parameter of the optimizers it precedes (e.g. model.parameters())"
            )
        return False

    def unscaled_param_ids(self) -> set[int]:
        """The parameters whose gradients were unscaled in this iteration already."""
        return {
            id(p)
            for record in self.records.values()
            if record.stage is not Stage.READY
            for p in optimizer_params(record.optimizer)
        }

    def add_pending(
        self, records: list[OptimizerRecord], flags: Iterable[torch.Tensor], holds: bool
    ) -> None:
        """Remember local checks whose flags the next agreement must include."""
        if self.pending is None:
            self.pending = PendingCheck()
        self.pending.records.extend(records)
        self.pending.flags.extend(flags)
        self.pending.holds = self.pending.holds or holds

    def take_pending(self) -> PendingCheck | None:
        """The local checks awaiting the agreement, now handed to it."""
        pending, self.pending = self.pending, None
        return pending

    def agreed(self, records: Iterable[OptimizerRecord], found_inf: torch.Tensor) -> None:
        """Record the group's verdict for `records`."""
        for record in records:
            record.found_inf = found_inf
        if self._on_agreed is not None:
            self._on_agreed(self)

    def found_infs(self) -> list[torch.Tensor]:
        """The agreed flags of this iteration, each distinct tensor once."""
        flags = (r.found_inf for r in self.records.values() if r.found_inf is not None)
        return list({id(flag): flag for flag in flags}.values())


@dataclass(eq=False, slots=True)
class InFlightIteration:
    """One iteration of the async scaler, from its first `scale()` until it is stepped and its
    scale update applied (several may be in flight at once)."""

    number: int
    """1-based, counted by this scaler (the step it takes is `book.step`)."""
    book: IterationBook
    closed: bool = False
    """update() was called for it."""
    resolved: bool = False
    """Its scale update was applied."""
    manual_scale: torch.Tensor | None = None
    failure: BaseException | None = None

    @property
    def agreed(self) -> bool:
        return bool(self.book.found_infs())

    @property
    def stepped(self) -> bool:
        records = self.book.records.values()
        return bool(records) and all(r.stage is Stage.STEPPED for r in records)
