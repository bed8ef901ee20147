"""A step's bookkeeping: the iteration's book, what each call records in it, and each step's
plan and run. One room for it: the scaler hands its optimizers here, and they go no further
than the parameters whose gradients `shardscale._check` checks and agrees on.

Invariant: every optimizer of an iteration steps or skips on every rank alike, each on its own
verdict, after ONE collective per `step()`/`clip_grad_norm_()` call however many optimizers,
devices and dtypes hold the gradients; `unscale_()` adds none after the first step (its local
check waits for that collective, in a slot of its own; on a scaler's first step it agrees at
once).

An iteration runs from one `update()` to the next: scale, backward, then per optimizer at most
one `unscale_` (before its `step`) and one `step`, and at most one `clip_grad_norm_`. Its
[`IterationBook`][] keeps, as torch's `_per_optimizer_states` does, a record per optimizer (its
stage, and the check whose verdict it takes), raising torch's own errors in torch's words
(users' `match=` strings keep working); and the iteration's checks ([`Check`][
shardscale._check.Check]: one per `unscale_()`, `step()` or clip call, each decided on its
own), what `clip_grad_norm_` already unscaled and agreed, and whether every loss `scale()` saw
was finite.

A step, as [`Steps`][] runs it: resolve what to step (`steppables`), record its leaves in the
book (`IterationBook.begin_step`), hand the gradients still to check to the agreement as one
check, with the checks `unscale_()` left waiting, record their verdicts, then step each target,
or skip it, as its own verdict says ([`StepPlan`][]); an optimizer none of whose parameters
holds a gradient on any rank raises there, on every rank, as torch's does.

A step may be one optimizer, a list of them, or a container (torchtitan's `OptimizersContainer`:
an `Optimizer` holding its parts in `optimizers`; Megatron's `ChainedOptimizer`:
`chained_optimizers`): every *leaf* optimizer underneath is checked in the one collective, fused
ones get the scale and the agreed flag, and each target's own `step()` is called once. The
leaves one call checks share its verdict (one check).
"""

from __future__ import annotations

import operator
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum
from functools import partial
from itertools import chain
from typing import Any, Protocol, TypeAlias, cast

import torch
from torch.distributed.tensor import DTensor

from shardscale._check import MAX_CHECKS, Agreement, Check
from shardscale._config import ScalerConfig
from shardscale._errors import no_inf_checks_message, no_scale_message
from shardscale._grads import move
from shardscale._locate import NonFiniteGrad, locate_optimizers, log_located
from shardscale._state import Flag, ScaleHome, Verdict, combined, device_path
from shardscale._torch import in_pipeline_shape_inference

# What `unscale_`/`step` accept: an optimizer (or a container of several), or a list.
OptimizerTarget: TypeAlias = torch.optim.Optimizer | Sequence[torch.optim.Optimizer]
# The arguments of `scaler.step()` that go on to each optimizer's own `step()`.
Args: TypeAlias = tuple[Any, ...]
Kwargs: TypeAlias = dict[str, Any]

_CONTAINER_ATTRIBUTES = ("optimizers", "chained_optimizers")
_OPTIMIZER = operator.attrgetter("optimizer")
_TAKES_SCALE = operator.attrgetter("takes_scale")
_VERDICT = operator.attrgetter("verdict")
_LEAVES = operator.itemgetter(1)
_DEVICE = operator.attrgetter("device")

Stage = Enum("Stage", "READY UNSCALED STEPPED", start=0)


class Clipped(Protocol):
    """What a `clip_grad_norm_` of the iteration unscaled and agreed
    ([`ClipRecord`][shardscale._clip.ClipRecord]): the steps after it ask it whether an
    optimizer's record takes its unscale and verdict, by the clip's rule (there)."""

    param_ids: frozenset[int]
    verdict: Verdict

    def adopts(self, record: OptimizerRecord) -> bool: ...


