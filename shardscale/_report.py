"""What happened at each step, told to whoever listens: stats, hooks, the log; and the alarms,
which are not left to listeners: the floor warning, the error for gradients that stay
non-finite there, the skip limit's error, the warning for a long streak of non-finite losses.

Invariant: what one rank observes never changes what it communicates. Who listens (a hook on
rank 0 only, the log level, reading `stats`) changes only what this rank is told, and when;
the alarms, which gather where the non-finite values are (a collective), sound at the same
`update()` on every rank, because they follow only what the ranks agreed.

The stats: the numbers live on the device (`DeviceState`); after an `update()` that someone
listens to they are packed into one small tensor and read. On the CPU the copy is the read.
Where the state is read late (CUDA: `shardscale._state.DevicePath`) the copy is started without
waiting and delivered at the next `update()` (or when
[`ShardedGradScaler.stats`][shardscale.ShardedGradScaler.stats] is read), by when the device has
long finished it: hooks and log lines run one step late, and cost no sync (the wait on the
previous step's copy lets the host run at most one step ahead while someone listens). Nobody
listening (no hook, the `"shardscale"` logger below INFO) costs nothing but the alarms' watch.

The alarms watch three streaks the device counts (`Count.FLOOR_STREAK`, `Count.LOSS_STREAK`
and, with `max_consecutive_skips`, `Count.CONSECUTIVE`) after every step whose outcome the
host did not read (a plain step it read as clean ends them all): on the CPU by reading them;
read late, by a non-blocking copy read one `update()` later, and, once that shows a streak
under way, by reading them at each `update()` until it ends. Whether a step is watched, which
step a copy belongs to, and what the device counted are the same on every rank; a listener
neither makes nor consumes the alarms' copy. So every rank sees the same streaks at the same
`update()`, where the alarm sounds (naming the parameters takes one gather: every rank is there).
"""

from __future__ import annotations

import logging
import math
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

import torch
from torch.utils.hooks import RemovableHandle

from shardscale._bins import UNDERFLOW_TARGET
from shardscale._errors import (
    ShardScaleMismatchError,
    ShardScaleNonFiniteError,
    ShardScaleSkipError,
    ShardScaleWarning,
)
from shardscale._locate import LOSS, NonFiniteGrad, logger
from shardscale._policy import MIN_SCALE, ScalePolicy
from shardscale._state import (
    COUNTERS,
    PACKED_COUNTERS,
    Count,
    Counters,
    DeviceState,
    Landing,
    device_path,
    unpack,
)

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
    """What a watched streak says (`StepReporter.after_update`)."""

    AT_FLOOR = "the first gradient overflow that left the scale at its floor: a warning"
    STUCK = "max_overflows_at_floor gradient overflows in a row there: the error"
    SKIP_LIMIT = "more than max_consecutive_skips skipped steps in a row: the error"
    LOSS_STREAK = "LOSS_STREAK_WARNING non-finite losses in a row: a warning, once a streak"
    MISMATCH = "a collective whose identity said the ranks differ, on an accelerator: the error"


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
    underflow: float | None = None
    """The meter's last reading: the fraction of non-zero gradient elements below 2^-14. None:
    never measured (`underflow_every=0`, none of its steps yet, or each one it could not read:
    an inf-norm clip, CUDA's deterministic mode)."""
    underflow_scale: float | None = None
    """The lowest scale at which at most 0.1% of them would have been below 2^-14 (None: no
    reading, or a reading without a counted element)."""
    underflow_step: int | None = None
    """The step of that reading (None: none yet; `underflow_every`, docs/observability.md)."""

    @property
    def last_step_skipped(self) -> bool:
        """Whether step number `steps` was skipped."""
        return self.steps > 0 and self.last_overflow_step == self.steps


def stats_of(scale: float, counters: Counters, meter: Sequence[float] = (0, 0, 0)) -> ScalerStats:
    """Stats from host values (`meter`: `DeviceState.meter`'s; a step of 0: never read)."""
    step, fraction, fitted = meter
    if not step:
        return ScalerStats(scale=scale, **counters.step_counts())
    return ScalerStats(
        scale=scale,
        underflow=fraction,
        underflow_scale=None if math.isnan(fitted) else fitted,
        underflow_step=int(step),
        **counters.step_counts(),
    )


