"""What happened at each step, told to whoever listens: stats, hooks, the log, the skip limit;
and the alarms that are not left to listeners: the floor warning, the error for gradients that
stay non-finite there, the warning for a long streak of non-finite losses.

Invariant: reporting adds no host synchronisation to a step, but the alarms' while a streak of
skipped steps is under way. The numbers live on the device (`DeviceState`); after each `update()`
they are packed into one small tensor and copied to the host.
On the CPU that copy is the read. On a GPU it is started without waiting (into pinned memory from
torch's caching host allocator, on the current stream of the state's own device, with an event
recorded there) and delivered at the next `update()` (or when
[`ShardedGradScaler.stats`][shardscale.ShardedGradScaler.stats] is read), by when the device has
long finished it: hooks, log lines and the `max_consecutive_skips` check then run one step late, and
cost no sync (the wait on the previous step's event lets the host run at most one step ahead while
someone listens).

Nobody listening (no hook, no limit, the `"shardscale"` logger below INFO) costs nothing but
the alarms' watch below.

The alarms watch two streaks the device counts (`Count.FLOOR_STREAK`, `Count.LOSS_STREAK`),
after every step whose outcome the host did not read (a plain step it read as clean ends both
streaks): on the CPU by reading them; on a GPU by a non-blocking copy read one `update()` later,
and, once that shows a streak under way, by reading them at each `update()` until it ends. So
every rank sees the same streaks at the same `update()`, where the alarm sounds (naming the
parameters takes one gather: every rank is there).
"""

from __future__ import annotations

import logging
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from enum import Enum

import torch
from torch.utils.hooks import RemovableHandle

from shardscale._bins import UNDERFLOW_TARGET
from shardscale._errors import ShardScaleNonFiniteError, ShardScaleSkipError, ShardScaleWarning
from shardscale._locate import LOSS, NonFiniteGrad, logger
from shardscale._policy import MIN_SCALE, ScalePolicy
from shardscale._state import PACKED_STREAKS, Count, Counters, DeviceState, unpack

# The meter's log line, above its target (logging's %-arguments: formatted only when logged).
_UNDERFLOW_MESSAGE = "step %d: %.3g%% of the non-zero gradient elements were below fp16's normal "
_UNDERFLOW_MESSAGE += "range (2^-14) at its scale; from a scale of %g, at most %g%% would be"

# At most one skipped-step message per this many seconds; the next one counts the rest.
LOG_INTERVAL_S = 10.0
# Consecutive forward overflows (non-finite losses) that make a streak worth a warning.
LOSS_STREAK_WARNING = 8
# Located records a message names (the rest are counted).
_NAMED = 8


class Alarm(Enum):
    """What a watched streak says (`StepReporter.watch`)."""

    AT_FLOOR = "the first gradient overflow that left the scale at its floor: a warning"
    STUCK = "max_overflows_at_floor gradient overflows in a row there: the error"
    LOSS_STREAK = "LOSS_STREAK_WARNING non-finite losses in a row: a warning, once a streak"


# Device types whose stats are copied without waiting, under a CUDA event. "meta" is the CPU
# suite's stand-in for a GPU (its tests replace torch.cuda's events and streams with recorders),
# so that this path runs in CI; other accelerators read at once (correct, one sync per update).
_EVENT_DEVICE_TYPES = frozenset({"cuda", "meta"})


@dataclass(frozen=True, slots=True)
class ScalerStats:
    """The scaler's counters after a step: identical on every rank of the group."""

    steps: int
    """Steps counted so far (`update()` calls that consumed an overflow check)."""
    skipped_steps: int
    """Of those, the steps skipped because some rank overflowed."""
    consecutive_skips: int
    """Skipped steps since the last step taken."""
    scale: float
    """The scale now (after the step's `update()`)."""
    last_overflow_step: int
    """The number (1-based) of the last skipped step; 0 if none was."""
    forward_overflows: int = 0
    """Of the skipped steps, those whose loss itself was non-finite on some rank (a forward
    overflow: the scale was held, not backed off)."""
    retries: int = 0
    """Batches run again by `step(closure=...)` after their gradients overflowed."""
    underflow: float = 0.0
    """The meter's last reading: the fraction of non-zero gradient elements below 2^-14."""
    underflow_scale: float = 0.0
    """The lowest scale at which at most 0.1% of them would have been below 2^-14."""
    underflow_step: int = 0
    """The step of that reading (0: none yet; `underflow_every`, docs/observability.md)."""

    @property
    def last_step_skipped(self) -> bool:
        """Whether step number `steps` was skipped."""
        return self.steps > 0 and self.last_overflow_step == self.steps


