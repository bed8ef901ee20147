"""One iteration, and the work of one step: checks, the one agreement, the optimizer steps.

Invariant: every optimizer of an iteration steps or skips on every rank alike, after ONE
collective per `step()`/`clip_grad_norm_()` call however many optimizers, devices and dtypes
hold the gradients; `unscale_()` adds none after the first step (its local check waits for that
collective; on a scaler's first step it agrees at once).

An iteration runs from one `update()` to the next: scale, backward, then per optimizer at most
one `unscale_` (before its `step`) and one `step`. Its [`IterationBook`][] enforces those rules,
raising torch's own errors in torch's words (users' `match=` strings keep working), and
remembers what `clip_grad_norm_` already unscaled and agreed, which local checks of `unscale_`
still wait for the agreement, and whether every loss `scale()` saw was finite. The
[`Stepper`][] does the work for a scaler, on a book it is handed; it carries what a rank learns
across iterations: its gradient walks, its kernels' constants, whether it has agreed before,
and where the last overflow was.

A step may be one optimizer, a list of them, or a container (torchtitan's `OptimizersContainer`:
an `Optimizer` holding its parts in `optimizers`; Megatron's `ChainedOptimizer`:
`chained_optimizers`): every *leaf* optimizer underneath is checked in the one collective, fused
ones get the scale and the agreed flag, and each target's own `step()` is called once.
"""

from __future__ import annotations

import math
import operator
import sys
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum
from itertools import chain
from typing import Any, TypeAlias, cast

import torch
from torch.distributed.tensor import DTensor

from shardscale._check import Flags, Kernels, can_count, exact_norm_check
from shardscale._config import ScalerConfig
from shardscale._errors import ShardScaleWarning
from shardscale._exchange import Ballot, Exchange, Flag, Verdict
from shardscale._grads import GradGroups, GradWalk, NormGroups, move
from shardscale._locate import NonFiniteGrad, locate, log_located, optimizer_named_params
from shardscale._state import ScaleHome
from shardscale._torch import in_pipeline_shape_inference, no_torch_function_subclass

# What `unscale_`/`step` accept: an optimizer (or a container of several), or a list.
OptimizerTarget: TypeAlias = torch.optim.Optimizer | Sequence[torch.optim.Optimizer]

_CONTAINER_ATTRIBUTES = ("optimizers", "chained_optimizers")
_OPTIMIZER = operator.attrgetter("optimizer")
_LEAVES = operator.itemgetter(1)
_DEVICE = operator.attrgetter("device")


Stage = Enum("Stage", "READY UNSCALED STEPPED", start=0)


@dataclass(slots=True)
class OptimizerRecord:
    """Where one optimizer is in the iteration, and what the group agreed for it."""

    optimizer: torch.optim.Optimizer
    stage: Stage = Stage.READY
    verdict: Verdict | None = None


@dataclass(frozen=True, slots=True)
class Clipped:
    """What `clip_grad_norm_` unscaled and agreed on in this iteration, for steps to reuse."""

    param_ids: frozenset[int]
    verdict: Verdict


@dataclass(frozen=True, slots=True)
class Clip:
    """What `clip_grad_norm_` asks of an agreement.

    Attributes:
        replicas: How many ranks hold the same plain (non-DTensor) gradients (`replica_group`).
        scaled: Whether the gradients still carry the scale (False: `unscale_()` divided it out).
    """

    params: list[torch.Tensor]
    max_norm: float
    norm_type: float
    replicas: int
    scaled: bool = True


@dataclass(slots=True)
class PendingCheck:
    """Gradients `unscale_()` checked and unscaled locally, whose flags await the agreement
    (the next `step`, `clip_grad_norm_` or `update`), so `unscale_` + clip + step still cost
    one collective.

    Attributes:
        bins: Their bins (`scale_policy="fit"`, the meter's steps: `Kernels.bins`), before the
            unscale.
    """

    records: list[OptimizerRecord] = field(default_factory=list)
    flags: list[torch.Tensor] = field(default_factory=list)
    holds: bool = False
    bins: list[torch.Tensor] = field(default_factory=list)


