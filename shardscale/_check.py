"""The check: this rank's gradients checked (and unscaled) in one fused pass per (device, dtype),
and ONE collective that agrees on them with every rank; the few kernels it runs, whatever the
gradients' layout.

Invariant: each agreement is one collective, however many optimizers, devices and dtypes hold
the gradients; a local check that `unscale_()` makes waits in the iteration's
[`PendingCheck`][] for the next agreement, whose collective it joins.

It works on gradients (the parameters' `.grad`, grouped by `shardscale._grads`), never on
optimizers: which optimizers a step covers, and what each went through in the iteration, is
the bookkeeping of `shardscale._stepping`, which hands the parameters here and records the
verdict it gets back. The [`Agreement`][] carries what a rank learns across iterations: its
gradient walks, its kernels' constants, which gradients the fit reads, and whether it has
agreed before.

Unscaling and checking are one fused pass per (device, dtype) group, torch's
`_amp_foreach_non_finite_check_and_unscale_`: it multiplies by `inv_scale` and raises a flag in
the same pass. Measured on CPU (docs/benchmarks.md), it costs about a bare `_foreach_mul_` in fp16
and up to ~1.5x one in fp32 (it tests element by element there). The check-only pass of fused
optimizers uses it too, with a factor of 1, except over large CPU tensors (64Ki elements and
more), which it reads by their sums: a float sum is finite only where every element is, and
the sums take about two thirds of the kernel's time there (`isfinite().all()` and
`_foreach_norm(inf)` take ~12x a multiply, `aminmax` 1.3-3x). A non-finite sum (an overflow,
or finite elements summing past float32's range) is checked again by the kernel, so the flag is
exact. Per tensor, a sum costs a few us more than the kernel's share: small tensors stay with
the kernel.

Clipping to a global norm takes two passes, whatever the layout:

1. read: the per-tensor norms of the still-scaled gradients, unscaled and reduced to this rank's
   share `sum |g|^p / r`, `r` being how many ranks hold those same elements (so the sum over the
   group counts every element once; the inf-norm needs no weights, its reduction is a max).
   A non-finite element makes its tensor's norm non-finite, so this pass is also the overflow
   check (for p <= 2 and the inf-norm; a larger p takes one extra check pass). Scaled fp32
   gradients can be large enough that their squares overflow float32, so a finite gradient
   must never be taken for an overflow: on the CPU, where some norm comes out non-finite, the
   norms are taken again in float64 (deciding that is a host read, free there; float64 norms
   cost 8x there; a group tiling one buffer is one tensor there, `GradWalk.groups`), on an
   accelerator every norm accumulates in float64 (a memory-bound pass either way).
2. read+write: multiply by `inv_scale * min(1, max_norm / (total + 1e-6))`, after the agreement.

The small constants the kernels need (a float32 one, a float64 one, a scratch flag, `max_norm`)
are made once per device and kept by the scaler's [`Kernels`][], never shared between scalers.
"""

from __future__ import annotations

import math
import operator
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch

from shardscale._bins import Fp16Gradients, counted, counts_can_travel, power_above
from shardscale._config import ScalerConfig
from shardscale._errors import ShardScaleWarning
from shardscale._exchange import Ballot, Exchange, Flag, Verdict
from shardscale._grads import (
    GradGroups,
    GradWalk,
    NormGroups,
    move,
    warn_plain_replicas_assumed,
)
from shardscale._state import ScaleHome
from shardscale._torch import check_and_unscale_, foreach_mul_, foreach_norm

Groups = GradGroups | NormGroups
# One float32 scalar per device holding gradients: 1.0 where any element was non-finite.
Flags = dict[torch.device, torch.Tensor]

_CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s
_DTYPE = operator.itemgetter(1)


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


def exact_norm_check(groups: NormGroups, norm_type: float) -> bool:
    """Whether a non-finite norm means a non-finite element, and nothing else.

    True for `p <= 2` and the inf-norm over gradients of at most float32 range: their float64
    sums cannot overflow. Otherwise the caller checks the elements in an extra pass.
    """
    small_p = norm_type <= 2.0 or math.isinf(norm_type)
    return small_p and torch.float64 not in map(_DTYPE, groups)