def stats_of(scale: float, counters: Counters, meter: Sequence[float] = (0, 0, 0)) -> ScalerStats:
    """Stats from host values (`meter`: `DeviceState.meter`'s)."""
    step, fraction, fitted = meter
    counted = asdict(counters) | {"underflow_step": int(step)}
    return ScalerStats(scale=scale, underflow=fraction, underflow_scale=fitted, **counted)


def stats_from(values: list[float]) -> ScalerStats:
    """Stats from `DeviceState.packed()`'s values, read on the host."""
    scale, counters = unpack(values)
    return stats_of(scale.scale, counters, values[-3:])


StatsHook = Callable[[ScalerStats], None]


class StepReporter:
    """Delivers each step's stats to hooks, the log and the consecutive-skip limit."""

    def __init__(
        self, max_consecutive_skips: int | None, max_overflows_at_floor: int | None = None
    ) -> None:
        self.max_consecutive_skips = max_consecutive_skips
        self.max_overflows_at_floor = max_overflows_at_floor
        # The stats hooks, by handle id. An OrderedDict: RemovableHandle holds a weak reference
        # to it, which a dict refuses.
        self.hooks: OrderedDict[int, StatsHook] = OrderedDict()
        # The step whose copy is in flight (delivered at the next push or flush): its buffer,
        # event, and whether it holds the packed state (someone listens) or the streaks alone.
        self._pending: tuple[torch.Tensor, torch.cuda.Event, bool] | None = None
        self._last_logged = -float("inf")
        self._unlogged_skips = 0
        # The forward overflows counted so far (delivered, or loaded): a step that adds one was
        # skipped for its loss, not its gradients.
        self._forward_overflows = 0
        # The alarms: whether the last reading showed a streak under way (then the streaks are
        # read at each update until it ends), its floor streak, and what was already told.
        self._streaking = False
        self._floor_streak = 0
        self._warned_at_floor = False
        self._warned_loss_streak = False

    def restart(self, counters: Counters) -> None:
        """A state was loaded: forget the step in flight, count from `counters`."""
        self._pending = None
        self._streaking = False
        self._forward_overflows = counters.forward_overflows

    def register(self, hook: StatsHook) -> RemovableHandle:
        handle = RemovableHandle(self.hooks)
        self.hooks[handle.id] = hook
        return handle

    def push(self, state: DeviceState, policy: ScalePolicy, watch: bool) -> Alarm | None:
        """Take one step's state: its stats go to whoever listens, now (CPU) or at the next
        push/flush; and where `watch` (a step whose outcome the host did not read), return the
        alarm its streaks sound now, if any (module docstring).

        One copy is in flight at a time: the packed state when someone listens, else the two
        streaks alone; with nobody listening and nothing to watch, an update pays nothing here.
        Nothing runs while a CUDA graph captures the step (its replays run without the host; the
        device counts the streaks all the same).
        """
        capturing = torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()  # type: ignore[no-untyped-call]
        listening = self.hooks or self.max_consecutive_skips is not None
        listening = bool(listening or logger.isEnabledFor(logging.INFO))
        if capturing or not (listening or watch):
            self._pending = None
            return None
        streaks = state.counters[Count.FLOOR_STREAK :]
        if streaks.device.type not in _EVENT_DEVICE_TYPES:
            # The CPU (where the copy is the read), or an accelerator without CUDA's events,
            # whose non-blocking copy nothing could wait for: read now.
            if listening:
                self._deliver(stats_from(state.packed().tolist()))
            return self._alarm(streaks.tolist(), policy) if watch else None
        seen = self.flush()  # the last step's streaks, one update late: the alarms' trigger
        alarm = None
        if watch and (self._streaking or any(seen or ())):
            alarm = self._alarm(streaks.tolist(), policy)  # a streak under way: read it now
        copied = state.packed() if listening else streaks
        # Pinned, so the copy runs without the host (torch's caching host allocator keeps the
        # few small blocks this takes, in turn, from one step to the next).
        host = torch.empty(copied.shape, dtype=copied.dtype, pin_memory=True)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        # On the stream of the copied tensor's OWN device, not the current device's (which, on
        # the async scaler's optimizer thread or without torch.cuda.set_device, is another
        # GPU's): the copy and the event that covers it must be on the same stream.
        with torch.cuda.device(copied.device):
            host.copy_(copied, non_blocking=True)
            event.record(torch.cuda.current_stream(copied.device))
        self._pending = (host, event, listening)
        return alarm

    def flush(self) -> list[float] | None:
        """Deliver the step still in flight, if any (waits for its copy): its stats to whoever
        listens, where it holds them. Returns its streaks (None: nothing was in flight)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        host, event, packed = pending
        event.synchronize()  # recorded a step ago: normally long complete
        values = host.tolist()
        if not packed:
            return values
        self._deliver(stats_from(values))
        return values[PACKED_STREAKS]

    def _alarm(self, streaks: list[float], policy: ScalePolicy) -> Alarm | None:
        """The alarm the streaks `[floor, loss]` (read now) sound, if any; each warning once
        (the loss streak's once a streak)."""
        floor, losses = map(int, streaks)
        self._streaking, self._floor_streak = bool(floor or losses), floor
        self._warned_loss_streak &= losses >= LOSS_STREAK_WARNING
        limit = self.max_overflows_at_floor
        if limit is not None and floor >= limit:
            return Alarm.STUCK
        if floor and policy.dynamic and not self._warned_at_floor:
            self._warned_at_floor = True
            return Alarm.AT_FLOOR
        if losses >= LOSS_STREAK_WARNING and not self._warned_loss_streak:
            self._warned_loss_streak = True
            return Alarm.LOSS_STREAK
        return None

    def _deliver(self, stats: ScalerStats) -> None:
        forward = stats.forward_overflows > self._forward_overflows
        self._forward_overflows = stats.forward_overflows
        if stats.last_step_skipped:
            self._log_skip(stats, forward)
        if stats.underflow_step == stats.steps and stats.underflow > UNDERFLOW_TARGET:
            values = (stats.steps, 100 * stats.underflow, stats.underflow_scale)
            logger.info(_UNDERFLOW_MESSAGE, *values, 100 * UNDERFLOW_TARGET)
        for hook in list(self.hooks.values()):
            hook(stats)
        limit = self.max_consecutive_skips
        if limit is not None and stats.consecutive_skips > limit:
            raise ShardScaleSkipError(
                f"step {stats.steps}: {stats.consecutive_skips} consecutive steps skipped for "
                f"inf/NaN gradients or losses ({stats.forward_overflows} forward overflow(s) in "
                f"all), more than max_consecutive_skips={limit}; the scale is {stats.scale:g}. A "
                "scale that stays small while steps keep overflowing, or a loss that is itself "
                "inf/NaN, usually means the model or the loss produces inf/NaN by itself (try "
                "locate_overflow=True to see which parameters, and which ranks' losses)."
            )

    def _log_skip(self, stats: ScalerStats, forward: bool) -> None:
        if not logger.isEnabledFor(logging.INFO):
            return
        now = time.monotonic()
        if now - self._last_logged < LOG_INTERVAL_S:
            self._unlogged_skips += 1
            return
        more = f" ({self._unlogged_skips} more skipped step(s) since the last message)"
        cause = (
            "the loss itself was non-finite on some rank (a forward overflow: loss scaling "
            "cannot fix it; the scale is held)"
            if forward
            else "inf/NaN gradients on some rank"
        )
        logger.info(
            "step %d skipped: %s; scale now %g, %d consecutive skip(s), %d of %d steps skipped%s",
            stats.steps,
            cause,
            stats.scale,
            stats.consecutive_skips,
            stats.skipped_steps,
            stats.steps,
            more if self._unlogged_skips else "",
        )
        self._last_logged = now
        self._unlogged_skips = 0

    def sound(
        self, alarm: Alarm, located: list[NonFiniteGrad], step: int, policy: ScalePolicy
    ) -> None:
        """Warn, or raise, for `alarm` at `step`, from what `located` found (every rank's).

        Raises:
            ShardScaleNonFiniteError: `Alarm.STUCK`, on every rank alike.
        """
        grads = [record for record in located if record.name != LOSS]
        where = "; ".join(map(str, grads[:_NAMED])) or "none left to name"
        if len(grads) > _NAMED:
            where += f"; and {len(grads) - _NAMED} more"
        nans = sum(record.num_nan for record in grads)
        if alarm is Alarm.LOSS_STREAK:
            ranks = sorted({record.rank for record in located if record.name == LOSS})
            warnings.warn(_loss_streak_message(step, ranks), ShardScaleWarning, stacklevel=3)
        elif alarm is Alarm.AT_FLOOR:
            message = f"step {step}: the loss scale has backed off to min_scale={policy.min_scale}"
            message += (
                f" and cannot go lower, and the gradients still overflow. {_why(nans, policy)}"
            )
            message += f" Non-finite at: {where}."
            warnings.warn(message, ShardScaleWarning, stacklevel=3)
        else:
            message = _stuck_message(step, policy, nans, where, self._floor_streak)
            raise ShardScaleNonFiniteError(message)


def _why(nans: int, policy: ScalePolicy) -> str:
    """What non-finite gradients under a finite loss at the floor mean."""
    if nans:
        return (
            f"{nans} gradient element(s) are NaN: no overflow at a scale this low explains a "
            "NaN, so look for a bug (uninitialised memory, a backward kernel, a 0/0 or inf-inf "
            "in the model)."
        )
    if not policy.dynamic:
        return "They are inf, under a finite loss: they exceed their dtype's range."
    if policy.min_scale <= MIN_SCALE:
        return (
            "They are inf, under a finite loss, at a scale too low for any fp16 overflow: look "
            "for a bug (a division by zero, an inf in the model or the data)."
        )
    return (
        "They are inf, under a finite loss: they exceed fp16's range even at this scale. Lower "
        "min_scale (its default is 2**-24), or make the loss smaller (a mean over tokens "
        "rather than a sum)."
    )


def _stuck_message(step: int, policy: ScalePolicy, nans: int, where: str, steps: int) -> str:
    """`ShardScaleNonFiniteError`'s message (`StepReporter.sound`)."""
    at = f"with the scale fixed (dynamic=False), at {steps} consecutive steps"
    if policy.dynamic:
        at = (
            f"at {steps} consecutive steps at min_scale={policy.min_scale}, the lowest scale "
            "the policy may take, after backing off through every scale above it"
        )
    return (
        f"step {step}: the gradients stayed non-finite, under a finite loss, {at}: overflow "
        f"no longer explains them. {_why(nans, policy)} Non-finite at: {where}. Nothing "
        "was written into the weights: every one of those steps was skipped. To skip such "
        "steps forever instead (torch's scaler's behaviour), pass max_overflows_at_floor=None."
    )


def _loss_streak_message(step: int, ranks: list[int]) -> str:
    """The loss streak's warning (`StepReporter.sound`)."""
    return (
        f"step {step}: the loss itself was non-finite at the last {LOSS_STREAK_WARNING} or more "
        f"consecutive steps (forward overflows: each skipped, the scale held), at this step on "
        f"rank(s) {ranks}. No loss scale fixes a non-finite loss: look at those ranks' data "
        "and forward pass (locate_overflow=True logs where at each overflow step). The run "
        "goes on skipping; max_consecutive_skips=N stops it after N skipped steps."
    )