def stats_from(values: list[float]) -> ScalerStats:
    """Stats from `DeviceState.packed()`'s values, read on the host."""
    scale, counters = unpack(values)
    return stats_of(scale.scale, counters, values[-3:])


StatsHook = Callable[[ScalerStats], None]


class StepReporter:
    """Delivers each step's stats to whoever listens (hooks, the log), and watches the streaks
    that sound the alarms (the module docstring).

    The two are kept apart, so that what one rank observes never changes what it communicates:
    who listens is this rank's business (a hook on rank 0 only, its log level, reading
    `stats`), and changes only when and what it is told; when an alarm sounds (and gathers
    where the non-finite values are) depends only on what every rank agreed: the step numbers,
    whether the host read a step's outcome, and the streaks the device counted.
    """

    def __init__(
        self, max_consecutive_skips: int | None, max_overflows_at_floor: int | None = None
    ) -> None:
        self.max_consecutive_skips = max_consecutive_skips
        self.max_overflows_at_floor = max_overflows_at_floor
        # The stats hooks, by handle id. An OrderedDict: RemovableHandle holds a weak reference
        # to it, which a dict refuses.
        self.hooks: OrderedDict[int, StatsHook] = OrderedDict()
        # The packed state copied at the last update for the listeners, delivered at the next
        # update or `stats` read (where the state is read late).
        self._stats: Landing | None = None
        # The alarms' trigger where the state is read late: (the step, its copy, where the
        # counters start in it), copied at a watched update for the next one. Never consumed
        # by a listener: a `stats` read delivers the stats, and the trigger stays.
        self._trigger: tuple[int, Landing, int] | None = None
        # The last step whose streaks were read and showed one under way (None: none): the
        # next watched update reads them too.
        self._streak_at: int | None = None
        # What the last reading said, for the alarms' messages; what was already told.
        self._read: list[int] = [0] * COUNTERS
        self._warned_at_floor = False
        self._warned_loss_streak_from = 0  # the first step of the loss streak warned about
        self._last_logged = -float("inf")
        self._unlogged_skips = 0
        # The forward overflows counted so far (delivered, or loaded): a step that adds one was
        # skipped for its loss, not its gradients.
        self._forward_overflows = 0
        self.failures: list[str] = []
        """The listeners' failures not said yet (`warn_failures` says them)."""
        self.lock = threading.RLock()
        """Held while an update moves the state and tells of it, and while `stats` is read: a
        thread reading `stats` (docs/reliability.md) sees one step's numbers whole, and takes
        the stats in flight at most once. Reentrant: a hook may read `stats`."""

    def restart(self, counters: Counters) -> None:
        """A state was loaded: forget the copies in flight; watch the streaks from `counters`,
        as a rank that holds them without loading does (its copy of the last step's, landed),
        so that every rank that holds the same state sounds its alarms at the same update."""
        self._stats = None
        values = [float(value) for value in counters.by_count()]
        self._trigger = (counters.steps, Landing(torch.tensor(values), lambda: None), 0)
        self._streak_at = counters.steps if self._streaking(values) else None
        self._read = [int(value) for value in values]
        self._forward_overflows = counters.forward_overflows
        self._unlogged_skips = 0

    def register(self, hook: StatsHook) -> RemovableHandle:
        handle = RemovableHandle(self.hooks)
        self.hooks[handle.id] = hook
        return handle

    def listening(self) -> bool:
        """Whether anybody on this rank is told the stats: a hook, or the log at INFO."""
        return bool(self.hooks) or logger.isEnabledFor(logging.INFO)

    def after_update(
        self, state: DeviceState, policy: ScalePolicy, step: int, read: bool | None
    ) -> Alarm | None:
        """Take step `step`'s state, just updated: its stats go to whoever listens, now or (read
        late) at the next update or `stats` read; and where the step is watched, return the
        alarm its streaks sound now, if any. `read`: what the host read of the step's outcome
        (False: clean, which ends every streak, so nothing is watched; True: skipped; None:
        not read, a fused step's); the same on every rank.

        Read late, the streaks are read at once where the host saw the step skipped (it has
        waited for the device already) or the step before showed a streak under way (its copy,
        or a reading); else this step's travel in a copy for the next one: one non-blocking
        copy an update at most, for the listeners and the alarms together. Nothing runs while a
        CUDA graph captures the step (its replays run without the host; the device counts the
        streaks all the same).
        """
        path, device, watch = device_path(), state.scale.device, read is not False
        if path.capturing(device):
            self._stats = self._trigger = None
            return None
        listening = self.listening()
        if not path.reads_late(device):  # the CPU, where the copy is the read
            if listening:
                self._deliver(stats_from(state.packed().tolist()))
            return self._alarm(state.counters.tolist(), policy, step) if watch else None
        self.flush()
        alarm, before = None, self._counters_before(step) if watch else None
        under_way = self._streak_at == step - 1 or self._streaking(before or ())
        read_now = read is True or (watch and under_way)
        if read_now:
            alarm = self._alarm(state.counters.tolist(), policy, step, before)
        copy = path.copy_late(state.packed()) if listening else None
        self._stats = copy
        if watch and not read_now:
            trigger = (copy, PACKED_COUNTERS) if copy is not None else None
            landing, start = trigger or (path.copy_late(state.counters), 0)
            self._trigger = (step, landing, start)
        return alarm

    def flush(self) -> None:
        """Deliver the stats still on their way, if any (waits for their copy): to the hooks
        and the log. The alarms' trigger stays as it is."""
        with self.lock:
            landing, self._stats = self._stats, None
            if landing is not None:
                self._deliver(stats_from(landing.values()))

    def _counters_before(self, step: int) -> list[float] | None:
        """The counters of the step before `step`, from its copy (which this waits for: copied
        an update ago, normally long landed); None where it made none (its outcome was read:
        clean, which ended every streak, or a streak's, read at once)."""
        if self._trigger is None or self._trigger[0] != step - 1:
            return None
        _, landing, start = self._trigger
        return landing.values()[start : start + COUNTERS]

    def _streaking(self, counters: Sequence[float]) -> bool:
        """Whether `counters` show a streak an alarm watches: gradients overflowing at the
        floor, losses non-finite, or skipped steps where a limit counts them."""
        if not counters:
            return False
        skips = self.max_consecutive_skips is not None and counters[Count.CONSECUTIVE] > 0
        streaks = counters[Count.FLOOR_STREAK] or counters[Count.LOSS_STREAK]
        return bool(streaks or counters[Count.MISMATCH] or skips)

    def _alarm(
        self,
        counters: Sequence[float],
        policy: ScalePolicy,
        step: int,
        before: Sequence[float] | None = None,
    ) -> Alarm | None:
        """The alarm step `step`'s counters (read now) sound, if any; each warning once (the
        loss streak's once a streak). `before`: the step before's, seen in its copy, where an
        overflow at the floor may show that a streak of one, over by now, cannot."""
        self._read = read = [int(count) for count in counters]
        if self._streaking(read):
            self._streak_at = step
        floor, losses = read[Count.FLOOR_STREAK], read[Count.LOSS_STREAK]
        limit, skips = self.max_overflows_at_floor, self.max_consecutive_skips
        if limit is not None and floor >= limit:
            return Alarm.STUCK
        if read[Count.MISMATCH]:
            return Alarm.MISMATCH
        if skips is not None and read[Count.CONSECUTIVE] > skips:
            return Alarm.SKIP_LIMIT
        floor = floor or int(before[Count.FLOOR_STREAK] if before else 0)
        if floor and policy.dynamic and not self._warned_at_floor:
            self._warned_at_floor = True
            return Alarm.AT_FLOOR
        started = step - losses + 1  # the streak's first step: one warning per streak
        if losses >= LOSS_STREAK_WARNING and started != self._warned_loss_streak_from:
            self._warned_loss_streak_from = started
            return Alarm.LOSS_STREAK
        return None

    def _deliver(self, stats: ScalerStats) -> None:
        forward = stats.forward_overflows > self._forward_overflows
        self._forward_overflows = stats.forward_overflows
        if stats.last_step_skipped:
            self._log_skip(stats, forward)
        fraction = stats.underflow if stats.underflow_step == stats.steps else None
        if fraction is not None and fraction > UNDERFLOW_TARGET:
            values = (stats.steps, 100 * fraction, stats.underflow_scale)
            logger.info(_UNDERFLOW_MESSAGE, *values, 100 * UNDERFLOW_TARGET)
        for hook in list(self.hooks.values()):
            try:
                hook(stats)
            except Exception as error:  # a listener's failure is its own: said, not raised
                self.failures.append(_hook_failed_message(hook, stats, error))

    def warn_failures(self) -> None:
        """Say the listeners' failures since the last time, each once: called where the
        iteration is closed and every collective of the call is behind (where warnings are
        errors, this rank raises then, and goes on like its peers)."""
        failures, self.failures = self.failures, []
        for message in failures:
            warnings.warn(message, ShardScaleWarning, stacklevel=3)

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
        self,
        alarm: Alarm,
        located: list[NonFiniteGrad],
        step: int,
        policy: ScalePolicy,
        scale: float,
    ) -> None:
        """Warn, or raise, for `alarm` at `step`, from what `located` found (every rank's) and
        the last reading; `scale` is the scale now, for the skip limit's message.

        Raises:
            ShardScaleNonFiniteError: `Alarm.STUCK`, on every rank alike.
            ShardScaleSkipError: `Alarm.SKIP_LIMIT`, on every rank alike.
            ShardScaleMismatchError: `Alarm.MISMATCH`, on every rank alike.
        """
        if alarm is Alarm.MISMATCH:
            raise ShardScaleMismatchError(
                f"step {step}: at a collective of this step or the one before, the ranks met "
                "with different calls or different scaler states (the ballot's identity "
                "differed; on an accelerator it is read at the update, not at the collective). "
                "Every step since was skipped on every rank. Every rank must make the same "
                "calls to the scaler in the same order, and load the same state."
            )
        grads = [record for record in located if record.name != LOSS]
        where = "; ".join(map(str, grads[:_NAMED])) or "none left (cleared before this update)"
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
        elif alarm is Alarm.SKIP_LIMIT:
            read, limit = self._read, self.max_consecutive_skips
            raise ShardScaleSkipError(_skip_limit_message(step, read, limit, scale, where))
        else:
            floor = self._read[Count.FLOOR_STREAK]
            raise ShardScaleNonFiniteError(_stuck_message(step, policy, nans, where, floor))