class Kernels:
    """A scaler's kernels over its gradient groups, and the constants they take."""

    def __init__(self) -> None:
        self._ones: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self._scratch: Flags = {}
        self._max_norm: dict[torch.device, tuple[float, torch.Tensor]] = {}

    def one(self, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A one on `device`, made once: for a kernel that wants a factor but has nothing to
        multiply by (the check-only pass, a clip of unscaled gradients). Never modify it."""
        one = self._ones.get((device, dtype))
        if one is None:
            one = self._ones[(device, dtype)] = torch.ones((), dtype=dtype, device=device)
        return one

    def inverse(self, scale: torch.Tensor) -> torch.Tensor:
        """1/scale in float32, taken in float64 as torch's scalers do (bit for bit with them).

        One kernel: the division runs in float64 (the one operand is float64) and is rounded once
        to float32 as it is stored, exactly `scale.double().reciprocal().float()`.
        """
        out = torch.empty((), dtype=torch.float32, device=scale.device)
        return torch.div(self.one(scale.device, torch.float64), scale, out=out)

    def check_(self, groups: Groups, inv_scale: torch.Tensor | None, flags: Flags) -> Flags:
        """Multiply every gradient by `inv_scale` (if given) and flag the devices with inf/NaN.

        `flags` are raised (the kernel only ever sets them to 1.0), so that several calls end
        with one flag per device; a device without one gets a new zero flag. `inv_scale` is
        copied once per device (a blocking copy to the CPU).
        """
        factors: dict[torch.device, torch.Tensor] = {}
        for key, grads in groups.items():
            device = key[0]  # (device, dtype), or (device, dtype, replica count)
            if device not in flags:
                flags[device] = torch.zeros((), dtype=torch.float32, device=device)
            if device not in factors:
                factors[device] = self.one(device) if inv_scale is None else move(inv_scale, device)
            if inv_scale is None and device.type == "cpu" and grads[0].numel() >= 1 << 16:
                # A check only, of large CPU tensors: read, not rewrite. A sum is finite only
                # where every element is; one that is not is checked again, exactly.
                if not math.isfinite(sum(g.sum(dtype=torch.float32).item() for g in grads)):
                    check_and_unscale_(grads, flags[device], factors[device])
            else:
                check_and_unscale_(grads, flags[device], factors[device])
        return flags

    def multiply_(self, groups: Groups, factor: torch.Tensor) -> None:
        """Multiply every gradient in `groups` by the float32 scalar `factor`, in place.

        On an accelerator with the check kernel, not `_foreach_mul_`: on CUDA `_foreach_mul_`
        takes its per-tensor slow path when the factor's dtype differs from the gradients' (a
        float32 factor on fp16 or bf16 gradients: one launch per tensor), while the check kernel
        takes a float32 factor for every gradient dtype in one launch, and multiplies in the
        same precision (float32 for fp16/bf16, as `mul_` does). Its flags are scratch ones
        nobody reads.

        On the CPU with `_foreach_mul_`: there the check kernel tests element by element, up to
        1.45x the time of the vectorised multiply in fp32 (docs/benchmarks.md), and `mul_` takes
        a 0-dim CPU factor in float32 for fp16/bf16 too, never rounding it to their dtype.
        """
        on_accelerators: dict[Any, list[torch.Tensor]] = {}
        on_cpu = None  # the factor, copied to the CPU once
        for key, grads in groups.items():
            if key[0].type != "cpu":
                on_accelerators[key] = grads
                continue
            on_cpu = move(factor, key[0]) if on_cpu is None else on_cpu
            foreach_mul_(grads, on_cpu)
        if on_accelerators:
            self.check_(on_accelerators, factor, self._scratch)

    def local_norms_(
        self,
        groups: NormGroups,
        norm_type: float,
        inv_scale: torch.Tensor,
        flags: Flags,
        out: torch.Tensor,
    ) -> None:
        """Pass 1 (read only): this rank's share of the unscaled global norm, into `out` (the
        ballot's float32 slot), and the check.

        The per-tensor norms of every group with the same replica count are moved to `out`'s
        device (a non-blocking copy from the CPU: CPU-offloaded gradients cost no device-to-host
        copy here), stacked in one kernel, then unscaled and checked in one more (the check
        kernel, which raises `flags[device]` where a norm is non-finite: pass the ballot's flags
        where [`exact_norm_check()`][exact_norm_check] holds), then reduced in one, straight into
        `out` (more for p other than 1, 2 and inf, or several replica counts). So the kernels per
        step grow with the number of groups, never with the number of tensors.

        The share is `sum |g * inv_scale|_p^p / r` (the max for the inf-norm), zero without
        gradient elements, non-finite where a norm was.
        """
        device = out.device
        if device not in flags:
            flags[device] = torch.zeros((), dtype=torch.float32, device=device)
        pieces: dict[int, list[torch.Tensor]] = {}
        for (_device, _dtype, replicas), grads in groups.items():
            pieces.setdefault(replicas, []).append(move(_norms(grads, norm_type), device))
        reduce = torch.amax if math.isinf(norm_type) else torch.sum
        share: torch.Tensor | None = None
        for replicas, parts in pieces.items():
            size = sum(map(torch.Tensor.numel, parts))
            norms = torch.cat(parts, out=torch.empty(size, dtype=torch.float32, device=device))
            check_and_unscale_([norms], flags[device], move(inv_scale, device))
            direct = len(pieces) == 1 and (replicas == 1 or math.isinf(norm_type))
            if norm_type == 2.0:  # the common case in one kernel: a dot product
                part = torch.dot(norms, norms, out=out) if direct else torch.dot(norms, norms)
            elif norm_type == 1.0 or math.isinf(norm_type):
                part = reduce(norms, 0, out=out) if direct else reduce(norms, 0)
            else:
                part = norms.pow(norm_type).sum()
            if replicas != 1 and not math.isinf(norm_type):  # a max: replicas need no weight
                part = part / replicas
            if share is not None:
                part = torch.maximum(share, part) if math.isinf(norm_type) else share + part
            share = part
        if share is None:
            out.zero_()
        elif share is not out:
            out.copy_(share)

    def clip_(
        self,
        groups: NormGroups,
        max_norm: float,
        total_norm: torch.Tensor,
        inv_scale: torch.Tensor | None,
        found_inf: torch.Tensor,
    ) -> None:
        """Pass 2: multiply every gradient by `inv_scale * min(1, max_norm / (total + 1e-6))`.

        On the device, without a host synchronisation, in five scalar kernels and one per group.
        On an overflow (`found_inf` 1.0: the step will be skipped) it only unscales, where torch
        would turn the gradients to NaN, so that what overflowed can still be seen. A norm that
        is non-finite without an overflow (p-th powers beyond float32's range, p > 2) clips to
        zero, as torch does.
        """
        device = total_norm.device
        known = self._max_norm.get(device)
        if known is None or known[0] != max_norm:
            full = torch.full((), max_norm, dtype=torch.float32, device=device)
            known = self._max_norm[device] = (max_norm, full)
        coef = torch.div(known[1], total_norm + _CLIP_EPS)
        # fmin/fmax ignore a NaN (a NaN norm: an overflow), so an overflow gives exactly 1.
        factor = torch.fmax(torch.fmin(coef, self.one(device)), found_inf)
        if inv_scale is not None:
            factor = factor * move(inv_scale, device)
        self.multiply_(groups, factor)


def _norms(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """Per-tensor p-norms, taken in float64 where their p-th powers need it, never overflowing
    for finite elements (module docstring).

    On an accelerator one 1-D float64 tensor: one `_foreach_norm`, stacked in one kernel (a
    launch per ~128 norms on CUDA; concatenated into float32 with the other groups' instead, each
    norm took a launch of its own, as the first GPU run counted: 428 for 400 tensors). On the CPU
    one 1-D float32 tensor.
    """
    if math.isinf(norm_type):  # an empty shard's inf-norm raises; its every p-norm is 0
        device, grads = grads[0].device, [grad for grad in grads if grad.numel()]
        if not grads:  # this rank still joins the collective, with a share of 0
            return torch.zeros(1, dtype=torch.float32, device=device)
    if grads[0].device.type != "cpu":
        return torch.stack(foreach_norm(grads, norm_type, dtype=torch.float64))
    norms = torch.stack(foreach_norm(grads, norm_type, dtype=torch.float32))
    if math.isinf(norm_type) or bool(norms.isfinite().all()):  # a host read: free on the CPU
        return norms
    # a norm (not its p-th power) of finite elements fits float32
    return torch.stack(foreach_norm(grads, norm_type, dtype=torch.float64)).float()


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
            verdict = self._exchange(book, ballot, flags, reading, caller, None)
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
            verdict = self._exchange(book, ballot, flags, reading, "clip_grad_norm_", norm_type)
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
        verdict = self.exchange.agree(
            ballot, others, step=book.step, caller=caller, norm_type=norm_type
        )
        if ballot.peaks is not None:  # now the group's: the largest slot's, the only one of a MAX
            largest = ballot.peaks[0] if len(ballot.peaks) == 1 else ballot.peaks.amax()
            verdict.peak = move(power_above(largest), ballot.device)
        if ballot.bins is not None:
            verdict.counts = move(ballot.bins, ballot.device)
        if not ballot.has_scale:  # the group confirmed that some rank scaled
            self.home.confirm()
        self.agreed_once = True
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
