"""What the scaler remembers: the scale state on the device where each step moves it, where
that state lives, and the group's [`Verdict`][] on a step, which moves it.

Invariant: between two `update()` calls the device tensors hold exactly what a state dict would
read back (one host read, `DeviceState.packed`, gets all of it; the state dict's format is
`shardscale._checkpoint`'s). [`ScaleHome`][] answers "does this rank hold a scale?" and is the one
path by which the state changes. The iteration under way is `shardscale._stepping`'s.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, fields, replace
from enum import IntEnum
from typing import Any

import torch

from shardscale._bins import fit_, meter_reading
from shardscale._errors import no_scale_message
from shardscale._grads import move
from shardscale._policy import HOLD, ScalePolicy, ScaleState
from shardscale._torch import update_scale_


@dataclass(frozen=True, slots=True)
class Counters:
    """How many steps the scaler has seen, skipped and retried, and the streaks its alarms
    watch: all of it in the state dict, so that a resumed run raises where the uninterrupted
    one would.

    Attributes:
        steps: `update()` calls that consumed a step's overflow check.
        skipped_steps: Of those, the steps skipped because some rank overflowed (gradients or loss).
        consecutive_skips: Skipped steps since the last step taken.
        last_overflow_step: The number (1-based) of the last skipped step; 0 if none was skipped.
        forward_overflows: Of the skipped steps, those whose loss was non-finite on some rank (the
            scale held).
        retries: Times `step(closure=...)` backed off and ran a batch again after a gradient
            overflow.
        floor_streak: Gradient overflows in a row that left the scale at its floor (with
            `dynamic=False`, at its one value); a forward overflow between them neither counts
            nor ends it. `max_overflows_at_floor` of them is the error.
        loss_streak: Forward overflows (non-finite losses) in a row: the loss streak's warning.
    """

    steps: int = 0
    skipped_steps: int = 0
    consecutive_skips: int = 0
    last_overflow_step: int = 0
    forward_overflows: int = 0
    retries: int = 0
    floor_streak: int = 0
    loss_streak: int = 0

    def by_count(self) -> tuple[int, ...]:
        """The values by `Count`, as `DeviceState.counters` holds them (MISMATCH at 0: no state
        differed yet; BACKOFF's slot apart)."""
        since = self.steps - self.last_overflow_step  # SINCE_OVERFLOW
        head = (self.steps, self.skipped_steps, self.consecutive_skips, since)
        streaks = (self.floor_streak, self.loss_streak)
        return (*head, self.forward_overflows, self.retries, *streaks, 0)

    def step_counts(self) -> dict[str, int]:
        """The counts [`ScalerStats`][shardscale.ScalerStats] shows: all but the streaks."""
        return {name: getattr(self, name) for name in _STEP_COUNTS}


# `Counters`' fields that `ScalerStats` shows (the streaks are the alarms' business).
_STEP_COUNTS = tuple(f.name for f in fields(Counters) if not f.name.endswith("_streak"))


@dataclass(frozen=True, slots=True)
class ScalerState:
    """Everything a state dict holds."""

    policy: ScalePolicy
    scale: ScaleState
    counters: Counters


def fingerprint(state: ScalerState) -> int:
    """A hash of `state`, the same on every rank that holds it (not Python's `hash`, which
    differs between processes)."""
    return zlib.crc32(repr(state).encode())


# The slots of `DeviceState.counters`: `Counters`' fields (SINCE_OVERFLOW: steps since the last
# overflow), then the streaks the scaler watches: FLOOR_STREAK, consecutive gradient overflows
# that left the scale at its floor (or, with `dynamic=False`, at its one value); LOSS_STREAK,
# consecutive forward overflows; MISMATCH, the collectives whose identity said the ranks differ
# (counted on an accelerator, where it is not read at once: `shardscale._check`). One more slot of
# their update, BACKOFF: the gradient overflow the policy backs off for.
Count = IntEnum(
    "Count",
    "STEPS SKIPPED CONSECUTIVE SINCE_OVERFLOW FORWARD_OVERFLOWS RETRIES FLOOR_STREAK LOSS_STREAK "
    "MISMATCH BACKOFF",
    start=0,
)
COUNTERS = Count.BACKOFF  # how many are kept


# A step's update of the counters is `counters * keep + add`, `keep` and `add` linear in the
# agreed flags s (skipped) and f (of which a forward overflow): per slot, (keep, add), each as
# (constant, per s, per f). BACKOFF's `add` is s - f. FLOOR_STREAK's pair is then multiplied by
# whether the scale is at its floor after the step (a forward overflow keeps it, and the scale).
_UPDATE = {
    Count.STEPS: ((1, 0, 0), (1, 0, 0)),
    Count.SKIPPED: ((1, 0, 0), (0, 1, 0)),
    Count.CONSECUTIVE: ((0, 1, 0), (0, 1, 0)),
    Count.SINCE_OVERFLOW: ((1, -1, 0), (1, -1, 0)),
    Count.FORWARD_OVERFLOWS: ((1, 0, 0), (0, 0, 1)),
    Count.RETRIES: ((1, 0, 0), (0, 0, 0)),
    Count.FLOOR_STREAK: ((0, 1, 0), (0, 1, -1)),
    Count.LOSS_STREAK: ((0, 0, 1), (0, 0, 1)),
    Count.MISMATCH: ((1, 0, 0), (0, 0, 0)),
    Count.BACKOFF: ((0, 0, 0), (0, 1, -1)),
}
# as matrices: [keep..., add...] = base + [s, f] @ slopes
_COUNT_TERMS = [
    [row[part][term] for part in (0, 1) for row in _UPDATE.values()] for term in range(3)
]


# The agreed flags of a `Verdict`, by slot: `verdict.flags[Flag.SKIP]`.
Flag = IntEnum("Flag", "SKIP FORWARD", start=0)


class FlagsBlock:
    """The agreed `[skip, forward]` flags of every check of one collective: the first host read
    of one check's decision reads them all (one synchronisation for the collective's checks)."""

    def __init__(self, flags: torch.Tensor) -> None:
        self.flags = flags
        self._skips: list[bool] | None = None

    def skipped(self, row: int) -> bool:
        """Whether check `row` was agreed skipped (one host read, the first time)."""
        if self._skips is None:
            if len(self.flags) == 1:
                self._skips = [bool(self.flags[0, Flag.SKIP].item())]
            else:
                self._skips = [pair[Flag.SKIP] > 0 for pair in self.flags.tolist()]
        return self._skips[row]

    def mark_skipped(self) -> None:
        """Every check reads as skipped now (`record_overflow()` set their flags)."""
        self._skips = [True] * len(self.flags)


@dataclass(slots=True, eq=False)
class Verdict:
    """What the group agreed on, identical on every rank: made by the agreement
    (`shardscale._check`), one per check, recorded by a step's bookkeeping
    (`shardscale._stepping`); an iteration's, combined, moves the state here
    ([`DeviceState.apply_()`][DeviceState.apply_]).

    Attributes:
        flags: float32 `[skip, forward overflow]` on the scale's device, each exactly 0.0 or 1.0.
        has_grads: Whether some rank held a gradient for the check (None: not known, a combined
            verdict's of checks that differ).
        read: What [`skipped()`][skipped] read on the host; None: not read (a fused step's verdict).
        block, row: The flags of every check of its collective, and which row is its own, so
            that one host read serves them all (None: a verdict made here, of several).
        peak: An iteration's: the power of two just above the group's largest |scaled gradient|
            (float32 scalar; 0 where none was finite and non-zero), where the fit read it.
        counts: An iteration's: the group's non-zero |scaled gradient| elements by bin (float32;
            the meter's steps).
        mismatch: An iteration's: 1.0 where a collective's identity said the ranks differ, on an
            accelerator (float32 scalar; None: none could be unread).
    """

    flags: torch.Tensor
    has_grads: bool | None = None
    read: bool | None = None
    block: FlagsBlock | None = None
    row: int = 0
    peak: torch.Tensor | None = None
    counts: torch.Tensor | None = None
    mismatch: torch.Tensor | None = None

    @property
    def found_inf(self) -> torch.Tensor:
        """The skip flag (float32 scalar): what torch's scalers call `found_inf`."""
        return self.flags[Flag.SKIP]

    def skipped(self) -> bool:
        """Whether the group said skip: one host read the first time (a plain step's one
        synchronisation, shared with its collective's other checks), remembered for the
        step's later questions."""
        if self.read is None:
            if self.block is not None:
                self.read = self.block.skipped(self.row)
            else:
                self.read = bool(self.flags[Flag.SKIP].item())
        return self.read


def verdicts_of(flags: torch.Tensor, has_grads: list[bool]) -> list[Verdict]:
    """The verdicts of one collective's checks: `flags` (`[checks, 2]`), one host read for all."""
    block = FlagsBlock(flags)
    return [Verdict(flags[i], held, block=block, row=i) for i, held in enumerate(has_grads)]


def combined(verdicts: Iterable[Verdict | None]) -> Verdict | None:
    """One verdict for several (of several optimizers, checks, leaves of a container): the one
    they share (the usual case), else a new one whose flags are the largest of theirs; read
    where each was read (skipped if any was), holding gradients where any did. None where none
    is given."""
    distinct: dict[tuple[int, int], Verdict] = {}
    for verdict in verdicts:
        if verdict is not None:  # by the flags it reads: a check merged into a clip's shares them
            key = (
                (id(verdict.block), verdict.row) if verdict.block is not None else (id(verdict), 0)
            )
            distinct.setdefault(key, verdict)
    if len(distinct) <= 1:
        return next(iter(distinct.values()), None)
    parts = list(distinct.values())
    device = parts[0].flags.device
    verdict = Verdict(torch.stack([move(v.flags, device) for v in parts]).amax(0))
    verdict.read = _any_of([v.read for v in parts])
    verdict.has_grads = _any_of([v.has_grads for v in parts])
    return verdict


def _any_of(values: list[bool | None]) -> bool | None:
    """True where any of `values` is; False where all are False; else None (not known)."""
    return True if True in values else (False if None not in values else None)


def move_scale_(
    policy: ScalePolicy,
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    hysteresis_tracker: torch.Tensor,
    found_inf: torch.Tensor,
    forward: torch.Tensor | None = None,
    *,
    clean: bool = False,
    past_interval: bool = False,
) -> None:
    """Apply `policy`'s [`next()`][shardscale.ScalePolicy.next] in place to the device
    tensors, without a host sync (the interval rule; the fit's is `shardscale._bins.fit_`).

    Args:
        scale: float32 scalar tensor.
        growth_tracker: int32 scalar tensor on the same device.
        hysteresis_tracker: int32 scalar tensor on the same device.
        found_inf: float32 scalar, 1.0 when the gradients overflowed on some rank and no
            rank's loss was non-finite (the caller takes the forward overflows out).
        forward: float32 scalar, 1.0 on a forward overflow; None where the caller knows
            there was none. Two kernels hold the state then: torch's kernel counts a
            clean step (`found_inf` is 0), so the growth tracker is first set back by
            one, and the scale cannot grow, where the tracker is below the interval.
        clean: the host knows that `found_inf` is 0: the scale can only grow, so without
            a finite `max_scale` no clamp is needed (torch's kernel never grows it to inf).
        past_interval: the tracker may be at or past the interval (`growth_interval` was
            lowered below it, or a state loaded with it there): a forward overflow then
            sets it far below zero instead (`HOLD`, where counting one cannot reach the
            interval) and back after, one kernel more.
    """
    if not policy.dynamic:
        return
    held = None if forward is None else forward.to(torch.int32)
    if held is not None:
        growth_tracker.sub_(held, alpha=HOLD if past_interval else 1)
    # torch's own update kernel (back off, or grow after the interval), then the floor and
    # ceiling, which it does not know (none needed for a growth without a ceiling: `clean`).
    # With hysteresis around it: an overflow still tolerated keeps the old scale (the kernel
    # already zeroed the growth tracker, as the policy does); a growth (the tracker wrapped
    # to 0 on a clean step) replenishes the allowance, and a forward overflow does not.
    tolerated = (found_inf > 0) & (hysteresis_tracker > 1) if policy.hysteresis > 1 else None
    kept = None if tolerated is None else scale.clone()
    factors = (policy.growth_factor, policy.backoff_factor, policy.growth_interval)
    update_scale_(scale, growth_tracker, found_inf, *factors)
    if held is not None and past_interval:
        growth_tracker.add_(held, alpha=HOLD - 1)
    if not (clean and math.isinf(policy.max_scale)):
        scale.clamp_(min=policy.min_scale, max=policy.max_scale)
    if tolerated is None or kept is None:
        return
    torch.where(tolerated, kept, scale, out=scale)
    grew = (growth_tracker == 0) & (found_inf == 0)
    if forward is not None:
        grew &= forward == 0
    replenished = torch.where(grew, policy.hysteresis, hysteresis_tracker)
    torch.where(tolerated, hysteresis_tracker - 1, replenished, out=hysteresis_tracker)


def back_off_(policy: ScalePolicy, scale: torch.Tensor, growth_tracker: torch.Tensor) -> None:
    """Back the scale off once by `policy`, now, whatever the hysteresis allows (a retried step's
    gradients overflowed: the same scale would overflow again): floor held, growth
    tracker zeroed. For a dynamic scale (the caller checks)."""
    factors = (policy.growth_factor, policy.backoff_factor, policy.growth_interval)
    update_scale_(scale, growth_tracker, torch.ones_like(scale), *factors)
    scale.clamp_(min=policy.min_scale)


class Landing:
    """A device tensor's copy on its way to the host: [`values()`][values] waits for it to
    land (once), then reads it (and remembers what it read)."""

    def __init__(self, host: torch.Tensor, wait: Any) -> None:
        self._host, self._wait = host, wait
        self._values: list[float] | None = None

    def values(self) -> list[float]:
        """The copied values: the wait for the copy (normally long over), then one read."""
        if self._values is None:
            self._wait()
            self._values = self._host.tolist()
        return self._values


class DevicePath:
    """How the host meets the device the state lives on: the one place that knows CUDA's
    events, streams, pinned memory, graph capture and device contexts.

    On CUDA the host reads the state *late*: a non-blocking copy into pinned memory, covered by
    an event, read at the next `update()`, so that reading never stalls a step. Elsewhere it
    reads at once (on the CPU the copy is the read; an accelerator without CUDA's events
    could not wait for a non-blocking copy). `shardscale.testing.cuda_path()` puts another
    path in this one's place, which takes the CUDA answers for CPU tensors: nothing else in
    the package knows that tests exist.
    """

    def reads_late(self, device: torch.device) -> bool:
        """Whether state on `device` is read through a copy that lands later."""
        return device.type == "cuda"

    def capturing(self, device: torch.device) -> bool:
        """Whether `device`'s current stream is capturing a CUDA graph (the state's device,
        not the current one: another GPU's stream says nothing of this one's)."""
        if device.type != "cuda" or not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            return False
        with torch.cuda.device(device):
            return torch.cuda.is_current_stream_capturing()

    def on(self, device: torch.device) -> AbstractContextManager[object]:
        """Make `device` the current one of its type for the block (no-op on the CPU and for a
        device without an index): a new thread's current GPU is 0 whatever the rank's is."""
        if device.type == "cpu" or device.index is None:
            return nullcontext()
        select = getattr(torch.get_device_module(device.type), "device", None)
        return nullcontext() if select is None else select(device.index)

    def copy_late(self, tensor: torch.Tensor) -> Landing:
        """Start copying `tensor` (on a device that `reads_late`) to the host, without waiting.

        Into pinned memory (torch's caching host allocator keeps the few small blocks this
        takes from one step to the next), on the current stream of the tensor's OWN device,
        with an event recorded there: on another thread, or without `torch.cuda.set_device`,
        the current device is another GPU, and the copy and its event must share a stream.
        """
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        with torch.cuda.device(tensor.device):
            host.copy_(tensor, non_blocking=True)
            event.record(torch.cuda.current_stream(tensor.device))
        return Landing(host, event.synchronize)


_PATH = DevicePath()  # the path in use: `shardscale.testing.cuda_path()` swaps it for a block


def device_path() -> DevicePath:
    """The [`DevicePath`][] in use (read at each call: a test's seam may have replaced it)."""
    return _PATH


def use_device_path(path: DevicePath) -> DevicePath:
    """Put `path` in use, for every thread; return the one it replaces (`shardscale.testing`)."""
    global _PATH
    previous, _PATH = _PATH, path
    return previous


@dataclass(frozen=True, slots=True)
class DeviceState:
    """The scale state as tensors on the loss's device, where the hot path updates it.

    Kept on the device so that `update()` needs no host synchronisation, and counted there, not
    on the host, so that the counts stay right when step+update is replayed from a CUDA graph;
    read back to host values only for `state_dict()`, `stats` and `get_scale()`.

    Attributes:
        scale: float32 scalar.
        growth_tracker: int32 scalar.
        hysteresis_tracker: int32 scalar.
        counters: float64, by `Count`: `[steps, skipped_steps, consecutive_skips, steps since the
            last overflow, forward_overflows, retries, floor streak, loss streak, mismatches]`
            (exact to 2**53). Steps since the last overflow rather than its step number, because
            it updates with the same multiply-add as the others.
        count_terms: `_COUNT_TERMS` on this device (float32, 3 x 20: the base, then the slopes).
        fit: float32 `[margin, streak, window...]`: the fit's fields of
            [`ScaleState`][shardscale.ScaleState].
        meter: float64 `[step, fraction, scale]`: the meter's last reading
            (`shardscale._bins.meter_reading`; zeros: none).
    """

    scale: torch.Tensor
    growth_tracker: torch.Tensor
    hysteresis_tracker: torch.Tensor
    counters: torch.Tensor
    count_terms: torch.Tensor
    fit: torch.Tensor
    meter: torch.Tensor

    @classmethod
    def create(cls, state: ScalerState, device: torch.device) -> DeviceState:
        """Tensors on `device` holding `state`."""
        device_state = cls(
            scale=torch.empty((), dtype=torch.float32, device=device),
            growth_tracker=torch.empty((), dtype=torch.int32, device=device),
            hysteresis_tracker=torch.empty((), dtype=torch.int32, device=device),
            counters=torch.zeros(COUNTERS, dtype=torch.float64, device=device),
            count_terms=torch.tensor(_COUNT_TERMS, dtype=torch.float32, device=device),
            fit=torch.empty(2 + len(state.scale.window), dtype=torch.float32, device=device),
            meter=torch.zeros(3, dtype=torch.float64, device=device),
        )
        device_state.write(state)
        return device_state

    def write(self, state: ScalerState) -> None:
        """Overwrite the tensors in place with `state` (keeping their identity); the meter has
        read nothing of it yet."""
        self.scale.fill_(state.scale.scale)
        self.growth_tracker.fill_(state.scale.growth_tracker)
        self.hysteresis_tracker.fill_(state.scale.hysteresis_tracker)
        self.counters.copy_(torch.tensor(state.counters.by_count(), dtype=torch.float64))
        fit = state.scale
        self.fit.copy_(torch.tensor([fit.margin, fit.streak, *fit.window]))
        self.meter.zero_()

    def apply_(
        self,
        policy: ScalePolicy,
        verdict: Verdict,
        manual: torch.Tensor | None = None,
        past_interval: bool = False,
    ) -> None:
        """Count one step and move the scale, from the group's `verdict`, without a host sync.

        Read from it: the agreed flags, by `Flag`, each exactly 0.0 or 1.0 (a forward overflow
        is a skip: never above the skip flag); whether the host read them and the step was not
        skipped (`read is False`: a plain step's decision), where the counts move by constants
        (the flags' terms vanish, the streaks end), and there is no forward overflow to hold the
        scale for, nor a backoff to floor: kernels fewer; the bound of the largest scaled
        gradient (`peak`, the fit's); the meter's counts (read at the scale the gradients
        carried, before it moves). `manual`: set the scale to this instead of moving it
        (`update(new_scale=...)`); `past_interval`: the growth tracker may be at or past the
        interval (`ScaleHome.past_interval`).
        """
        flags, clean = verdict.flags, verdict.read is False
        terms = self.count_terms
        rows = terms[0] if clean else torch.addmm(terms[:1], flags.view(1, 2), terms[1:])
        keep, add = rows.view(2, len(Count))
        torch.addcmul(add[:COUNTERS], self.counters, keep[:COUNTERS], out=self.counters)
        if verdict.counts is not None:  # counted this step, read at the scale not moved yet
            reading = meter_reading(verdict.counts.double(), self.scale, self.counters[Count.STEPS])
            self.meter.copy_(reading)
        trackers = (self.growth_tracker, self.hysteresis_tracker)
        if manual is not None:
            self.scale.copy_(manual)
        elif policy.fit:  # the fit's bound, by the scale the gradients carried
            peak = verdict.peak if verdict.peak is not None else self.scale.new_zeros(())
            seen = peak / self.scale
            fit_(policy, self.scale, self.hysteresis_tracker, self.fit, flags, seen)
        elif clean:
            move_scale_(policy, self.scale, *trackers, flags[Flag.SKIP], clean=True)
        else:  # a gradient overflow backs off; a forward one holds
            found, forward = add[Count.BACKOFF], flags[Flag.FORWARD]
            move_scale_(policy, self.scale, *trackers, found, forward, past_interval=past_interval)
        if not clean and policy.dynamic:  # the floor streak goes on only at the floor
            self.counters[Count.FLOOR_STREAK].mul_(self.scale <= policy.min_scale)
        if verdict.mismatch is not None:  # the alarms read it (`shardscale._report`)
            self.counters[Count.MISMATCH].add_(verdict.mismatch)

    def back_off_for_retry_(self, policy: ScalePolicy) -> bool:
        """Back the scale off once for a rerun of the batch (`step(closure=...)`), and count the
        retry; False, changing nothing, where the scale cannot go lower (`dynamic=False`, or at
        the floor). One host read of the scale."""
        if not policy.dynamic or float(self.scale.item()) <= policy.min_scale:
            return False
        back_off_(policy, self.scale, self.growth_tracker)
        self.counters[Count.RETRIES].add_(1)
        return True

    def packed(self) -> torch.Tensor:
        """`[scale, growth_tracker, hysteresis_tracker, *counters, *fit, *meter]`, one float64
        tensor, in one kernel (a `cat` that promotes the dtypes).

        One host read then gets everything (`read`, and the step reports).
        """
        head = (self.scale, self.growth_tracker, self.hysteresis_tracker)
        return torch.cat([*(t.reshape(1) for t in head), self.counters, self.fit, self.meter])


# Where `DeviceState.packed()` holds the counters: after the scale and its two trackers.
PACKED_COUNTERS = 3


def unpack(values: list[float]) -> tuple[ScaleState, Counters]:
    """The host values of `DeviceState.packed()` (the meter's three last are not read here)."""
    scale, growth, hysteresis, *rest = values
    steps, skipped, consecutive, since, forward, retries = rest[:6]
    last_overflow = steps - since if skipped else 0
    streaks = (rest[Count.FLOOR_STREAK], rest[Count.LOSS_STREAK])
    counts = (steps, skipped, consecutive, last_overflow, forward, retries, *streaks)
    counters = Counters(*map(int, counts))
    margin, streak, *window = rest[COUNTERS:-3]
    trackers = (int(growth), int(hysteresis), int(margin))
    return ScaleState(scale, *trackers, window=tuple(window), streak=int(streak)), counters


class ScaleHome:
    """Where this rank's scale state lives, and the one answer to "does this rank hold a scale?".

    The state stays on the host (`host`) until `scale()` puts it where the loss is
    ([`at()`][at]): this rank scaled. A rank that never scales (a pipeline stage before
    the last) gets it where its gradients are when it first steps
    ([`for_gradients()`][for_gradients]), *unconfirmed*: it checks its gradients but modifies
    nothing until the group's first agreement shows that some rank scaled
    ([`confirm()`][confirm]). Every change to the state goes through this object.

    It also knows where the state came from, its *origin*: the state it was built with, or the
    last one loaded that differed from the one it held, with the one it replaced. Ranks that
    ran the same steps from the same origin hold the same state, so the origin (a hash, in every
    ballot's identity: `shardscale._check`) is what tells a rank that loaded another state from
    its peers, at the first collective after the load: a stale copy, a load on some ranks only,
    or the state the others were built with, loaded by one rank later.
    """

    def __init__(self, host: ScalerState) -> None:
        self.host = host
        """The state on the host: all of it before a device holds it; after, its policy and
        the values the state started from (torch's `_init_scale`)."""
        self.origin = fingerprint(host)
        """A hash of the state this rank's run started from (the one built, or loaded)."""
        self.origin_note = f"built with scale {host.scale.scale:g}"
        """The origin, said in words, for the error that names each rank's."""
        self.past_interval = False
        """Whether the growth tracker may be at or past the growth interval (which torch's
        update kernel leaves counting on): the interval was lowered, or a state put it there.
        The host cannot know when an overflow resets it: once set, it stays."""
        self.device: DeviceState | None = None
        """The state on its device, once a loss or a step put it there."""
        self.scaled_here = False
        """Whether this rank called `scale()`."""
        self.unconfirmed = False
        """The state was put here by a step, not by `scale()`, and no agreement has yet
        confirmed that some rank scales."""

    def at(self, device: torch.device, *, loss: bool = False) -> DeviceState:
        """The state on `device`, put there now if no device holds it yet; `loss`: for a loss
        on `device` (this rank scales; the scale lives where the first loss does)."""
        self.scaled_here = self.scaled_here or loss
        if self.device is None:
            self.device = DeviceState.create(self.host, device)
        return self.device

    def for_gradients(self, params: Iterable[torch.Tensor]) -> DeviceState:
        """The state for a rank that steps without having scaled (a pipeline stage before the
        last), unconfirmed until the group agrees that some rank scaled; put, if no device
        holds it yet, where the gradients of `params` are: the first gradient's device (a
        DTensor's is its local shard's), else the first parameter's (no gradient yet), else
        the CPU."""
        if self.device is not None:
            return self.device
        self.unconfirmed = True
        first: torch.Tensor | None = None
        for param in params:
            if param.grad is not None:
                return self.at(param.grad.device)
            first = param if first is None else first
        return self.at(torch.device("cpu") if first is None else first.device)

    def confirm(self) -> None:
        """The group agreed that some rank scaled: this rank may now modify its gradients."""
        self.unconfirmed = False

    def withdraw(self) -> None:
        """The group agreed that no rank scaled: the state a step put here unconfirmed goes
        back to the host (every rank's calls then fail alike, in torch's words)."""
        if self.unconfirmed:
            self.device, self.unconfirmed = None, False

    def require(self, funcname: str) -> DeviceState:
        """The state on its device; torch's error if no `scale()` (or step) put it there.

        Raises:
            RuntimeError: no state on a device yet, in torch's words.
        """
        if self.device is None:
            raise RuntimeError(no_scale_message(funcname))
        return self.device

    def set_policy(self, **changes: Any) -> None:
        """Change policy settings (validated by `ScalePolicy`)."""
        before = self.host.policy.growth_interval
        self.host = replace(self.host, policy=replace(self.host.policy, **changes))
        self.past_interval |= self.host.policy.growth_interval < before

    def set_start(self, **changes: Any) -> None:
        """Change the values the state starts from on a device (torch's `_init_scale`...): a
        new origin."""
        self.host = replace(self.host, scale=replace(self.host.scale, **changes))
        self.past_interval |= self.host.scale.growth_tracker >= self.host.policy.growth_interval
        self.origin = fingerprint(self.host)
        self.origin_note = f"set to start at scale {self.host.scale.scale:g}"

    def load(self, state: ScalerState) -> None:
        """Take `state` (a loaded state dict), on the host and, if one holds it, the device: a
        new origin, unless it is the state held already (a load of it changes nothing)."""
        held = self.read()
        if state != held:
            self.origin = zlib.crc32(repr((fingerprint(state), fingerprint(held))).encode())
            steps = state.counters.steps
            self.origin_note = (
                f"loaded by load_state_dict() (scale {state.scale.scale:g}, {steps} steps)"
            )
        self.host = state
        self.past_interval |= state.scale.growth_tracker >= state.policy.growth_interval
        if self.device is not None:
            self.device.write(state)

    def read(self) -> ScalerState:
        """The whole state as host values: one host read once a device holds it."""
        if self.device is None:
            return self.host
        scale, counters = unpack(self.device.packed().tolist())
        return ScalerState(policy=self.host.policy, scale=scale, counters=counters)