def optimizer_params(optimizers: Iterable[torch.optim.Optimizer]) -> Iterator[torch.Tensor]:
    """Every parameter of every param group of each of `optimizers`, in order."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            yield from group["params"]


@dataclass(slots=True)
class OptimizerRecord:
    """Where one optimizer is in the iteration, and what the group agreed for it: torch's
    `_per_optimizer_states[id(optimizer)]` (`shardscale._compat` answers it from here).

    Attributes:
        takes_scale: Whether its `step()` reads `grad_scale`/`found_inf` itself (fused, and
            capturable with amp support): it unscales and skips on the device, with no host
            synchronisation; its gradients are only checked.
        check: The check its gradients went into (its `unscale_()`'s, or its `step()`'s), whose
            verdict it takes; None: not checked yet, or a clip's took them all.
        verdict: What the group agreed for it (its check's, with a partial clip's).
        clipped: The `clip_grad_norm_` before its step, where it did not take the clip's
            verdict outright (the clip left out some of its parameters, an MoE model's dense
            part clipped, say: `shardscale._clip.ClipRecord.adopts`): those the clip unscaled
            keep its unscale, the others are checked and unscaled at its own agreement, and its
            verdict is both.
    """

    optimizer: torch.optim.Optimizer
    takes_scale: bool
    stage: Stage = Stage.READY
    check: Check | None = None
    verdict: Verdict | None = None
    clipped: Clipped | None = None

    def waiting_flags(self) -> dict[torch.device, torch.Tensor] | None:
        """What `unscale_()` found here while the agreement on it is still to come (None: not
        checked by `unscale_()`, or agreed)."""
        return None if self.check is None else self.check.waiting_flags()

    def params_to_check(self) -> Iterator[torch.Tensor]:
        """Its parameters whose gradients still carry the scale: all, less a partial clip's."""
        params = optimizer_params((self.optimizer,))
        if self.clipped is None:
            return params
        return (param for param in params if id(param) not in self.clipped.param_ids)


def _params_of(records: Iterable[OptimizerRecord]) -> list[torch.Tensor]:
    return [param for record in records for param in record.params_to_check()]