def _hook_failed_message(hook: StatsHook, stats: ScalerStats, error: Exception) -> str:
    """The warning for a stats hook that raised: it is said, never re-raised (`_deliver`)."""
    name = getattr(hook, "__qualname__", None) or repr(hook)
    return (
        f"step {stats.steps}: the stats hook {name} raised {type(error).__name__}: {error}. "
        "The step is complete and the scaler goes on: a listener observes, and its failure "
        "(on this rank alone, say an unreachable metrics backend) must not change what this "
        "rank does next, or its peers would wait for it. The other hooks ran; this one stays "
        "registered (remove it with the handle register_stats_hook returned)."
    )


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


def _skip_limit_message(
    step: int, read: list[int], limit: int | None, scale: float, where: str
) -> str:
    """`ShardScaleSkipError`'s message for `max_consecutive_skips` (`StepReporter.sound`)."""
    consecutive, forward = read[Count.CONSECUTIVE], read[Count.FORWARD_OVERFLOWS]
    return (
        f"step {step}: {consecutive} consecutive steps skipped for inf/NaN gradients or losses "
        f"({forward} forward overflow(s) in all), more than max_consecutive_skips={limit}; the "
        f"scale is {scale:g}. Non-finite at: {where}. A scale that stays small while steps keep "
        "overflowing, or a loss that is itself inf/NaN, usually means the model or the loss "
        "produces inf/NaN by itself (locate_overflow=True logs where at each overflow step)."
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
