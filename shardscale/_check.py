"""The check and the agreement: this rank's gradients checked (and unscaled) in one fused pass
per (device, dtype), and ONE collective that agrees on them with every rank.

Invariant: every rank of the group sees the same flags before `optimizer.step()`, after one
collective per agreement, however many optimizers, devices and dtypes hold the gradients; a
local check that `unscale_()` makes waits in the iteration's [`PendingCheck`][] for the next
agreement, whose collective it joins.

It works on gradients (the parameters' `.grad`, grouped by `shardscale._grads`, whose
[`Kernels`][shardscale._grads.Kernels] check, unscale, take the norms and clip), never on
optimizers: which optimizers a step covers, and what each went through in the iteration, is
the bookkeeping of `shardscale._stepping`, which hands the parameters here and records the
verdict it gets back. The [`Agreement`][] carries what a rank learns across iterations: its
gradient walks, its kernels' constants, its ballots' templates, which gradients the fit reads,
and whether it has agreed before.

Each rank writes what it saw into ONE small float32 tensor, its *ballot*, on the group's
communication device, and the group runs ONE `all_reduce` on it, however many devices, dtypes
and optimizers hold the gradients:

```text
[has gradient elements, skip, forward overflow, has a scale, norm share, peaks, bins]
```

* has gradient elements: 0 for an empty shard, or a rank that ran no backward;
* skip: 1 if an inf or NaN is in this rank's gradients;
* forward overflow: 1 if, besides, a loss this rank scaled in the iteration was inf or NaN (no
  scale can help that: the step is skipped with the scale held). A non-finite loss that left
  every gradient finite (one never backpropagated, or `loss + inf`) is no overflow;
* has a scale: 0 for a rank that never called `scale()` (a pipeline stage before the last),
  until the group has confirmed that some rank does;
* norm share: this rank's part of a global gradient norm (`clip_grad_norm_` only);
* peaks and bins: what the fit and the underflow meter read of the gradients' range (one slot for
  the fit's largest gradient, one per rank under a SUM; 128 for the meter's counts:
  `shardscale._bins` makes and reads them; the ballot only carries them).

The reduction is MAX, or SUM when a finite p-norm or counted bins travel (shares and counts add
up; the flags then count and are clamped to 1). An inf-norm's shares need MAX: the meter waits
for a step without one. Either way the agreed flags are exactly 0.0 or 1.0: torch's fused
optimizers skip only when `found_inf == 1.0`, so a summed flag of 2.0 (two ranks overflowed)
would make them step with inf gradients.

Only a rank that lacks something reads the result on the host (one synchronisation): a rank
without gradient elements asks whether anybody had some (nobody: an error on every rank
together), a rank that never scaled asks whether anybody did. Ranks that hold gradients and a
scale never wait for the host here. The collective itself (bounded, its failures named) is
`shardscale._exchange`'s; without a process group, or at world size 1, none is issued.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Protocol, cast

import torch
import torch.distributed as dist

from shardscale._bins import BINS, Fp16Gradients, counted, counts_can_travel, power_above
from shardscale._config import ScalerConfig
from shardscale._errors import ShardScaleWarning, no_scale_message
from shardscale._exchange import Exchange
from shardscale._grads import (
    Flags,
    GradGroups,
    GradWalk,
    Kernels,
    NormGroups,
    exact_norm_check,
    move,
    warn_plain_replicas_assumed,
)
from shardscale._state import Flag, ScaleHome, Verdict

_NO_GRADS = (
    "No inf checks were recorded for this optimizer: none of its parameters has a gradient "
    "on any of the {world_size} rank(s). Call scaler.scale(loss).backward() before step()."
)

# The ballot's slots, in the order they travel (see the module); the agreed flags are a
# `Verdict`'s, by `Flag`: its skip and forward-overflow slots.
Slot = IntEnum("Slot", "HAS_ELEMENTS SKIP FORWARD SCALED NORM", start=0)


@dataclass(frozen=True, slots=True)
class Ballot:
    """What this rank puts into the collective (see the module).

    Attributes:
        device: The scale's device, where the verdict is returned (the tensor is on the group's
            communication device for it).
        has_elements: What the has-elements slot says, known on the host (a rank without
            gradient elements reads the result).
        has_scale: What the has-a-scale slot says (False: a rank that never scaled; it reads the
            result, and modifies nothing before).
        skip: The skip slot (a view): the local check raises it for gradients on the ballot's
            device, so their flag costs no kernel of its own.
        norm: The norm slot (a view), where this rank's share of the gradient norm goes; None
            without one.
        loss_checked: Whether a loss's finiteness went into the forward-overflow slot.
        peaks: The fit's slots (a view, `shardscale._bins`): this rank writes its largest
            |scaled gradient| into `peak_slot`, its own (the only one under a MAX); None without
            the fit. After the collective their largest is the group's.
        peak_slot: This rank's slot among `peaks`.
        bins: The meter's counts (a view); None off its steps. They travel in a SUM.
    """

    tensor: torch.Tensor
    device: torch.device
    has_elements: bool
    has_scale: bool
    skip: torch.Tensor
    norm: torch.Tensor | None = None
    loss_checked: bool = False
    peaks: torch.Tensor | None = None
    peak_slot: torch.Tensor | None = None
    bins: torch.Tensor | None = None


def check_clip_args(max_norm: float, norm_type: float) -> tuple[float, float]:
    """Validate `max_norm` (finite, > 0) and `norm_type` (> 0, or inf)."""
    for name, value in (("max_norm", max_norm), ("norm_type", norm_type)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a number, got {type(value).__name__}: {value!r}")
    if not (math.isfinite(max_norm) and max_norm > 0):
        raise ValueError(f"max_norm must be a finite number > 0, got {max_norm}")
    if not (norm_type > 0 and not math.isnan(norm_type)):
        raise ValueError(f"norm_type must be > 0 (or math.inf), got {norm_type}")
    return float(max_norm), float(norm_type)


_METER_SKIPPED = (
    "step {step}: the underflow meter (underflow_every) could not read this step: its counts "
    "need a SUM, which an inf-norm clip_grad_norm_ (its shares need a MAX) or CUDA's "
    "deterministic mode (histc has no deterministic kernel) rules out. It reads the next of its "
    "steps that can be; until one has, stats.underflow is None, never a 0 that was not measured "
    "(said once)"
)

# What the fit and the meter read of a local check's gradients: the largest |scaled gradient|
# (the fit's; None without it), and the counts by power of two (the meter's steps; else None).
Reading = tuple[torch.Tensor | None, torch.Tensor | None]


@dataclass(slots=True)
class PendingCheck:
    """Gradients `unscale_()` checked and unscaled locally, whose flags await the agreement
    (the next `step`, `clip_grad_norm_` or `update`), so `unscale_` + clip + step still cost
    one collective.

    Attributes:
        readings: What the fit and the meter read of their gradients, before the unscale.
    """

    flags: list[torch.Tensor] = field(default_factory=list)
    has_elements: bool = False
    readings: list[Reading | None] = field(default_factory=list)


class Iteration(Protocol):
    """What an agreement reads of the iteration under way
    ([`IterationBook`][shardscale._stepping.IterationBook])."""

    step: int
    loss_nonfinite: torch.Tensor | None
    losses: list[torch.Tensor]
    fit_readings: list[torch.Tensor]
    pending: PendingCheck


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


class Agreement:
    """Checks, unscales and clips this rank's gradients, and agrees with every rank.

    Args:
        exchange: the process group and its collectives.
        home: the scale state, and whether this rank scaled or holds an unconfirmed scale.
        config: the scaler's options; read here: `underflow_every` (the meter's steps).
    """

    def __init__(self, exchange: Exchange, home: ScaleHome, config: ScalerConfig) -> None:
        self.exchange = exchange
        self.home = home
        self.kernels = Kernels()
        self.fp16 = Fp16Gradients()  # which gradients the fit reads, per backward
        self._meter_every = config.underflow_every
        self._walk = GradWalk()
        # the ballots' two rows (module docstring), made once per shape and device
        self._templates: dict[tuple[torch.device, bool, bool, bool, int, bool], torch.Tensor] = {}
        self.agreed_once = False
        """Whether this scaler has been through an agreement: every rank passes its first at
        the same collective, so "defer unscale_'s agreement" is decided alike everywhere."""
        self._warned = False  # that plain replicas were assumed on a stage without a loss
        self._warned_meter = False  # that a meter step could not be read

    def agree(
        self,
        book: Iteration,
        scale: torch.Tensor,
        caller: str,
        unscale: list[torch.Tensor],
        check: list[torch.Tensor],
        clipped: bool = False,
    ) -> Verdict:
        """Check the gradients of `unscale` and `check` (parameters), and agree on ONE verdict
        for them and for the checks `unscale_` left pending.

        `unscale`'s gradients are divided by the scale in place; `check`'s are only checked
        (`clipped`: some of them had a partial clip's agreement, which counted their
        elements). On a rank that never called `scale()` (`caller` names the call for the
        error where no rank did) nothing is modified until the group has confirmed that some
        rank did.
        """
        device = scale.device
        with torch.no_grad():
            to_unscale, has_elements = self._walk.groups(unscale)
            to_check, checked_has_elements = self._walk.groups(check)
            counting = self._counting(book, device, None)
            has_scale = not self.home.unconfirmed
            has_elements = has_elements or checked_has_elements or clipped
            ballot = self._ballot(book, device, has_elements, has_scale, None, counting)
            inv = self.kernels.inverse(scale) if unscale else None
            flags = {ballot.skip.device: ballot.skip}
            unscaling = inv if has_scale else None  # unconfirmed: check now, unscale after
            checks, everything = (to_unscale, to_check), [*unscale, *check]
            reading = self._check_local(book, checks, everything, unscaling, flags, counting)
            verdict = self._vote(book, ballot, flags, reading, caller, None)
            if not has_scale and inv is not None:  # the group confirmed a scale: unscale now
                self.kernels.multiply_(to_unscale, inv)
        return verdict

    def check_for_later(
        self, book: Iteration, scale: torch.Tensor, params: list[torch.Tensor]
    ) -> Flags:
        """`unscale_`'s local check of `params`' gradients, unscaling them: its flags and
        readings wait in `book.pending` for the next agreement. Returns this rank's flags."""
        with torch.no_grad():
            groups, has_elements = self._walk.groups(params)
            # the meter's step: an inf-norm clip may still undo it
            counting = self._counting(book, scale.device, None)
            flags: Flags = {}
            inv = self.kernels.inverse(scale)
            checks: tuple[GradGroups, GradGroups] = (groups, {})
            reading = self._check_local(book, checks, params, inv, flags, counting)
        pending = book.pending
        pending.flags.extend(flags.values())
        pending.has_elements = pending.has_elements or has_elements
        pending.readings.append(reading)
        return flags

    def clip(self, book: Iteration, scale: torch.Tensor | None, request: ClipRequest) -> Verdict:
        """`clip_grad_norm_`: the norm share of the request's gradients travels with the flags
        (and the checks `unscale_` left pending) in ONE collective; then they are clipped (and
        unscaled, unless `unscale_` did) to the agreed global norm. Without a `scale` (a
        disabled scaler) only the norm is agreed on."""
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
            verdict = self._vote(book, ballot, flags, reading, "clip_grad_norm_", norm_type)
            total = cast(torch.Tensor, verdict.total_norm)  # exchanged with the flags
            kernels.clip_(norms, request.max_norm, total, inv, verdict.flags[Flag.SKIP])
        return verdict

    def _check_local(
        self,
        book: Iteration,
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
        book: Iteration,
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

    def _counting(self, book: Iteration, device: torch.device, norm_type: float | None) -> bool:
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
            warnings.warn(_METER_SKIPPED.format(step=book.step), ShardScaleWarning, stacklevel=5)
        return False

    def _ballot(
        self,
        book: Iteration,
        device: torch.device,
        has_elements: bool,
        has_scale: bool,
        norm_type: float | None,
        counting: bool,
        scale: object = True,
    ) -> Ballot:
        """This rank's fresh ballot, on the communication device for `device`, in one kernel: it
        holds gradient elements where `unscale_`'s pending checks did too; with the norm's share
        where `norm_type` travels, the fit's peaks (a slot per rank under a SUM) where a `scale`
        is, the meter's counts on its steps. Its forward-overflow slot starts at 1 where some
        loss of the iteration was inf or NaN, else at 0; the local check raises the skip slot
        itself ([`Ballot.skip`][Ballot.skip])."""
        summed = counting or (norm_type is not None and not math.isinf(norm_type))
        fit = scale is not None and self.home.host.policy.fit
        peaks = (self.exchange.world_size if summed else 1) if fit else 0
        with_norm, loss_nonfinite = norm_type is not None, book.loss_nonfinite
        has_elements = has_elements or book.pending.has_elements
        templates = self._templates_for(device, has_elements, has_scale, with_norm, peaks, counting)
        if loss_nonfinite is None:
            votes = templates[0].clone()
        else:
            votes = torch.where(move(loss_nonfinite, templates.device), templates[1], templates[0])
        start, own = Slot.NORM + with_norm, self.exchange.rank if peaks > 1 else 0
        peak_slots = votes[start : start + peaks] if peaks else None
        return Ballot(
            votes,
            device,
            has_elements,
            has_scale,
            skip=votes[Slot.SKIP],
            norm=votes[Slot.NORM] if with_norm else None,
            loss_checked=loss_nonfinite is not None,
            peaks=peak_slots,
            peak_slot=None if peak_slots is None else peak_slots[own],
            bins=votes[-BINS:] if counting else None,
        )

    def _templates_for(
        self,
        device: torch.device,
        has_elements: bool,
        has_scale: bool,
        with_norm: bool,
        peaks: int,
        counted: bool,
    ) -> torch.Tensor:
        """A ballot's two rows (the second a non-finite loss's), on the communication device for
        `device`: made once per shape and device by this agreement, and dying with it; by
        kernels alone, no copy from the host, so that one first made while a CUDA graph captures
        the step (a meter or clip step's shape) is legal there. `peaks`: how many slots the
        fit's peaks take (1, or the world size under a SUM); `counted`: with the meter's 128
        counts (a SUM)."""
        key = (device, has_elements, has_scale, with_norm, peaks, counted)
        templates = self._templates.get(key)
        if templates is None:
            size = Slot.NORM + with_norm + peaks + BINS * counted
            comm = self.exchange.comm_device(device)
            templates = torch.zeros((2, size), dtype=torch.float32, device=comm)
            templates[:, Slot.HAS_ELEMENTS].fill_(float(has_elements))
            templates[:, Slot.SCALED].fill_(float(has_scale))
            templates[1, Slot.FORWARD].fill_(1.0)  # the row of a non-finite loss
            self._templates[key] = templates
        return templates

    def _vote(
        self,
        book: Iteration,
        ballot: Ballot,
        flags: Flags,
        reading: Reading | None,
        caller: str,
        norm_type: float | None,
    ) -> Verdict:
        """The one collective on `ballot`, with this rank's `flags` on other devices than the
        ballot's and those of `unscale_`'s pending checks, and what the fit and the meter read
        (this check's `reading` and the pending ones'). Then the scale is confirmed where the
        ballot had none. The pending checks are consumed: their records take the verdict."""
        pending, book.pending = book.pending, PendingCheck()
        if ballot.peaks is not None or ballot.bins is not None:
            _fill_readings(ballot, [reading, *pending.readings])
        others = pending.flags  # and this rank's flags on other devices than the ballot's
        for device, flag in flags.items():
            if device != ballot.skip.device:
                others.append(flag)
        verdict = self._reduce(ballot, others, step=book.step, caller=caller, norm_type=norm_type)
        if ballot.peaks is not None:  # now the group's: the largest slot's, the only one of a MAX
            largest = ballot.peaks[0] if len(ballot.peaks) == 1 else ballot.peaks.amax()
            verdict.peak = move(power_above(largest), ballot.device)
        if ballot.bins is not None:
            verdict.counts = move(ballot.bins, ballot.device)
        if not ballot.has_scale:  # the group confirmed that some rank scaled
            self.home.confirm()
        self.agreed_once = True
        return verdict

    def _reduce(
        self,
        ballot: Ballot,
        local_flags: Iterable[torch.Tensor],
        *,
        step: int,
        caller: str,
        norm_type: float | None = None,
    ) -> Verdict:
        """Combine this rank's ballot with every other rank's, in one collective, and read what
        the group agreed.

        Args:
            ballot: from [`_ballot()`][_ballot], its skip slot raised by the local check
                where the gradients are on its device.
            local_flags: float32 scalar flags of local checks, on any device (1.0: an element
                was non-finite): those of other devices than the ballot's, and of checks made
                before the ballot (`unscale_`); never the ballot's own slot.
            step: the step being taken, for error messages.
            caller: the method being called (`"step"`...), for the error where no rank ever
                called `scale()` (a ballot without a scale asks).
            norm_type: the p of the gradient norm whose share travels in the ballot's norm slot
                (`Kernels.local_norms_` put it there), or None. The share must be non-finite
                wherever the local check raised the ballot's slot (the norms' check does); flags
                from other checks (`local_flags`) make it inf here, and so does any flag under
                an inf-norm (a max, which NCCL may take NaN-blind). An inf-norm's shares combine
                by max, others by sum.

        Raises:
            RuntimeError: no rank holds any gradient element, or (a ballot without a scale) no
                rank ever called `scale()`: every rank raises together, torch's words.
            ShardScaleDistributedError: a rank did not arrive within `timeout`, or left.
        """
        votes, slot, others = ballot.tensor, ballot.skip, False
        for flag in local_flags:  # one kernel per other flag (devices, earlier checks)
            torch.maximum(slot, move(flag, slot.device), out=slot)
            others = True
        if ballot.loss_checked:  # a forward overflow: a non-finite loss, gradients to match
            votes[Slot.FORWARD].mul_(slot)
        if norm_type is not None and (others or math.isinf(norm_type)):
            votes[Slot.NORM].masked_fill_(slot > 0, math.inf)  # the overflow shows in the norm
        summed_norm = norm_type is not None and not math.isinf(norm_type)
        summed = summed_norm or ballot.bins is not None
        if self.exchange.world_size > 1:
            op = dist.ReduceOp.SUM if summed else dist.ReduceOp.MAX
            what = "the overflow flag" + (" and gradient norm" if norm_type is not None else "")
            self.exchange.all_reduce(votes, op, step, what)
        if not (ballot.has_scale and ballot.has_elements):  # the one host read, these only
            agreed = votes.tolist()
            if not ballot.has_scale and agreed[Slot.SCALED] == 0.0:
                raise RuntimeError(no_scale_message(caller))
            if agreed[Slot.HAS_ELEMENTS] == 0.0:
                raise RuntimeError(_NO_GRADS.format(world_size=self.exchange.world_size))
        flags = votes[Slot.SKIP : Slot.FORWARD + 1]  # in Flag's order
        if summed and self.exchange.world_size > 1:
            flags = flags.clamp(max=1.0)  # counts of ranks: exactly 0/1 after this
        verdict = Verdict(flags=move(flags, ballot.device))
        if norm_type is not None:
            total = votes[Slot.NORM]
            if summed_norm and norm_type != 1.0:
                total = total.pow(1.0 / norm_type)
            verdict.total_norm = move(total, ballot.device)
        return verdict


def _fill_readings(ballot: Ballot, readings: Sequence[Reading | None]) -> None:
    """Write this rank's readings into the ballot: the largest peak into its peak slot, the
    counts added up into the bins (those a ballot without bins has no place for are dropped:
    an inf-norm clip's, where the meter waits for the next of its steps)."""
    peaks = [r[0] for r in readings if r is not None and r[0] is not None]
    slot = ballot.peak_slot
    if slot is not None and peaks:  # a NaN counts as an inf: an overflow, and survives a MAX
        largest = (
            peaks[0]
            if len(peaks) == 1
            else torch.stack([move(p, slot.device) for p in peaks]).amax()
        )
        torch.nan_to_num(move(largest, slot.device), nan=math.inf, posinf=math.inf, out=slot)
    counts = [r[1] for r in readings if r is not None and r[1] is not None]
    if ballot.bins is not None and counts:
        torch.sum(torch.stack([move(c, ballot.bins.device) for c in counts]), 0, out=ballot.bins)