@dataclass(slots=True)
class IterationBook:
    """The records of one iteration (module docstring).

    Attributes:
        step: The number (1-based) of the step this iteration takes; error messages name it.
        loss_scale: The scale this iteration's losses were multiplied by, a copy of the live one
            made at its first `scale()` (None: not yet, or never on this rank: a pipeline stage that
            computes no loss, which takes the live one); its gradients are divided by exactly this.
        checks: The iteration's checks, in order: those still without a verdict wait for the
            next agreement ([`waiting()`][waiting]).
        collectives: The scaler's collectives in this iteration so far (a ballot's identity
            says which one it is).
        loss_nonfinite: bool scalar: some loss `scale()` multiplied in this iteration was inf or NaN
            (None: none was scaled on this rank).
        losses: The losses themselves (detached), to locate a forward overflow.
        fit_readings: Each backward's largest |scaled gradient| formed in fp16, where the
            iteration accumulates micro-batches (`shardscale._bins.Fp16Gradients`).
        peaks, counts, mismatches: What the iteration's agreements read, for `update()`: the
            fit's peaks, the meter's counts, an accelerator's identity mismatches.
        carried: A backward may carry `loss_scale`: a loss that requires grad was scaled, or
            the tensor itself was handed out (`loss_scale_tensor()`).
    """

    step: int
    loss_scale: torch.Tensor | None = None
    records: dict[int, OptimizerRecord] = field(default_factory=dict)
    clipped: Clipped | None = None
    checks: list[Check] = field(default_factory=list)
    collectives: int = 0
    loss_nonfinite: torch.Tensor | None = None
    losses: list[torch.Tensor] = field(default_factory=list)
    fit_readings: list[torch.Tensor] = field(default_factory=list)
    peaks: list[torch.Tensor] = field(default_factory=list)
    counts: list[torch.Tensor] = field(default_factory=list)
    mismatches: list[torch.Tensor] = field(default_factory=list)
    carried: bool = False

    def midway(self) -> bool:
        """Whether the iteration is under way: a backward may carry its scale, or an optimizer
        was unscaled, clipped or stepped."""
        return self.carried or bool(self.records) or self.clipped is not None

    def waiting(self) -> list[Check]:
        """The checks `unscale_()` left waiting for the agreement."""
        return [check for check in self.checks if check.waiting_flags() is not None]

    def record(self, optimizer: torch.optim.Optimizer) -> OptimizerRecord:
        """`optimizer`'s record in this iteration, made at its first call."""
        record = self.records.get(id(optimizer))
        if record is None:
            takes_scale = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
            record = self.records[id(optimizer)] = OptimizerRecord(optimizer, takes_scale)
        return record

    def new_check(self, records: Sequence[OptimizerRecord]) -> Check:
        """A check for `records`' gradients (one call's), which they take the verdict of."""
        check = Check()
        self.checks.append(check)
        for record in records:
            record.check = check
        return check

    def begin_unscale(
        self, targets: list[tuple[Any, tuple[torch.optim.Optimizer, ...]]]
    ) -> tuple[list[OptimizerRecord], list[OptimizerRecord]]:
        """The records of the targets' leaves that `unscale_` must check now, and those that
        took `clip_grad_norm_`'s unscale and verdict instead.

        Raises:
            RuntimeError: an optimizer was unscaled already, or stepped, since the last update.
        """
        to_check, adopted = [], []
        for optimizer in chain.from_iterable(map(_LEAVES, targets)):
            record = self.record(optimizer)
            if self.clipped is not None and self.clipped.adopts(record):
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
        self, targets: list[tuple[Any, tuple[torch.optim.Optimizer, ...]]]
    ) -> tuple[list[tuple[Any, list[OptimizerRecord]]], list[OptimizerRecord]]:
        """`step`'s targets, each with its leaves' records, and the records that took
        `clip_grad_norm_`'s unscale and verdict just now.

        Raises:
            RuntimeError: one of them was stepped already since the last update.
        """
        recorded, adopted = [], []
        for target, target_leaves in targets:
            records = []
            for optimizer in target_leaves:
                record = self.record(optimizer)
                if record.stage is Stage.STEPPED:
                    raise RuntimeError("step() has already been called since the last update().")
                records.append(record)
                if self.clipped is not None and self.clipped.adopts(record):
                    adopted.append(record)
            recorded.append((target, records))
        return recorded, adopted


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What [`Steps`][] found to step and the group agreed, for it to run.

    Attributes:
        targets: What to step (an optimizer, or a container), each with its leaves' records.
        verdict: The verdict of every record, combined.
    """

    targets: list[tuple[Any, list[OptimizerRecord]]]
    verdict: Verdict


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
        container = any(map(partial(hasattr, item), _CONTAINER_ATTRIBUTES))
        item_leaves: tuple[Any, ...] = tuple(_leaves_of(item)) if container else (item,)
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


class Steps:
    """A scaler's iterations, one after another: the book of the one under way, and every call
    that records in it, plans a step from it, or takes its outcome.

    Args:
        agreement: the checks and the one collective (`shardscale._check`).
        home: the scale state, and whether this rank holds one.
        config: the scaler's options; read here: `max_retries` (the closure's reruns) and
            `locate_overflow` (on overflow steps, find and log the non-finite gradients).
    """

    def __init__(self, agreement: Agreement, home: ScaleHome, config: ScalerConfig):
        self.agreement = agreement
        self.home = home
        self.book = IterationBook(step=home.host.counters.steps + 1)
        self.last: Verdict | None = None  # the last step()'s verdict
        self.last_overflow: list[NonFiniteGrad] | None = None  # None: none located yet
        # The loss's scale and non-finite bit a CUDA graph captured step() reading: scale()
        # outside the graph then writes each iteration's into these, in place, for its replays.
        self.captured: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self._max_retries = config.max_retries
        self._locate_overflow = config.locate_overflow
        self.known: dict[int, weakref.ref[torch.optim.Optimizer]] = {}
        """The leaf optimizers stepped so far, weakly: a clip's steps take its verdict without a
        collective of their own only for those (`shardscale._clip.ClipRecord.adopts`)."""

    def begin(self, step: int) -> None:
        """Start the iteration that takes step number `step`."""
        self.book = IterationBook(step=step)

    def restart(self, steps: int) -> None:
        """A state was loaded, counting `steps` steps: the next iteration takes the next step,
        and nothing of the run before is told (no last step, no last overflow)."""
        self.begin(steps + 1)
        self.last = None
        self.last_overflow = None

    # ------------------------------------------------------------------ the loss

    def note_loss(self, loss: torch.Tensor, fit: bool) -> torch.Tensor:
        """Record `loss`, which `scale()` multiplies by what this returns, the iteration's scale:
        whether it is finite, on the device (two kernels, a third for a loss of several
        elements, and from the second loss on: gradient accumulation counts every micro-batch),
        written into the bit a CUDA graph reads where one was captured; the loss itself (a
        reference), to locate a forward overflow; and (`fit`) which of its gradients form in
        fp16. No host synchronisation."""
        loss_scale = self.iteration_scale(loss.device)
        book = self.book
        book.carried |= loss.requires_grad
        # not a loss of placeholder tensors (a pipeline schedule's shape inference: see there)
        if "torch.distributed.pipelining" not in sys.modules or not in_pipeline_shape_inference():
            value = loss.detach()
            if isinstance(value, DTensor):  # a loss_parallel loss: this rank's part of it
                value = value.to_local()
            nonfinite = torch.isnan(value * 0)  # inf * 0 and NaN * 0 are NaN; a finite x: 0
            nonfinite = nonfinite.reshape(()) if nonfinite.numel() == 1 else nonfinite.any()
            if book.loss_nonfinite is not None:
                book.loss_nonfinite |= nonfinite
            else:
                into = None if self.captured is None else self.captured[1]
                book.loss_nonfinite = nonfinite if into is None else into.copy_(nonfinite)
            book.losses.append(value)
        if fit:  # which gradients form in fp16; each backward's, when accumulating
            self.agreement.readings.fp16.saw_loss(loss, book)
        return loss_scale

    def iteration_scale(self, device: torch.device) -> torch.Tensor:
        """The iteration's copy of the live scale, made at its first loss (on `device`)."""
        book = self.book
        if book.loss_scale is None:
            # A copy of the live scale, once per iteration: the iteration's gradients are
            # divided by it even where update() moves the live one before they are stepped
            # (the async scaler), and update() never modifies a tensor autograd saved.
            live = self.home.at(device, loss=True).scale
            captured = self.captured
            book.loss_scale = live.clone() if captured is None else captured[0].copy_(live)
        return book.loss_scale

    def loss_scale(self, funcname: str, source: object) -> torch.Tensor:
        """The scale this iteration's gradients carry: its copy, or the live scale where no loss
        was scaled on this rank; a rank that never called `scale()` gets the state now, where
        the gradients of `source` (an optimizer target, or a list of parameters, empty too) are.

        In a pipeline only the last stage computes a loss; the others never call `scale()`,
        yet hold the same scale (every rank does) and must check, step and update with the
        rest ([`ScaleHome.for_gradients()`][shardscale._state.ScaleHome.for_gradients]).
        Alone in its group, a rank without a scale raises torch's error instead: nobody else
        can have scaled its loss.
        """
        book = self.book
        if book.loss_scale is not None:
            if device_path().capturing(book.loss_scale.device):
                self.captured = (book.loss_scale, book.loss_nonfinite)  # the graph reads these
            return book.loss_scale
        if self.home.device is not None:
            return self.home.device.scale
        if self.agreement.exchange.world_size == 1:
            raise RuntimeError(no_scale_message(funcname))
        if isinstance(source, list) and all(isinstance(item, torch.Tensor) for item in source):
            params: Iterable[torch.Tensor] = source
        else:
            params = optimizer_params(leaves(source))
        return self.home.for_gradients(params).scale

    # ------------------------------------------------------------------ the step

    def take(
        self, optimizer: object, closure: Callable[[], Any] | None, args: Args, kwargs: Kwargs
    ) -> Any:
        """`scaler.step()` (see there) of an enabled scaler: what its optimizers' `step()`
        returned (None where skipped; a list for a list), or with a `closure` the loss of its
        last run. The closure's batch runs again at a backed-off scale where its gradients (not
        its loss) overflowed on any rank, up to `max_retries` times; then it steps or skips as
        agreed."""
        retries, loss = (0 if closure is None else self._max_retries), None
        for attempt in range(retries + 1):
            if closure is not None:  # this batch, from its start
                self.begin(self.book.step)
                with torch.enable_grad():
                    loss = closure()
            scale = self.loss_scale("step", optimizer)
            plan = self._plan(optimizer, scale)
            if attempt == retries or not plan.verdict.skipped():
                break  # stepped; or out of retries: skipped
            if plan.verdict.flags[Flag.FORWARD].item():
                break  # a forward overflow: no scale fixes it, skipped
            if not self.home.require("step").back_off_for_retry_(self.home.host.policy):
                break  # the scale cannot go lower: skipped
        results = self._run(plan, scale, args, kwargs)
        self.last = plan.verdict
        if closure is not None:
            return loss
        return results if isinstance(optimizer, (list, tuple)) else results[0]

    def _plan(self, target: object, scale: torch.Tensor) -> StepPlan:
        """Record `target`'s leaves for a `step()` and agree in the one collective: those not
        checked yet in one check (fused optimizers' gradients are only checked: they unscale
        inside their own kernel; the others' unscaled), with the checks `unscale_()` left
        waiting; those `unscale_()` or `clip_grad_norm_` did already keep their verdicts.

        Raises:
            RuntimeError: one of its optimizers was stepped already since the last update.
        """
        targets, adopted = self.book.begin_step(steppables(target))
        self._locate_if_overflowed(adopted)  # the clip's agreement knew no names
        records = list(chain.from_iterable(map(_LEAVES, targets)))
        unscale: list[OptimizerRecord] = []
        check: list[OptimizerRecord] = []
        for record in records:  # a fused one a clip unscaled in part is unscaled in full
            if record.stage is Stage.READY and record.verdict is None:
                only_check = record.takes_scale and record.clipped is None
                (check if only_check else unscale).append(record)
        if unscale or check or self.book.waiting():
            self.agree(scale, "step", unscale=unscale, check=check)
        return StepPlan(targets, cast(Verdict, combined(map(_VERDICT, records))))

    def _run(self, plan: StepPlan, scale: torch.Tensor, args: Args, kwargs: Kwargs) -> list[Any]:
        """Step each of `plan`'s targets, or skip it, as its verdict says: fused optimizers skip
        on the device, the others cost the one host read of the verdicts. Returns what each
        target's `step()` returned (None where skipped).

        Raises:
            RuntimeError: an optimizer none of whose parameters held a gradient on any rank when
                it was checked (torch's words), before any target steps, on every rank alike: a
                non-fused one, or one `unscale_()` checked (torch's fused path checks at the step
                itself, and steps nothing there).
        """
        verdicts = [cast(Verdict, combined(map(_VERDICT, records))) for _, records in plan.targets]
        for (_, records), verdict in zip(plan.targets, verdicts, strict=True):
            checked_before = any(r.stage is Stage.UNSCALED or not r.takes_scale for r in records)
            if verdict.has_grads is False and checked_before:
                world_size = self.agreement.exchange.world_size
                raise RuntimeError(no_inf_checks_message(world_size))
        results: list[Any] = []
        for (target, records), verdict in zip(plan.targets, verdicts, strict=True):
            if not all(map(_TAKES_SCALE, records)) and verdict.skipped():
                results.append(None)
            elif any(map(_TAKES_SCALE, records)):  # they take the scale and the agreed flag
                found_inf = verdict.flags[Flag.SKIP]
                results.append(_step_target(target, records, found_inf, scale, args, kwargs))
            else:
                results.append(target.step(*args, **kwargs))
            for record in records:
                self.stepped(record)
        return results

    def stepped(self, record: OptimizerRecord) -> None:
        """`record`'s optimizer was stepped (or skipped, as agreed): the last step's verdict is
        its, and it is known to later clips."""
        record.stage = Stage.STEPPED
        self.last = record.verdict if record.verdict is not None else self.last
        self.known.setdefault(id(record.optimizer), weakref.ref(record.optimizer))

    # ------------------------------------------------------------------ unscale_, clip, update

    def unscale(self, optimizer: object) -> list[torch.optim.Optimizer]:
        """`unscale_` of `optimizer`'s leaves: check and unscale, and agree at the next point
        that needs the decision, except on this scaler's first step: there a pipeline stage that
        never scaled must agree before it modifies anything, and every rank must then issue the
        same collectives, whichever stage it holds. It agrees at once too where the checks left
        waiting would fill a ballot (`MAX_CHECKS`): a loop's calls, alike on every rank.
        Returns the fused optimizers whose check waits (torch's step body may step them itself:
        `shardscale._compat.TorchBody`)."""
        scale = self.loss_scale("unscale_", optimizer)
        to_check, adopted = self.book.begin_unscale(steppables(optimizer))
        self._locate_if_overflowed(adopted)  # the clip's agreement knew no names
        if not to_check:
            return []
        if not self.agreement.agreed_once or len(self.book.waiting()) >= MAX_CHECKS - 1:
            self.agree(scale, "unscale_", unscale=to_check)
        else:
            check = self.book.new_check(to_check)
            self.agreement.check_for_later(self.book, scale, check, _params_of(to_check))
        for record in to_check:
            record.stage = Stage.UNSCALED
        return [r.optimizer for r in to_check if r.takes_scale and r.verdict is None]

    def outcome(self, scale: torch.Tensor) -> Verdict | None:
        """The iteration's verdict, for `update()`: `unscale_()` without a `step()` agrees now.
        Its optimizers' verdicts combined, of those whose gradients some rank held (torch
        counts no other), with what the agreements read; None where no such optimizer was
        checked."""
        book = self.book
        if book.waiting():
            self.agree(scale, "update")
        verdicts = [v for v in map(_VERDICT, book.records.values()) if v is not None]
        verdict = combined(v for v in verdicts if v.has_grads is not False)
        if verdict is None:
            return None
        if book.peaks:
            verdict.peak = book.peaks[0] if len(book.peaks) == 1 else torch.stack(book.peaks).amax()
        if book.counts:
            verdict.counts = (
                torch.stack(book.counts).sum(0) if len(book.counts) > 1 else book.counts[0]
            )
        if book.mismatches:
            verdict.mismatch = torch.stack(book.mismatches).amax()
        return verdict

    def agree(
        self,
        scale: torch.Tensor,
        caller: str,
        *,
        unscale: Sequence[OptimizerRecord] = (),
        check: Sequence[OptimizerRecord] = (),
    ) -> None:
        """Agree, in one collective, on a verdict for `unscale` and `check`'s gradients, as one
        check (`unscale`'s are unscaled, `check`'s only checked:
        `shardscale._check.Agreement.agree`), and on one for each check `unscale_` left
        waiting; every record takes its check's."""
        own = self.book.new_check([*unscale, *check]) if unscale or check else None
        groups = (_params_of(unscale), _params_of(check))
        waiting = self.book.waiting()
        self.agreement.agree(self.book, scale, caller, own, groups, waiting)
        for record in unscale:
            record.stage = Stage.UNSCALED
        self.settle()

    def settle(self) -> None:
        """Give each record whose check was agreed just now its verdict (with a partial clip's);
        locate the overflow where asked."""
        settled = []
        for record in self.book.records.values():
            check = record.check
            if record.verdict is None and check is not None and check.verdict is not None:
                clipped = record.clipped
                own = check.verdict
                record.verdict = own if clipped is None else combined((clipped.verdict, own))
                settled.append(record)
        self._locate_if_overflowed(settled)

    def record_overflow(self) -> None:
        """`scaler.record_overflow()`: the step just taken reads as skipped (see there).

        Raises:
            RuntimeError: no optimizer was stepped since the last update().
        """
        verdicts = [record.verdict for record in self.book.records.values()]
        if not any(verdict is not None for verdict in verdicts):
            raise RuntimeError("record_overflow() must follow step(), and no step() was taken.")
        for verdict in {id(v): v for v in verdicts if v is not None}.values():
            verdict.flags[Flag.SKIP] = 1.0
            verdict.read = True
            if verdict.block is not None:
                verdict.block.mark_skipped()
        self.last = combined(verdicts)

    # ------------------------------------------------------------------ where it overflowed

    def locate_now(self, book: IterationBook, with_losses: bool) -> list[NonFiniteGrad]:
        """Where the non-finite gradients of `book`'s optimizers are (and, `with_losses`, which
        ranks' losses were non-finite), gathered from every rank: call it on every rank."""
        optimizers, losses = map(_OPTIMIZER, book.records.values()), book.losses
        exchange = self.agreement.exchange
        return locate_optimizers(optimizers, exchange, book.step, losses if with_losses else [])

    def _locate_if_overflowed(self, records: list[OptimizerRecord]) -> None:
        """With `locate_overflow`: on an overflow step, find and log the non-finite gradients
        (and losses) of `records`, on every rank alike."""
        if not records or not self._locate_overflow:
            return
        verdict = cast(Verdict, combined(map(_VERDICT, records)))
        if not verdict.skipped():  # the same on every rank
            return
        forward = bool(verdict.flags[Flag.FORWARD].item())
        optimizers, losses = map(_OPTIMIZER, records), self.book.losses if forward else []
        step, exchange = self.book.step, self.agreement.exchange
        self.last_overflow = locate_optimizers(optimizers, exchange, step, losses)
        log_located(step, self.last_overflow, forward)


def move_together(
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


def _step_target(
    target: Any,
    records: list[OptimizerRecord],
    found_inf: torch.Tensor,
    scale: torch.Tensor,
    args: Args,
    kwargs: Kwargs,
) -> Any:
    """Step `target`, handing every fused optimizer in it the scale and the agreed flag.

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
        if not record.takes_scale:
            continue
        own = getattr(leaf, "grad_scale", None)
        grad_scale = (scale if own is None else scale * own) if record.stage is Stage.READY else own
        devices = set(map(_DEVICE, optimizer_params((leaf,))))
        if len(devices) == 1:
            device = devices.pop()
            key = (device, id(grad_scale))
            if key not in moved:
                moved[key] = move_together(grad_scale, found_inf, device)
            leaf.grad_scale, leaf.found_inf = moved[key]  # type: ignore[attr-defined]
        else:
            leaf.grad_scale, leaf.found_inf = grad_scale, found_inf  # type: ignore[attr-defined]
        handed.append(leaf)
    try:
        return target.step(*args, **kwargs)
    finally:
        for leaf in handed:
            del leaf.grad_scale, leaf.found_inf  # type: ignore[attr-defined]
