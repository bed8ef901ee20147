"""The work of one step: checks, the one agreement, the optimizer steps.

Invariant: every optimizer of an iteration steps or skips on every rank alike, after ONE
collective per `step()`/`clip_grad_norm_()` call however many optimizers, devices and dtypes
hold the gradients; `unscale_()` adds none after the first step (its local check waits for that
collective; on a scaler's first step it agrees at once).

The [`Stepper`][] does the work for a scaler, on the iteration's book
([`IterationBook`][shardscale._state.IterationBook]) it is handed; it carries what a rank learns
across iterations: its gradient walks, its kernels' constants, whether it has agreed before, and
where the last overflow was.

A step, as `Stepper` runs it: `agree_step` resolves what to step, checks (and unscales) the
local gradients in one fused pass per group (`_check_local`, shared with `unscale_`'s deferred
check), and agrees in the one collective (`_exchange`); it returns a [`StepPlan`][], which
`step` then runs: each target stepped, or skipped, as agreed.

A step may be one optimizer, a list of them, or a container (torchtitan's `OptimizersContainer`:
an `Optimizer` holding its parts in `optimizers`; Megatron's `ChainedOptimizer`:
`chained_optimizers`): every *leaf* optimizer underneath is checked in the one collective, fused
ones get the scale and the agreed flag, and each target's own `step()` is called once.
"""

from __future__ import annotations

import math
import operator
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import chain
from typing import Any, TypeAlias, cast

import torch

from shardscale._bins import NAN_MARK, Fp16Gradients, counted, counts_can_travel, power_above
from shardscale._check import Flags, Kernels, exact_norm_check
from shardscale._config import ScalerConfig
from shardscale._errors import ShardScaleWarning
from shardscale._exchange import Ballot, Exchange, Flag, Verdict, combined
from shardscale._grads import (
    GradGroups,
    GradWalk,
    NormGroups,
    move,
    move_together,
    warn_plain_replicas_assumed,
)
from shardscale._locate import NonFiniteGrad, locate_optimizers, log_located
from shardscale._state import (
    ClipRecord,
    IterationBook,
    OptimizerRecord,
    PendingCheck,
    Reading,
    ScaleHome,
    Stage,
    optimizer_params,
)

_METER_SKIPPED = (
    "step {step}: the underflow meter (underflow_every) could not read this step: its counts "
    "need a SUM, which an inf-norm clip_grad_norm_ (its shares need a MAX) or CUDA's "
    "deterministic mode (histc has no deterministic kernel) rules out. It reads the next of its "
    "steps that can be; until one has, stats.underflow is None, never a 0 that was not measured "
    "(said once)"
)

# What `unscale_`/`step` accept: an optimizer (or a container of several), or a list.
OptimizerTarget: TypeAlias = torch.optim.Optimizer | Sequence[torch.optim.Optimizer]

_CONTAINER_ATTRIBUTES = ("optimizers", "chained_optimizers")
_OPTIMIZER = operator.attrgetter("optimizer")
_TAKES_SCALE = operator.attrgetter("takes_scale")
_TO_CHECK = operator.methodcaller("params_to_check")
_VERDICT = operator.attrgetter("verdict")
_LEAVES = operator.itemgetter(1)
_DEVICE = operator.attrgetter("device")


