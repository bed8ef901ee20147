"""A step's bookkeeping: the iteration's book, what each call records in it, and each step's
plan and run. One room for it: the scaler hands its optimizers here, and they go no further
than the parameters whose gradients `shardscale._check` checks and agrees on.

Invariant: every optimizer of an iteration steps or skips on every rank alike, after ONE
collective per `step()`/`clip_grad_norm_()` call however many optimizers, devices and dtypes
hold the gradients; `unscale_()` adds none after the first step (its local check waits for that
collective; on a scaler's first step it agrees at once).

An iteration runs from one `update()` to the next: scale, backward, then per optimizer at most
one `unscale_` (before its `step`) and one `step`, and at most one `clip_grad_norm_`. Its
[`IterationBook`][] enforces those rules, raising torch's own errors in torch's words (users'
`match=` strings keep working), and remembers what `clip_grad_norm_` already unscaled and agreed,
which local checks of `unscale_` still wait for the agreement, and whether every loss `scale()`
saw was finite.

A step, as [`Steps`][] runs it: resolve what to step (`steppables`), record its leaves in the
book (`IterationBook.begin_step`), hand the gradients still to check to the agreement, record
its verdict, then step each target, or skip it, as agreed ([`StepPlan`][]).

A step may be one optimizer, a list of them, or a container (torchtitan's `OptimizersContainer`:
an `Optimizer` holding its parts in `optimizers`; Megatron's `ChainedOptimizer`:
`chained_optimizers`): every *leaf* optimizer underneath is checked in the one collective, fused
ones get the scale and the agreed flag, and each target's own `step()` is called once.
"""

from __future__ import annotations

import inspect
import operator
import sys
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum
from functools import partial
from itertools import chain
from typing import Any, TypeAlias, cast

import torch
from torch.distributed.tensor import DTensor

from shardscale._check import Agreement, ClipRequest, PendingCheck
from shardscale._config import ScalerConfig
from shardscale._errors import GRAD_SCALER_WARNING, no_scale_message
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


@dataclass(frozen=True, slots=True)
class ClipRecord:
    """What `clip_grad_norm_` unscaled and agreed on in this iteration, for steps to take."""

    param_ids: frozenset[int]
    verdict: Verdict