def optimizer_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """Every parameter of every param group of `optimizer`, in order."""
    for group in optimizer.param_groups:
        yield from group["params"]


def takes_scale(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step()` reads `grad_scale`/`found_inf` itself (fused, capturable
    with amp support): it unscales and skips on the device, with no host synchronisation."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def _is_optimizer(value: object) -> bool:
    return isinstance(value, torch.optim.Optimizer) or (
        hasattr(value, "param_groups") and callable(getattr(value, "step", None))
    )


def _leaves_of(optimizer: object) -> Iterator[torch.optim.Optimizer]:
    for attribute in _CONTAINER_ATTRIBUTES:
        inner = getattr(optimizer, attribute, None)
        if isinstance(inner, (list, tuple)) and inner and all(map(_is_optimizer, inner)):
            for item in inner:
                yield from _leaves_of(item)
            return
    yield optimizer  # type: ignore[misc]


def steppables(target: object) -> list[tuple[Any, tuple[torch.optim.Optimizer, ...]]]:
    """Resolve `target` into what to step, each with the leaf optimizers under it.

    Raises:
        TypeError: `target` is not an optimizer, a container of them, or a list of those.
        ValueError: the list is empty, or names one optimizer twice.
    """
    items = list(target) if isinstance(target, (list, tuple)) else [target]
    if not items:
        raise ValueError("the list of optimizers must not be empty, got []")
    resolved = []
    seen: set[int] = set()
    for item in items:
        if not isinstance(item, torch.optim.Optimizer) and not _is_optimizer(item):
            raise TypeError(
                "expected a torch.optim.Optimizer (or a container of optimizers, or a list of "
                f"them), got {type(item).__name__}"
            )
        item_leaves = tuple(_leaves_of(item))
        for leaf in item_leaves:
            if id(leaf) in seen:
                raise ValueError(
                    f"the optimizer {type(leaf).__name__} at {id(leaf):#x} appears twice in the "
                    "optimizers given: each must be stepped once per iteration"
                )
            seen.add(id(leaf))
        resolved.append((item, item_leaves))
    return resolved


def leaves(target: object) -> list[torch.optim.Optimizer]:
    """The leaf optimizers of `target` (see `steppables`), in order."""
    return list(chain.from_iterable(map(_LEAVES, steppables(target))))


def combined(records: Iterable[OptimizerRecord]) -> Verdict | None:
    """The records' verdict: theirs when they share one (the usual case), else a new one whose
    flags are the largest of theirs (not read on the host yet); None where none has one.

    The one place verdicts are combined (several optimizers, agreements, leaves of a container).
    """
    distinct: list[Verdict] = []
    for record in records:
        if record.verdict is not None and record.verdict not in distinct:  # by identity
            distinct.append(record.verdict)
    if len(distinct) <= 1:
        return distinct[0] if distinct else None
    device = distinct[0].flags.device
    verdict = Verdict(torch.stack([move(v.flags, device) for v in distinct]).amax(0))
    peaks = [move(v.peak, device) for v in distinct if v.peak is not None]
    verdict.peak = torch.stack(peaks).amax() if peaks else None
    counts = [move(v.counts, device) for v in distinct if v.counts is not None]
    verdict.counts = torch.stack(counts).sum(0) if counts else None
    return verdict


@dataclass(slots=True)
class IterationBook:
    """The records of one iteration (module docstring).

    Attributes:
        step: The number (1-based) of the step this iteration takes; error messages name it.
        loss_scale: The scale this iteration's losses were multiplied by, a copy of the live one
            made at its first `scale()` (None: not yet, or never on this rank: a pipeline stage that
            computes no loss, which takes the live one); its gradients are divided by exactly this.
        loss_nonfinite: bool scalar: some loss `scale()` multiplied in this iteration was inf or NaN
            (None: none was scaled on this rank).
        losses: The losses themselves (detached), to locate a forward overflow.
    """

    step: int
    loss_scale: torch.Tensor | None = None
    records: dict[int, OptimizerRecord] = field(default_factory=dict)
    clipped: Clipped | None = None
    pending: PendingCheck = field(default_factory=PendingCheck)
    loss_nonfinite: torch.Tensor | None = None
    losses: list[torch.Tensor] = field(default_factory=list)

    def note_loss(self, loss: torch.Tensor, into: torch.Tensor | None) -> None:
        """Remember on the device whether `loss` is finite: two kernels (a third for a loss of
        several elements, and from the second loss on: gradient accumulation counts every
        micro-batch); no host synchronisation. The first loss's bit is written `into` that
        tensor, if given (one a CUDA graph reads). The loss is kept (a reference, no copy) to
        locate a forward overflow."""
        if "torch.distributed.pipelining" in sys.modules and in_pipeline_shape_inference():
            return  # a loss of placeholder tensors (see there): nothing to check
        value = loss.detach()
        if isinstance(value, DTensor):  # a loss_parallel loss: this rank's part of it
            value = value.to_local()
        nonfinite = torch.isnan(value * 0)  # inf * 0 and NaN * 0 are NaN; a finite x: 0
        nonfinite = nonfinite.reshape(()) if nonfinite.numel() == 1 else nonfinite.any()
        if self.loss_nonfinite is not None:
            self.loss_nonfinite |= nonfinite
        else:
            self.loss_nonfinite = nonfinite if into is None else into.copy_(nonfinite)
        self.losses.append(value)

    def begin_unscale(
        self, optimizers: Iterable[torch.optim.Optimizer]
    ) -> tuple[list[OptimizerRecord], list[OptimizerRecord]]:
        """The records `unscale_` must check now, and those that took `clip_grad_norm_`'s
        unscale and verdict instead.

        Raises:
            RuntimeError: an optimizer was unscaled already, or stepped, since the last update.
        """
        to_check, adopted = [], []
        for optimizer in optimizers:
            record = self.records.setdefault(id(optimizer), OptimizerRecord(optimizer))
            if self.clipped is not None and self._adopt_clip(record, self.clipped):
                adopted.append(record)
            elif record.stage is Stage.UNSCALED:
                raise RuntimeError(
                    "unscale_() has already been called on this optimizer since the last update()."
                )
            elif record.stage is Stage.STEPPED:
                raise RuntimeError("unscale_() is being called after step().")
            else:
                to_check.append(record)
        return to_check, adopted

    def begin_step(
        self, optimizers: Iterable[torch.optim.Optimizer]
    ) -> tuple[list[OptimizerRecord], list[OptimizerRecord]]:
        """The records of `step`'s optimizers, and those that took `clip_grad_norm_`'s
        unscale and verdict just now.

        Raises:
            RuntimeError: one of them was stepped already since the last update.
        """
        records, adopted = [], []
        for optimizer in optimizers:
            record = self.records.setdefault(id(optimizer), OptimizerRecord(optimizer))
            if record.stage is Stage.STEPPED:
                raise RuntimeError("step() has already been called since the last update().")
            records.append(record)
            if self.clipped is not None and self._adopt_clip(record, self.clipped):
                adopted.append(record)
        return records, adopted

    def _adopt_clip(self, record: OptimizerRecord, clipped: Clipped) -> bool:
        """Take `clip_grad_norm_`'s unscale and flag for `record` if the clip covered it: every
        parameter of its optimizer (the usual case: no `.grad` read, 0.3 us a parameter), or
        every one with a gradient.

        Raises:
            RuntimeError: the clip covered some, but not all, of the optimizer's gradients.
        """
        if record.stage is not Stage.READY:
            return False
        if not clipped.param_ids.issuperset(map(id, optimizer_params(record.optimizer))):
            with no_torch_function_subclass():  # DTensor .grad: 0.1 us, not 0.25
                mine = {id(p) for p in optimizer_params(record.optimizer) if p.grad is not None}
            if mine & clipped.param_ids and not mine <= clipped.param_ids:
                raise RuntimeError(
                    "clip_grad_norm_() unscaled some, but not all, of this optimizer's gradients: "
                    "pass every parameter of the optimizers it precedes (e.g. model.parameters())"
                )
            if not mine <= clipped.param_ids:
                return False
        record.verdict = clipped.verdict
        record.stage = Stage.UNSCALED
        return True

    def unscaled_param_ids(self) -> set[int]:
        """The parameters whose gradients were unscaled in this iteration already."""
        unscaled = [record for record in self.records.values() if record.stage is not Stage.READY]
        return set(map(id, _params(unscaled)))


class Stepper:
    """Checks, agrees, unscales, clips and steps, for one scaler on one rank.

    Args:
        exchange: the process group and its collectives.
        home: the scale state, and whether this rank scaled or holds an unconfirmed scale.
        config: the scaler's options; read here: `locate_overflow` (on overflow steps, find and
            log the non-finite gradients) and `underflow_every` (the meter's steps).
    """

    def __init__(self, exchange: Exchange, home: ScaleHome, config: ScalerConfig) -> None:
        self.exchange = exchange
        self.home = home
        self.kernels = Kernels()
        self.last_overflow: list[NonFiniteGrad] = []
        self._locate_overflow = config.locate_overflow
        self._meter_every = config.underflow_every
        self._walk = GradWalk()
        # Whether this scaler has been through an agreement: every rank passes its first at the
        # same collective, so "defer unscale_'s agreement" is decided alike everywhere.
        self._agreed_once = False
        self._warned_plain_replicas = False

    def unscale(self, book: IterationBook, target: object, scale: torch.Tensor) -> None:
        """`unscale_` of `target`'s optimizers: check and unscale, and agree at the next point
        that needs the decision, except on this scaler's first step: there a pipeline stage that
        never scaled must agree before it modifies anything, and every rank must then issue the
        same collectives, whichever stage it holds."""
        to_check, adopted = book.begin_unscale(leaves(target))
        if adopted and self._locate_overflow:
            self._locate_if_overflowed(book, adopted)
        if to_check and not self._agreed_once:
            self.agree(book, scale, "unscale_", unscale=to_check)
        elif to_check:
            pending = book.pending
            with torch.no_grad():
                groups, _, holds = self._walk.groups(_params(to_check))
                every = self._meter_every  # the meter's step: an inf-norm clip may still undo it
                counts = bool(every) and not book.step % every and can_count(scale.device)
                if self.home.host.policy.fit or counts:
                    pending.bins.append(self.kernels.bins((groups,), scale.device, None, counts))
                flags = self.kernels.check_(groups, self.kernels.inverse(scale), {})
            pending.records.extend(to_check)
            pending.flags.extend(flags.values())
            pending.holds = pending.holds or holds
            for record in to_check:
                record.stage = Stage.UNSCALED

    def check(self, book: IterationBook, target: object, scale: torch.Tensor) -> list[Any]:
        """The check and the one agreement for a `step()` of `target`, not stepping yet.

        Returns:
            The steppables of `target` (see `steppables`).

        Raises:
            RuntimeError: one of its optimizers was stepped already since the last update.
        """
        items = steppables(target)
        records, adopted = book.begin_step(chain.from_iterable(map(_LEAVES, items)))
        if adopted and self._locate_overflow:
            self._locate_if_overflowed(book, adopted)
        unscale: list[OptimizerRecord] = []
        check: list[OptimizerRecord] = []
        for record in records:
            if record.stage is Stage.READY and record.verdict is None:
                (check if takes_scale(record.optimizer) else unscale).append(record)
        if unscale or check or book.pending.records:
            # Fused optimizers unscale inside their own kernel: check, don't write.
            self.agree(book, scale, "step", unscale=unscale, check=check)
        return items

    def step(
        self,
        book: IterationBook,
        items: list[Any],
        scale: torch.Tensor,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> tuple[list[Any], Verdict]:
        """Step the checked `items` (from [`check()`][check]), or skip them, as agreed.

        Returns:
            What each item's `step()` returned (None where skipped), and the step's verdict
            (read on the host where any optimizer is not fused).
        """
        results = []
        every = []
        for item, item_leaves in items:
            records = list(map(book.records.__getitem__, map(id, item_leaves)))
            verdict = cast(Verdict, combined(records))
            every.extend(records)
            # fused optimizers skip on the device; the others cost the one host read
            skip = not all(map(takes_scale, item_leaves)) and verdict.skipped()
            results.append(
                None
                if skip
                else _step_on_device(item, records, verdict.flags[Flag.SKIP], scale, args, kwargs)
            )
            for record in records:
                record.stage = Stage.STEPPED
        return results, cast(Verdict, combined(every))

    def agree(
        self,
        book: IterationBook,
        scale: torch.Tensor,
        funcname: str,
        *,
        unscale: Sequence[OptimizerRecord] = (),
        check: Sequence[OptimizerRecord] = (),
    ) -> Verdict:
        """Check the records' gradients, and agree on ONE verdict for them and for the checks
        `unscale_` left pending.

        `unscale`'s gradients are divided by the scale in place (their stage becomes UNSCALED);
        `check`'s are only checked (fused optimizers unscale them in their own kernel). On a
        rank that never called `scale()` (`funcname` names the call for the error where no
        rank did) nothing is modified until the group has confirmed that some rank did.
        """
        kernels = self.kernels
        with torch.no_grad():
            groups, _, holds = self._walk.groups(_params(unscale))
            checked, _, holds_checked = self._walk.groups(_params(check))
            confirm = funcname if self.home.unconfirmed else None
            holds = holds or holds_checked
            ballot, flags = self._ballot(book, scale.device, holds, confirm, (groups, checked))
            inv = kernels.inverse(scale) if unscale else None
            kernels.check_(groups, None if confirm else inv, flags)
            kernels.check_(checked, None, flags)
            verdict = self._vote(book, ballot, flags, confirm, None, [*unscale, *check])
            if confirm is not None and inv is not None:  # confirmed: unscale now
                kernels.multiply_(groups, inv)
            for record in unscale:
                record.stage = Stage.UNSCALED
        return verdict

    def clip(self, book: IterationBook, scale: torch.Tensor | None, clip: Clip) -> Verdict:
        """`clip_grad_norm_`: the norm share of `clip`'s gradients travels with the flags (and
        the checks `unscale_` left pending) in ONE collective; then they are clipped (and
        unscaled, unless `unscale_` did) to the agreed global norm. Without a `scale` (a
        disabled scaler) only the norm is agreed on."""
        kernels = self.kernels
        with torch.no_grad():
            norms, plain, holds = self._walk.groups(clip.params, clip.replicas)
            # a disabled scaler has no scale: the gradients' device (the CPU without any)
            device = next(iter(norms), (torch.device("cpu"),))[0] if scale is None else scale.device
            if plain and scale is not None and not self.home.scaled_here:
                self._warn_plain_replicas_assumed(clip.replicas)
            confirm = "clip_grad_norm_" if scale is not None and self.home.unconfirmed else None
            unscaled = None if clip.scaled else scale  # its gradients' peak is times the scale
            ballot, flags = self._ballot(
                book, device, holds, confirm, (norms,), unscaled, clip.norm_type
            )
            inv = kernels.inverse(scale) if clip.scaled and scale is not None else None
            # The norms' check raises the ballot's own slot (no kernel of its own) where a
            # non-finite norm means a non-finite element; otherwise the elements are checked.
            exact = exact_norm_check(norms, clip.norm_type)
            factor = kernels.one(device) if inv is None else inv
            share = cast(torch.Tensor, ballot.norm)
            kernels.local_norms_(norms, clip.norm_type, factor, flags if exact else {}, share)
            if inv is not None and not exact:
                kernels.check_(norms, None, flags)
            verdict = self._vote(book, ballot, flags, confirm, clip.norm_type, [])
            total = cast(torch.Tensor, verdict.total_norm)  # exchanged with the flags
            kernels.clip_(norms, clip.max_norm, total, inv, verdict.flags[Flag.SKIP])
        return verdict

    def _ballot(
        self,
        book: IterationBook,
        device: torch.device,
        holds: bool,
        confirm: str | None,
        groups: tuple[GradGroups | NormGroups, ...],
        unscaled: torch.Tensor | None = None,
        norm_type: float | None = None,
    ) -> tuple[Ballot, Flags]:
        """This rank's ballot (with the norm slot where a `norm_type` travels), and the local
        checks' flags, its own skip slot first.

        It holds gradients where `unscale_`'s pending checks did. Its bins, where it has them,
        add up those of `groups` (still scaled, or times the scale where `unscaled` is it) and
        of the pending checks: element counts on the meter's steps, else (the fit's) the slot
        holding the largest |scaled gradient|, raised. The meter's step waits where an inf-norm
        travels (its shares need a MAX, the counts a SUM).
        """
        every, inf_norm = self._meter_every, norm_type is not None and math.isinf(norm_type)
        # `not step % every`, a Python bool even where torch.compile traces the step as a symbol
        counts = bool(every) and not book.step % every and not inf_norm and can_count(device)
        ballot = self.exchange.ballot(
            device,
            holds_grads=holds or book.pending.holds,
            has_scale=confirm is None,
            loss_nonfinite=book.loss_nonfinite,
            with_norm=norm_type is not None,
            bins=self.home.host.policy.fit,
            counts=counts,
        )
        if ballot.bins is not None:
            parts = (self.kernels.bins(groups, device, unscaled, counts), *book.pending.bins)
            added = torch.stack([move(b, ballot.bins.device) for b in parts]).sum(0)
            ballot.bins.copy_(added if counts else added > 0)
        return ballot, {ballot.skip.device: ballot.skip}

    def _vote(
        self,
        book: IterationBook,
        ballot: Ballot,
        flags: Flags,
        confirm: str | None,
        norm_type: float | None,
        records: list[OptimizerRecord],
    ) -> Verdict:
        """The one collective on the ballot, with this rank's other flags and those of
        `unscale_`'s pending checks; the scale is confirmed after it (`confirm`). The verdict
        goes to `records` and the pending ones, whose overflow is located where asked."""
        pending, book.pending = book.pending, PendingCheck()
        others = pending.flags  # and this rank's flags on other devices than the ballot's
        for flag in flags.values():
            if flag is not ballot.skip:
                others.append(flag)
        verdict = self.exchange.agree(
            ballot, others, step=book.step, confirm_scale=confirm, norm_type=norm_type
        )
        if confirm is not None:  # the group confirmed that some rank scaled
            self.home.confirm()
        self._agreed_once = True
        records += pending.records
        for record in records:
            record.verdict = verdict
        if self._locate_overflow:
            self._locate_if_overflowed(book, records)
        return verdict

    def _warn_plain_replicas_assumed(self, replicas: int) -> None:
        """Warn, once, where the default replica group is most likely wrong: plain gradients on
        a rank that never scaled (a pipeline stage), taken as replicated on every rank."""
        world_size = self.exchange.world_size
        if self._warned_plain_replicas or replicas != world_size or world_size == 1:
            return
        self._warned_plain_replicas = True
        warnings.warn(
            "clip_grad_norm_ on a rank that never called scale() (a pipeline stage that computes "
            "no loss?) got plain (non-DTensor) gradients and, with replica_group=None, takes "
            f"them as replicated on all {world_size} ranks of the scaler's group (as under DDP). "
            "If they are this stage's own, pass replica_group= (the stage's data-parallel group, "
            "or 1 for pure pipeline parallelism): otherwise the norm is too small.",
            ShardScaleWarning,
            stacklevel=4,
        )

    def locate_now(self, book: IterationBook, with_losses: bool) -> list[NonFiniteGrad]:
        """Where the non-finite gradients of `book`'s optimizers are (and, `with_losses`, which
        ranks' losses were non-finite), gathered from every rank: call it on every rank."""
        named = [
            pair for r in book.records.values() for pair in optimizer_named_params(r.optimizer)
        ]
        return locate(named, self.exchange, book.step, book.losses if with_losses else [])

    def _locate_if_overflowed(self, book: IterationBook, records: list[OptimizerRecord]) -> None:
        """With `locate_overflow`: on an overflow step, find and log the non-finite gradients
        (and losses) of `records`, on every rank alike."""
        if not records:
            return
        verdict = cast(Verdict, records[0].verdict)
        if not verdict.skipped():  # the same on every rank
            return
        forward = bool(verdict.flags[Flag.FORWARD].item())
        named = [pair for record in records for pair in optimizer_named_params(record.optimizer)]
        losses = book.losses if forward else []
        self.last_overflow = locate(named, self.exchange, book.step, losses)
        log_located(book.step, self.last_overflow, forward)


def _params(records: Iterable[OptimizerRecord]) -> Iterator[torch.Tensor]:
    """The parameters of the records' optimizers, in order."""
    return chain.from_iterable(map(optimizer_params, map(_OPTIMIZER, records)))


def _step_on_device(
    item: Any,
    records: list[OptimizerRecord],
    found_inf: torch.Tensor,
    scale: torch.Tensor,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """Step `item`, handing every fused optimizer in it the scale and the agreed flag.

    torch's fused (and capturable, amp-aware) optimizers read `grad_scale` and `found_inf`
    themselves: they unscale inside their own kernel and skip on the device when `found_inf` is
    1.0. Both are set for the duration of the step only. One whose gradients are still scaled
    gets `grad_scale` (times its own, if the user set one); one already unscaled (`unscale_`,
    `clip_grad_norm_`) only its own.

    Each gets both tensors on its own parameters' device: torch's fused Adam/AdamW/Adagrad move
    them there with `non_blocking=True`, which from a GPU to the CPU returns before the copy lands,
    and their CPU kernel reads the values at once (a stale scale, a missed skip: inf in
    CPU-offloaded master weights). So the copy to the CPU is made here, blocking: one
    device-to-host copy per step and CPU device, the price of a CPU kernel that needs a device
    value. Over several devices torch groups the parameters itself and the tensors are handed
    where the scale is: keep a fused optimizer's parameters on one device.
    """
    handed = []
    moved: dict[tuple[torch.device, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
    for record in records:
        leaf = record.optimizer
        if not takes_scale(leaf):
            continue
        own = getattr(leaf, "grad_scale", None)
        grad_scale = (scale if own is None else scale * own) if record.stage is Stage.READY else own
        devices = set(map(_DEVICE, optimizer_params(leaf)))
        if len(devices) == 1:
            device = devices.pop()
            key = (device, id(grad_scale))
            if key not in moved:
                moved[key] = _to_device(grad_scale, found_inf, device)
            leaf.grad_scale, leaf.found_inf = moved[key]  # type: ignore[attr-defined]
        else:
            leaf.grad_scale, leaf.found_inf = grad_scale, found_inf  # type: ignore[attr-defined]
        handed.append(leaf)
    try:
        return item.step(*args, **kwargs)
    finally:
        for leaf in handed:
            del leaf.grad_scale, leaf.found_inf  # type: ignore[attr-defined]


def _to_device(
    grad_scale: torch.Tensor | None, found_inf: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """`grad_scale` and `found_inf` on `device`: themselves when there, else ONE copy (both
    stacked: one blocking copy to the CPU, not two)."""
    if found_inf.device == device and (grad_scale is None or grad_scale.device == device):
        return grad_scale, found_inf
    if grad_scale is None or grad_scale.dtype != found_inf.dtype:
        return None if grad_scale is None else move(grad_scale, device), move(found_inf, device)
    both = move(torch.stack((grad_scale.reshape(()), found_inf)), device)
    return both[0].reshape(grad_scale.shape), both[1]