@dataclass(frozen=True, slots=True)
class ClipRequest:
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


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What [`Stepper.agree_step`][] found and the group agreed, for [`Stepper.step`][] to run.

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
        self.last_overflow: list[NonFiniteGrad] | None = None  # None: none located yet
        self._locate_overflow = config.locate_overflow
        self._meter_every = config.underflow_every
        self._walk = GradWalk()
        self.fp16 = Fp16Gradients()  # which gradients the fit reads, per backward
        # Whether this scaler has been through an agreement: every rank passes its first at the
        # same collective, so "defer unscale_'s agreement" is decided alike everywhere.
        self._agreed_once = False
        self._warned = False  # that plain replicas were assumed on a stage without a loss
        self._warned_meter = False  # that a meter step could not be read

    def agree_step(self, book: IterationBook, target: object, scale: torch.Tensor) -> StepPlan:
        """Check `target`'s gradients and agree in the one collective, for a `step()` of it:
        fused optimizers' gradients are only checked (they unscale inside their own kernel),
        the others' unscaled; those `unscale_()` or `clip_grad_norm_` did already are not
        checked again, and `unscale_()`'s pending checks join the agreement.

        Raises:
            RuntimeError: one of its optimizers was stepped already since the last update.
        """
        targets, adopted = book.begin_step(steppables(target))
        if adopted and self._locate_overflow:  # the clip's agreement knew no names
            self._locate_if_overflowed(book, adopted)
        records = list(chain.from_iterable(map(_LEAVES, targets)))
        unscale: list[OptimizerRecord] = []
        check: list[OptimizerRecord] = []
        for record in records:  # a fused one a clip unscaled in part is unscaled in full
            if record.stage is Stage.READY and record.verdict is None:
                only_check = record.takes_scale and record.clipped is None
                (check if only_check else unscale).append(record)
        if unscale or check or book.pending.records:
            self.agree(book, scale, "step", unscale=unscale, check=check)
        return StepPlan(targets, cast(Verdict, combined(map(_VERDICT, records))))

    def step(
        self, plan: StepPlan, scale: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> list[Any]:
        """Step each of `plan`'s targets, or skip it, as agreed: fused optimizers skip on the
        device, the others cost the one host read of the verdict.

        Returns:
            What each target's `step()` returned (None where skipped).
        """
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

    def unscale(self, book: IterationBook, target: object, scale: torch.Tensor) -> None:
        """`unscale_` of `target`'s optimizers: check and unscale, and agree at the next point
        that needs the decision, except on this scaler's first step: there a pipeline stage that
        never scaled must agree before it modifies anything, and every rank must then issue the
        same collectives, whichever stage it holds."""
        to_check, adopted = book.begin_unscale(steppables(target))
        if adopted and self._locate_overflow:  # the clip's agreement knew no names
            self._locate_if_overflowed(book, adopted)
        if to_check and not self._agreed_once:
            self.agree(book, scale, "unscale_", unscale=to_check)
        elif to_check:
            with torch.no_grad():
                params = list(chain.from_iterable(map(_TO_CHECK, to_check)))
                groups, has_elements = self._walk.groups(params)
                # the meter's step: an inf-norm clip may still undo it
                counting = self._counting(book, scale.device, None)
                flags: Flags = {}
                inv = self.kernels.inverse(scale)
                checks: tuple[GradGroups, GradGroups] = (groups, {})
                reading = self._check_local(book, checks, params, inv, flags, counting)
            pending = book.pending
            pending.records.extend(to_check)
            pending.flags.extend(flags.values())
            pending.has_elements = pending.has_elements or has_elements
            pending.readings.append(reading)
            for record in to_check:
                record.stage, record.local_flags = Stage.UNSCALED, flags

    def agree(
        self,
        book: IterationBook,
        scale: torch.Tensor,
        caller: str,
        *,
        unscale: Sequence[OptimizerRecord] = (),
        check: Sequence[OptimizerRecord] = (),
    ) -> Verdict:
        """Check the records' gradients, and agree on ONE verdict for them and for the checks
        `unscale_` left pending.

        `unscale`'s gradients are divided by the scale in place (their stage becomes UNSCALED);
        `check`'s are only checked. On a rank that never called `scale()` (`caller` names the
        call for the error where no rank did) nothing is modified until the group has
        confirmed that some rank did.
        """
        device = scale.device
        with torch.no_grad():
            params = list(chain.from_iterable(map(_TO_CHECK, unscale)))
            to_unscale, has_elements = self._walk.groups(params)
            checked = list(chain.from_iterable(map(_TO_CHECK, check)))
            to_check, checked_has_elements = self._walk.groups(checked)
            counting = self._counting(book, device, None)
            has_scale = not self.home.unconfirmed
            # a partial clip's agreement counted its gradients' elements: ours include them
            clipped = any(record.clipped is not None for record in (*unscale, *check))
            has_elements = has_elements or checked_has_elements or clipped
            ballot = self._ballot(book, device, has_elements, has_scale, None, counting)
            inv = self.kernels.inverse(scale) if unscale else None
            flags = {ballot.skip.device: ballot.skip}
            unscaling = inv if has_scale else None  # unconfirmed: check now, unscale after
            checks, everything = (to_unscale, to_check), [*params, *checked]
            reading = self._check_local(book, checks, everything, unscaling, flags, counting)
            verdict = self._exchange(book, ballot, flags, reading, caller, None, [*unscale, *check])
            if not has_scale and inv is not None:  # the group confirmed a scale: unscale now
                self.kernels.multiply_(to_unscale, inv)
            for record in unscale:
                record.stage = Stage.UNSCALED
        return verdict

    def clip(
        self, book: IterationBook, scale: torch.Tensor | None, request: ClipRequest
    ) -> Verdict:
        """`clip_grad_norm_`: the norm share of the request's gradients travels with the flags
        (and the checks `unscale_` left pending) in ONE collective; then they are clipped (and
        unscaled, unless `unscale_` did) to the agreed global norm, and the book records what
        was clipped, for the steps. Without a `scale` (a disabled scaler) only the norm is
        agreed on."""
        kernels, norm_type = self.kernels, request.norm_type
        with torch.no_grad():
            norms, plain, has_elements = self._walk.norm_groups(request.params, request.replicas)
            # a disabled scaler has no scale: the gradients' device (the CPU without any)
            device = next(iter(norms), (torch.device("cpu"),))[0] if scale is None else scale.device
            if plain and scale is not None and not self.home.scaled_here and not self._warned:
                world_size = self.exchange.world_size
                self._warned = warn_plain_replicas_assumed(request.replicas, world_size)
            counting = scale is not None and self._counting(book, device, norm_type)
            has_scale = scale is None or not self.home.unconfirmed
            ballot = self._ballot(book, device, has_elements, has_scale, norm_type, counting, scale)
            unscaled = None if request.scaled else scale  # its gradients' peak is times the scale
            wanted = scale is not None and (counting or self.home.host.policy.fit)
            read = (book, (norms,), request.params, device)
            reading = self._read(*read, unscaled, counting) if wanted else None
            inv = kernels.inverse(scale) if request.scaled and scale is not None else None
            # The norms' check raises the ballot's own slot (no kernel of its own) where a
            # non-finite norm means a non-finite element; otherwise the elements are checked.
            exact = exact_norm_check(norms, norm_type)
            flags = {ballot.skip.device: ballot.skip}
            factor = kernels.one(device) if inv is None else inv
            kernels.local_norms_(
                norms, norm_type, factor, flags if exact else {}, cast(torch.Tensor, ballot.norm)
            )
            if inv is not None and not exact:
                kernels.check_(norms, None, flags)
            verdict = self._exchange(book, ballot, flags, reading, "clip_grad_norm_", norm_type, [])
            total = cast(torch.Tensor, verdict.total_norm)  # exchanged with the flags
            kernels.clip_(norms, request.max_norm, total, inv, verdict.flags[Flag.SKIP])
        if scale is not None and request.scaled:
            book.clipped = ClipRecord(frozenset(map(id, request.params)), verdict)
        return verdict

    def _check_local(
        self,
        book: IterationBook,
        groups: tuple[GradGroups, GradGroups],
        params: list[torch.Tensor],
        inv_scale: torch.Tensor | None,
        flags: Flags,
        counting: bool,
    ) -> Reading | None:
        """The local check, the same for an agreement and for `unscale_`'s deferred one: what
        the fit and the meter read of the still-scaled gradients (of `params`), where they want
        it; then one fused check per group of the first `groups`, which also multiplies by
        `inv_scale` (if given), and of the second, raising `flags`."""
        unscale, check = groups
        wanted = counting or self.home.host.policy.fit
        device = self.home.require("step").scale.device
        reading = self._read(book, groups, params, device, None, counting) if wanted else None
        self.kernels.check_(unscale, inv_scale, flags)
        if check:
            self.kernels.check_(check, None, flags)
        return reading

    def _read(
        self,
        book: IterationBook,
        groups: tuple[GradGroups | NormGroups, ...],
        params: list[torch.Tensor],
        device: torch.device,
        scale: torch.Tensor | None,
        counting: bool,
    ) -> Reading:
        """What the fit and the meter read of `groups`, the gradients of `params` (times
        `scale`, for gradients unscaled already): the largest |gradient| fp16 held where the fit
        wants it (of those formed in fp16: `shardscale._bins.Fp16Gradients`), the counts on the
        meter's steps (`shardscale._bins`)."""
        fit = self.home.host.policy.fit
        largest = self.fp16.read(groups, params, device, scale, book) if fit else None
        return largest, counted(groups, device, scale) if counting else None

    def _counting(self, book: IterationBook, device: torch.device, norm_type: float | None) -> bool:
        """Whether this step is one of the meter's: every `underflow_every` steps (0: never),
        where its counts can be made and travel (`shardscale._bins`)."""
        every = self._meter_every
        # `not step % every`: a Python bool even where torch.compile traces the step as a symbol
        if not every or book.step % every:
            return False
        if counts_can_travel(device, norm_type):
            return True
        if not self._warned_meter:  # a meter step it cannot read: say so, once
            self._warned_meter = True
            warnings.warn(_METER_SKIPPED.format(step=book.step), ShardScaleWarning, stacklevel=4)
        return False

    def _ballot(
        self,
        book: IterationBook,
        device: torch.device,
        has_elements: bool,
        has_scale: bool,
        norm_type: float | None,
        counting: bool,
        scale: object = True,
    ) -> Ballot:
        """This rank's ballot: it holds gradient elements where `unscale_`'s pending checks did
        too; with the norm's share where `norm_type` travels, the fit's peaks (a slot per rank
        under a SUM) where a `scale` is, the meter's counts on its steps."""
        summed = counting or (norm_type is not None and not math.isinf(norm_type))
        fit = scale is not None and self.home.host.policy.fit
        return self.exchange.ballot(
            device,
            has_elements=has_elements or book.pending.has_elements,
            has_scale=has_scale,
            loss_nonfinite=book.loss_nonfinite,
            with_norm=norm_type is not None,
            peaks=(self.exchange.world_size if summed else 1) if fit else 0,
            counted=counting,
        )

    def _exchange(
        self,
        book: IterationBook,
        ballot: Ballot,
        flags: Flags,
        reading: Reading | None,
        caller: str,
        norm_type: float | None,
        records: list[OptimizerRecord],
    ) -> Verdict:
        """The one collective on `ballot`, with this rank's `flags` on other devices than the
        ballot's and those of `unscale_`'s pending checks, and what the fit and the meter read
        (this check's `reading` and the pending ones'). Then the scale is confirmed where the
        ballot had none, and the verdict goes to `records` and the pending ones, whose overflow
        is located where asked."""
        pending, book.pending = book.pending, PendingCheck()
        if ballot.peaks is not None or ballot.bins is not None:
            _fill_readings(ballot, [reading, *pending.readings])
        others = pending.flags  # and this rank's flags on other devices than the ballot's
        for device, flag in flags.items():
            if device != ballot.skip.device:
                others.append(flag)
        verdict = self.exchange.agree(
            ballot, others, step=book.step, caller=caller, norm_type=norm_type
        )
        if ballot.peaks is not None:  # now the group's: the largest slot's, the only one of a MAX
            largest = ballot.peaks[0] if len(ballot.peaks) == 1 else ballot.peaks.amax()
            verdict.peak = move(power_above(largest), ballot.device)
            verdict.nan = move(largest == NAN_MARK, ballot.device)
        if ballot.bins is not None:
            verdict.counts = move(ballot.bins, ballot.device)
        if not ballot.has_scale:  # the group confirmed that some rank scaled
            self.home.confirm()
        self._agreed_once = True
        records = [*records, *pending.records]
        for record in records:  # a partial clip's flag counts too
            clipped = record.clipped
            record.verdict = verdict if clipped is None else combined((clipped.verdict, verdict))
        if self._locate_overflow:
            self._locate_if_overflowed(book, records)
        return verdict

    def locate_now(self, book: IterationBook, with_losses: bool) -> list[NonFiniteGrad]:
        """Where the non-finite gradients of `book`'s optimizers are (and, `with_losses`, which
        ranks' losses were non-finite), gathered from every rank: call it on every rank."""
        optimizers, losses = map(_OPTIMIZER, book.records.values()), book.losses
        return locate_optimizers(
            optimizers, self.exchange, book.step, losses if with_losses else []
        )

    def _locate_if_overflowed(self, book: IterationBook, records: list[OptimizerRecord]) -> None:
        """With `locate_overflow`: on an overflow step, find and log the non-finite gradients
        (and losses) of `records`, on every rank alike."""
        if not records:
            return
        verdict = cast(Verdict, records[0].verdict)
        if not verdict.skipped():  # the same on every rank
            return
        forward = bool(verdict.flags[Flag.FORWARD].item())
        optimizers, losses = map(_OPTIMIZER, records), book.losses if forward else []
        self.last_overflow = locate_optimizers(optimizers, self.exchange, book.step, losses)
        log_located(book.step, self.last_overflow, forward)


def _fill_readings(ballot: Ballot, readings: list[Reading | None]) -> None:
    """Write this rank's readings into the ballot: the largest peak into its peak slot, the
    counts added up into the bins (those a ballot without bins has no place for are dropped:
    an inf-norm clip's, where the meter waits for the next of its steps)."""
    peaks = [r[0] for r in readings if r is not None and r[0] is not None]
    slot = ballot.peak_slot
    if slot is not None and peaks:  # a NaN travels as NAN_MARK: it survives a MAX
        largest = (
            peaks[0]
            if len(peaks) == 1
            else torch.stack([move(p, slot.device) for p in peaks]).amax()
        )
        torch.nan_to_num(move(largest, slot.device), nan=NAN_MARK, posinf=math.inf, out=slot)
    counts = [r[1] for r in readings if r is not None and r[1] is not None]
    if ballot.bins is not None and counts:
        torch.sum(torch.stack([move(c, ballot.bins.device) for c in counts]), 0, out=ballot.bins)


def _step_target(
    target: Any,
    records: list[OptimizerRecord],
    found_inf: torch.Tensor,
    scale: torch.Tensor,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
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