def optimizer_params(optimizers: Iterable[torch.optim.Optimizer]) -> Iterator[torch.Tensor]:
    """Every parameter of every param group of each of `optimizers`, in order."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            yield from group["params"]


@dataclass(slots=True)
class OptimizerRecord:
    """Where one optimizer is in the iteration, and what the group agreed for it.

    Attributes:
        takes_scale: Whether its `step()` reads `grad_scale`/`found_inf` itself (fused, and
            capturable with amp support): it unscales and skips on the device, with no host
            synchronisation; its gradients are only checked.
        local_flags: What `unscale_()` found on this rank alone, by device, while the group has
            not agreed yet (torch's private reads answer it then: `shardscale._compat`).
        clipped: The `clip_grad_norm_` that unscaled some, but not all, of its parameters (an
            MoE model's dense part, say): those keep the clip's unscale and flag, the others
            are checked and unscaled at its own agreement, and its verdict is both.
    """

    optimizer: torch.optim.Optimizer
    takes_scale: bool
    stage: Stage = Stage.READY
    verdict: Verdict | None = None
    local_flags: dict[torch.device, torch.Tensor] | None = None
    clipped: ClipRecord | None = None

    def waiting_flags(self) -> dict[torch.device, torch.Tensor] | None:
        """What `unscale_()` found here while the agreement on it is still to come (None: not
        checked by `unscale_()`, or agreed)."""
        return self.local_flags if self.verdict is None else None

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
        pending: The local checks of `unscale_()` that await the agreement (their optimizers'
            records, which take its verdict: [`waiting()`][waiting]).
        loss_nonfinite: bool scalar: some loss `scale()` multiplied in this iteration was inf or NaN
            (None: none was scaled on this rank).
        losses: The losses themselves (detached), to locate a forward overflow.
        fit_readings: Each backward's largest |scaled gradient| formed in fp16, where the
            iteration accumulates micro-batches (`shardscale._bins.Fp16Gradients`).
        carried: A backward may carry `loss_scale`: a loss that requires grad was scaled, or
            the tensor itself was handed out (`loss_scale_tensor()`).
    """

    step: int
    loss_scale: torch.Tensor | None = None
    records: dict[int, OptimizerRecord] = field(default_factory=dict)
    clipped: ClipRecord | None = None
    pending: PendingCheck = field(default_factory=PendingCheck)
    loss_nonfinite: torch.Tensor | None = None
    losses: list[torch.Tensor] = field(default_factory=list)
    fit_readings: list[torch.Tensor] = field(default_factory=list)
    carried: bool = False

    def midway(self) -> bool:
        """Whether the iteration is under way: a backward may carry its scale, or an optimizer
        was unscaled, clipped or stepped."""
        return self.carried or bool(self.records) or self.clipped is not None

    def waiting(self) -> list[OptimizerRecord]:
        """The records whose `unscale_()` checks wait in `pending` for the agreement."""
        return [record for record in self.records.values() if record.waiting_flags() is not None]

    def record(self, optimizer: torch.optim.Optimizer) -> OptimizerRecord:
        """`optimizer`'s record in this iteration, made at its first call."""
        record = self.records.get(id(optimizer))
        if record is None:
            takes_scale = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
            record = self.records[id(optimizer)] = OptimizerRecord(optimizer, takes_scale)
        return record

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
                if self.clipped is not None and self._adopt_clip(record, self.clipped):
                    adopted.append(record)
            recorded.append((target, records))
        return recorded, adopted

    def begin_clip(self, params: list[torch.Tensor]) -> bool:
        """Whether `clip_grad_norm_`'s gradients still carry the scale (False: `unscale_()`
        divided it out of every one of them: they are clipped as they are).

        Raises:
            RuntimeError: the clip was called already since the last update, or after some,
                but not all, of its parameters were unscaled.
        """
        if self.clipped is not None:
            raise RuntimeError("clip_grad_norm_() has already been called since the last update().")
        ids = frozenset(map(id, params))
        done: set[int] = set()  # the parameters unscaled already
        for record in self.records.values():
            if record.stage is not Stage.READY:
                done.update(map(id, optimizer_params((record.optimizer,))))
        if ids & done and not ids <= done:
            raise RuntimeError(
                "clip_grad_norm_() got parameters of which some, but not all, were already "
                "unscaled by unscale_(): clip each optimizer's parameters after its unscale_(), "
                "or all of them before any unscale_()"
            )
        return not (done and ids <= done)

    def _adopt_clip(self, record: OptimizerRecord, clipped: ClipRecord) -> bool:
        """Take `clip_grad_norm_`'s unscale and flag for `record` if the clip covered every
        parameter of its optimizer (the usual case: 0.3 us a parameter). A clip over some of
        them leaves it to be checked at its agreement, less what the clip unscaled.

        Decided by the parameters alone, never by which of them hold a gradient on this rank
        (an MoE expert no token reached holds none on one rank and one on another): every rank
        takes the same branch and issues the same collectives.
        """
        if record.stage is not Stage.READY or record.clipped is not None:
            return False
        param_ids = set(map(id, optimizer_params((record.optimizer,))))
        if not clipped.param_ids.issuperset(param_ids):
            if not clipped.param_ids.isdisjoint(param_ids):
                record.clipped = clipped
            return False
        record.verdict = clipped.verdict
        record.stage = Stage.UNSCALED
        return True


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


def passes_itself(optimizer: object) -> bool:
    """Whether torch's scalers would call `optimizer.step(grad_scaler=scaler)`: it declares
    `_step_supports_amp_scaling` and its `step()` has a `grad_scaler` parameter (inspected on
    every step, as torch does, but only for optimizers that declare the first)."""
    step = getattr(optimizer, "step", None)
    if not getattr(optimizer, "_step_supports_amp_scaling", False) or step is None:
        return False
    try:
        return "grad_scaler" in inspect.signature(step).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False


class Steps:
    """A scaler's iterations, one after another: the book of the one under way, and every call
    that records in it, plans a step from it, or takes its outcome.

    Args:
        scaler: the scaler whose steps these are.
        agreement: the checks and the one collective (`shardscale._check`).
        home: the scale state, and whether this rank holds one.
        config: the scaler's options; read here: `max_retries` (the closure's reruns) and
            `locate_overflow` (on overflow steps, find and log the non-finite gradients).
    """

    def __init__(self, scaler: Any, agreement: Agreement, home: ScaleHome, config: ScalerConfig):
        # What torch's deprecated protocol hands the optimizer. Weakly: the scaler owns its
        # steps, and a cycle would keep a dropped scaler (and the fit's hooks) alive until a gc.
        self._scaler = weakref.ref(scaler)
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

    def begin(self, step: int) -> None:
        """Start the iteration that takes step number `step`."""
        self.book = IterationBook(step=step)

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
            self.agreement.fp16.saw_loss(loss, book)
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
        the gradients of `source` (an optimizer target, or a list of parameters) are.

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
        if isinstance(source, list) and source and isinstance(source[0], torch.Tensor):
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
        if passes_itself(optimizer):
            if closure is not None:
                raise RuntimeError(
                    f"step(closure=...) cannot retry {type(optimizer).__name__}: its step() "
                    "takes grad_scaler= (torch's deprecated protocol) and reads the scale "
                    "itself; run the closure, then step(optimizer)"
                )
            return self._passing_itself(optimizer, args, kwargs)
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

    def _passing_itself(self, optimizer: Any, args: Args, kwargs: Kwargs) -> Any:
        """torch's deprecated protocol: call `optimizer.step(grad_scaler=scaler)`, warning.

        The optimizer unscales and skips itself; what it reads back is the agreed state.
        """
        self.loss_scale("step", optimizer)
        records = [self.book.record(leaf) for leaf in leaves(optimizer)]
        warnings.warn(GRAD_SCALER_WARNING, FutureWarning, stacklevel=4)
        result = optimizer.step(*args, **{**kwargs, "grad_scaler": self._scaler()})
        self.last = combined(map(_VERDICT, records))
        for record in records:
            record.stage = Stage.STEPPED
        return result

    def _plan(self, target: object, scale: torch.Tensor) -> StepPlan:
        """Record `target`'s leaves for a `step()` and agree in the one collective: fused
        optimizers' gradients are only checked (they unscale inside their own kernel), the
        others' unscaled; those `unscale_()` or `clip_grad_norm_` did already are not checked
        again, and `unscale_()`'s pending checks join the agreement.

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
        """Step each of `plan`'s targets, or skip it, as agreed: fused optimizers skip on the
        device, the others cost the one host read of the verdict. Returns what each target's
        `step()` returned (None where skipped)."""
        results: list[Any] = []
        for target, records in plan.targets:
            verdict = cast(Verdict, combined(map(_VERDICT, records)))
            if not all(map(_TAKES_SCALE, records)) and verdict.skipped():
                results.append(None)
            elif any(map(_TAKES_SCALE, records)):  # they take the scale and the agreed flag
                found_inf = verdict.flags[Flag.SKIP]
                results.append(_step_target(target, records, found_inf, scale, args, kwargs))
            else:
                results.append(target.step(*args, **kwargs))
            for record in records:
                record.stage = Stage.STEPPED
        return results

    # ------------------------------------------------------------------ unscale_, clip, update

    def unscale(self, optimizer: object) -> None:
        """`unscale_` of `optimizer`'s leaves: check and unscale, and agree at the next point
        that needs the decision, except on this scaler's first step: there a pipeline stage that
        never scaled must agree before it modifies anything, and every rank must then issue the
        same collectives, whichever stage it holds."""
        scale = self.loss_scale("unscale_", optimizer)
        to_check, adopted = self.book.begin_unscale(steppables(optimizer))
        self._locate_if_overflowed(adopted)  # the clip's agreement knew no names
        if to_check and not self.agreement.agreed_once:
            self.agree(scale, "unscale_", unscale=to_check)
        elif to_check:
            flags = self.agreement.check_for_later(self.book, scale, _params_of(to_check))
            for record in to_check:
                record.stage, record.local_flags = Stage.UNSCALED, flags

    def clip(
        self, params: list[torch.Tensor], max_norm: float, norm_type: float, replicas: int
    ) -> torch.Tensor:
        """`clip_grad_norm_` of `params` (see there): the total norm, agreed in one collective;
        the book records what the clip unscaled and agreed, for the steps to take."""
        # False: unscale_() ran for these already, and they are clipped as they are
        scaled = self.book.begin_clip(params)
        request = ClipRequest(params, max_norm, norm_type, replicas, scaled)
        scale = self.loss_scale("clip_grad_norm_", params)
        verdict = self.agreement.clip(self.book, scale, request)
        if scaled:
            self.book.clipped = ClipRecord(frozenset(map(id, params)), verdict)
        self._settle(verdict, [])
        return cast(torch.Tensor, verdict.total_norm)

    def outcome(self, scale: torch.Tensor) -> Verdict | None:
        """The iteration's verdict, for `update()`: `unscale_()` without a `step()` agrees now.
        None where no optimizer was checked."""
        if self.book.waiting():
            self.agree(scale, "update")
        return combined(map(_VERDICT, self.book.records.values()))

    def agree(
        self,
        scale: torch.Tensor,
        caller: str,
        *,
        unscale: Sequence[OptimizerRecord] = (),
        check: Sequence[OptimizerRecord] = (),
    ) -> Verdict:
        """Agree on ONE verdict for the records' gradients (`unscale`'s are unscaled, `check`'s
        only checked: `shardscale._check.Agreement.agree`) and the checks `unscale_` left
        waiting; every one of those records takes it."""
        clipped = any(record.clipped is not None for record in (*unscale, *check))
        to_unscale, to_check = _params_of(unscale), _params_of(check)
        verdict = self.agreement.agree(self.book, scale, caller, to_unscale, to_check, clipped)
        for record in unscale:
            record.stage = Stage.UNSCALED
        self._settle(verdict, [*unscale, *check])
        return verdict

    def _settle(self, verdict: Verdict, records: list[OptimizerRecord]) -> None:
        """Give the agreed `verdict` to `records` and to those whose checks waited for it (a
        partial clip's flag counts too); locate the overflow where asked."""
        records = [*records, *self.book.waiting()]
        for record in records:
            clipped = record.clipped
            record.verdict = verdict if clipped is None else combined((clipped.verdict, verdict))
        self._locate_if_overflowed(records)

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
        verdict = cast(Verdict, records[0].verdict)
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
