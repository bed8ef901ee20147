"""ShardedGradScaler: torch's loss-scaling protocol, with every rank of the group agreeing.

Invariant: after `step()` every rank of the process group has made the same skip/step
decision for its optimizers, and after `update()` every rank holds the same scale, trackers
and counters. That holds because each rank checks its own gradient shards and the ranks then
share ONE flag tensor in ONE all-reduce per step; everything after that (the skip decision, the
policy maths) is a deterministic function of the agreed flags.

One step, as the code runs it: `scale()` multiplies the loss by a copy of the scale and notes on
the device whether the loss is finite; `step()` hands the optimizer to the scaler's
[`Steps`][shardscale._stepping.Steps], the one room of a step's bookkeeping: it records the
optimizer in the iteration's [`IterationBook`][shardscale._stepping.IterationBook], hands the
gradients still to check to the [`Agreement`][shardscale._check.Agreement] (which walks them and
checks and unscales them in one fused pass per (device, dtype), `shardscale._grads`, fills its
ballot and agrees in the one collective, `shardscale._check`, which `shardscale._exchange` issues,
bounded), then steps or skips as agreed; `update()` counts the step and moves the scale on the
device (`shardscale._state`, by the policy of `shardscale._policy`) and tells whoever listens
(`shardscale._report`, entered where there is something to tell). `clip_grad_norm_()` is
`shardscale._clip`'s, which agrees through the same ballot.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from typing import Any, overload

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.hooks import RemovableHandle

from shardscale import _compat
from shardscale._check import Agreement
from shardscale._checkpoint import parse_state_dict, state_numbers, to_state_dict
from shardscale._clip import Clipping
from shardscale._config import DEFAULT, ScalerConfig, warn_unused_by_the_fit
from shardscale._errors import GRAD_SCALER_WARNING, ShardScaleWarning
from shardscale._exchange import Exchange
from shardscale._grads import move
from shardscale._locate import NonFiniteGrad
from shardscale._policy import ScalePolicy
from shardscale._report import (
    Alarm,
    ScalerStats,
    StatsHook,
    StepReporter,
    stats_from,
    stats_of,
)
from shardscale._state import Counters, ScaleHome, ScalerState
from shardscale._stepping import OptimizerTarget, Steps, leaves

__all__ = ["ShardedGradScaler"]

_DISABLED_HOOK = (
    "register_stats_hook() on a disabled scaler: it counts no step, so the hook never runs"
)


class ShardedGradScaler(torch.amp.GradScaler):
    """Loss scaler for sharded mixed-precision training whose ranks always agree.

    A drop-in for `torch.amp.GradScaler` and
    `torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler`, with the same methods,
    call-order errors and state-dict keys. It is a `torch.amp.GradScaler` (scripts guard
    resume and clipping with that `isinstance`), built without torch's `__init__`: every
    public method and attribute of torch's class is defined here, on our state, and the
    private members public code reads (`_per_optimizer_states`, `_found_inf_per_device`,
    `_scale` ...), set on the class from `shardscale._compat`, answer with the agreed state
    (between `unscale_()` and the call that agrees on it, this rank's own flag, with a warning;
    docs/migration.md lists them).

    Each rank checks its local gradient shards (plain, DDP, FSDP1 flat parameters,
    FSDP2/DTensor, CPU-offloaded, sparse) for inf/NaN, and the ranks agree in one all-reduce
    per step, so every rank skips or steps together. A loss that is itself inf/NaN (a forward
    overflow) is told apart: that step is skipped with the scale held. With no initialised
    process group, or a world size of 1, it issues no collective and behaves like
    `torch.amp.GradScaler`.

    Example:
        ```python
        scaler = ShardedGradScaler()
        for inputs, targets in loader:
            optimizer.zero_grad()
            with torch.autocast(device_type, dtype=torch.float16):
                loss = loss_fn(model(inputs), targets)
            scaler.scale(loss).backward()
            scaler.step(optimizer)          # skipped on every rank if any rank overflowed
            scaler.update()
            if scaler.last_step_skipped:
                ...
        ```

    The settings a checkpoint also holds (`growth_factor`, `backoff_factor`, `growth_interval`,
    `hysteresis`, `min_scale`, `max_scale`, `dynamic`, `scale_policy`) default to `<default>`,
    which stands for the value each one's entry names: a setting passed, even at its default's
    value, is recorded as passed. On [`load_state_dict()`][load_state_dict] shardscale's
    settings passed stay this scaler's, and those left out take the checkpoint's; torch's
    three are the checkpoint's, as torch's scalers load them.

    Args:
        device: device type of the loss (`"cuda"`, `"cpu"`, ...). None (the default) takes it from
            the first tensor passed to [`scale()`][scale], so one script runs on CPU and GPU. As
            torch does, `"cuda"` without CUDA warns and disables the scaler.
        init_scale: the first step's scale. Default `2.0**16`, or 1.0 when `dynamic=False`.
        growth_factor: multiplies the scale after `growth_interval` clean steps (> 1).
            Default 2.0.
        backoff_factor: multiplies the scale on an overflow (in (0, 1)). Default 0.5.
        growth_interval: consecutive clean steps before the scale grows (>= 1). Default 2000.
        enabled: False makes every method a no-op and [`step()`][step] a plain `optimizer.step()`.
        process_group: the ranks that must agree. None: the default (world) group.
        hysteresis: overflows tolerated before backing off, replenished on growth (Megatron,
            DeepSpeed). 1, the default, backs off at every overflow, as torch does.
        min_scale: the floor (> 0), so the scale can never collapse to 0 (torch's does, under a
            persistent NaN). Default 2**-24, fp16's smallest subnormal: the scale goes below 1
            where the gradients need it (a loss summed over tokens), as torch's does; Megatron's
            floor is 1.0. Reaching it warns once, saying whether the gradients hold NaN (a bug)
            or inf (beyond fp16's range at this floor); steps that overflow there are skipped
            and the scale holds, up to `max_overflows_at_floor`.
        max_scale: the ceiling for growth. None, the default: no ceiling.
        dynamic: False keeps the scale fixed (use `init_scale=1.0` as a bf16 guard): non-finite
            steps are still skipped on every rank together. Default True.
        sync_timeout: the longest the host waits (a `timedelta` or seconds) for the other ranks
            at the scaler's collectives on the CPU or gloo; a rank that never arrives then raises
            [`ShardScaleDistributedError`][shardscale.ShardScaleDistributedError] naming the step.
            None: the process group's own timeout. On NCCL the host never waits there: the
            process group's timeout (`init_process_group(timeout=...)`) bounds the collective,
            enforced by NCCL's watchdog (docs/reliability.md); `sync_timeout` warns there.
        verify_every: call
            [`verify_agreement()`][shardscale.ShardedGradScaler.verify_agreement] every N steps
            (one small collective and one host sync each time). 0, the default: never.
        max_consecutive_skips: raise [`ShardScaleSkipError`][shardscale.ShardScaleSkipError] on
            every rank, at the same `update()` (naming the step, the scale and where the
            non-finite values are), when more consecutive steps than this are skipped (forward
            overflows included), instead of skipping forever. None, the default: no limit. A
            streak of 8 non-finite losses warns once, naming the ranks, whatever this says.
        max_overflows_at_floor: raise
            [`ShardScaleNonFiniteError`][shardscale.ShardScaleNonFiniteError] on every rank, at
            the same `update()`, when this many consecutive steps' gradients were non-finite
            with the scale at `min_scale` (with `dynamic=False`: at its one value), where
            overflow no longer explains them; the message names the parameters (as
            `locate_overflow` does) and says NaN or inf. Those steps are skipped: nothing is
            written into the weights. A transient overflow never raises. Default 8; None: skip
            them forever, as torch's scaler does.
        locate_overflow: on steps that overflow, find which parameters hold the inf/NaN gradients on
            which rank (and, on a forward overflow, which ranks' losses were non-finite:
            [`find_nonfinite_grads()`][shardscale.find_nonfinite_grads]), keep the records in
            [`last_overflow`][shardscale.ShardedGradScaler.last_overflow] and log them (WARNING,
            logger `"shardscale"`). Clean steps pay one host read of the agreed flag (free after a
            plain step, which reads it anyway); an overflow step pays host reads and one gather
            of the records. Name the parameters by building the optimizer from
            `model.named_parameters()`.
        max_retries: with [`step(closure=...)`][step], how many times a batch whose gradients
            overflowed is run again at a backed-off scale before its step is skipped. Default 3.
        scale_policy: how a clean step moves the scale. `"interval"`, the default: torch's
            rule (grow by `growth_factor` after `growth_interval` clean steps). `"fit"`: to the
            largest scale that keeps the last 16 steps' largest gradient a learned margin below
            fp16's range, up or down, in one update; the gradients' largest magnitude travels
            in the same one collective (one more read pass over them); overflows still back off
            (and widen the margin, but a NaN's), and the floor, ceiling, hysteresis and
            forward-overflow hold apply as before (docs/scale-policies.md). It reads the
            gradients fp16 has to hold: those formed in fp16 (autocast casts a Linear's weight
            and bias to fp16; a LayerNorm's, an embedding's, a gain's form in fp32 and are not
            read: the graph is walked once), one backward at a time where micro-batches
            accumulate (docs/scale-policies.md, "Which gradients the fit reads").
        underflow_every: every this many steps, measure how much of the gradient sits below
            fp16's normal range at the current scale: [`stats`][stats] `underflow` (the fraction
            of the non-zero gradient elements whose scaled magnitude is below 2^-14: subnormal
            in fp16, or flushed to zero) and `underflow_scale` (the lowest scale at which at most
            0.1% would be), counted over every rank in the step's one collective, and logged
            (INFO) where above 0.1%. Four kernels per gradient tensor on those steps (five for
            fp16/bf16 ones, cast to float32 first), no host read (docs/observability.md, "How
            much of the gradient underflows"). 0: never. Default 100.

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: an argument is out of range; the message states the rule and the value.
    """

    def __init__(
        self,
        device: str | torch.device | None = None,
        *,
        init_scale: float | None = None,
        growth_factor: float = DEFAULT,
        backoff_factor: float = DEFAULT,
        growth_interval: int = DEFAULT,
        enabled: bool = True,
        process_group: dist.ProcessGroup | None = None,
        hysteresis: int = DEFAULT,
        min_scale: float = DEFAULT,
        max_scale: float | None = DEFAULT,
        dynamic: bool = DEFAULT,
        sync_timeout: timedelta | float | None = None,
        verify_every: int = 0,
        max_consecutive_skips: int | None = None,
        max_overflows_at_floor: int | None = 8,
        locate_overflow: bool = False,
        max_retries: int = 3,
        scale_policy: str = DEFAULT,
        underflow_every: int = 100,
    ) -> None:
        # every argument, by name: the config validates and normalises them
        config = ScalerConfig(**{name: value for name, value in locals().items() if name != "self"})
        if enabled and config.device == "cuda" and not torch.cuda.is_available():
            warnings.warn(
                "ShardedGradScaler(device='cuda') is enabled, but CUDA is not available. "
                "Disabling (as torch.amp.GradScaler does); leave device unset to follow the loss.",
                ShardScaleWarning,
                stacklevel=2,
            )
            enabled = False
        policy = config.policy()
        config.warn_unused()  # settings given that cannot move this scale: said, not silent
        state = ScalerState(policy, policy.initial_state(config.first_scale()), Counters())
        self._setup(config, enabled, state)

    def _setup(self, config: ScalerConfig, enabled: bool, state: ScalerState) -> None:
        """Build the scaler's parts (also for `__setstate__`, which bypasses `__init__`)."""
        self._config = config
        self._enabled = enabled
        # The state on the host until the first scale() (or step) puts it on a device.
        self._home = ScaleHome(state)
        # The one owner of the process group and its collectives: the agreement's exchange.
        exchange = Exchange(config.process_group, config.sync_timeout)
        self._agreement = Agreement(exchange, self._home, config)
        # The iterations' bookkeeping; the step number, counted on the host too (the device
        # counts the steps for replayed graphs), names the step in messages without a read.
        self._steps = Steps(self._agreement, self._home, config)
        self._clipping = Clipping(self._steps)
        self._torch_body = _compat.TorchBody(self._steps)
        self._reporter = StepReporter(config.max_consecutive_skips, config.max_overflows_at_floor)

    # ------------------------------------------------------------------ settings

    @property
    def policy(self) -> ScalePolicy:
        """The current scale policy (growth, backoff, hysteresis, floor, ceiling)."""
        return self._home.host.policy

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The group whose ranks agree (None: the default group)."""
        return self._agreement.exchange.process_group

    def is_enabled(self) -> bool:
        """Return whether this scaler scales and checks (False: every method is a no-op)."""
        return self._enabled

    def get_growth_factor(self) -> float:
        """Return the scale growth factor."""
        return self.policy.growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the scale growth factor (> 1); the fit does not use it (a warning says so)."""
        self._home.set_policy(growth_factor=new_factor)
        warn_unused_by_the_fit(self.policy, growth_factor=new_factor)

    def get_backoff_factor(self) -> float:
        """Return the scale backoff factor."""
        return self.policy.backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the scale backoff factor (in (0, 1))."""
        self._home.set_policy(backoff_factor=new_factor)

    def get_growth_interval(self) -> int:
        """Return the number of clean steps before the scale grows."""
        return self.policy.growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the number of clean steps before the scale grows (>= 1); the fit does not use it
        (a warning says so)."""
        self._home.set_policy(growth_interval=new_interval)
        warn_unused_by_the_fit(self.policy, growth_interval=new_interval)

    # ------------------------------------------------------------------ the iteration

    @overload
    def scale(self, outputs: torch.Tensor) -> torch.Tensor: ...

    @overload
    def scale(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]: ...

    @overload
    def scale(self, outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]: ...

    @overload
    def scale(self, outputs: Iterable[torch.Tensor]) -> Iterable[torch.Tensor]: ...

    def scale(self, outputs: torch.Tensor | Iterable[Any]) -> torch.Tensor | Iterable[Any]:
        """Multiply a loss (or nested lists/tuples of them) by the current scale.

        The result's dtype is torch's: the input's, but for a 0-dim fp16/bf16 loss, whose
        product with the float32 scale is float32 (torch's type promotion). Other iterables
        are scaled lazily, as torch does.
        Each loss is also checked, on the device, for inf/NaN (two small kernels, no host
        synchronisation): a step whose loss was non-finite on any rank is skipped on every rank
        with the scale held, since no scale can fix a forward overflow.

        Raises:
            TypeError: an output is not a floating-point tensor.
            ValueError: a tensor is on another device type than `device` named.
        """
        if not self._enabled:
            return outputs
        if not isinstance(outputs, torch.Tensor):
            return self._scale_iterable(outputs)
        if not outputs.is_floating_point():
            raise TypeError(f"scale() takes floating-point tensors, got dtype {outputs.dtype}")
        device_type = self._config.device
        if device_type is not None and outputs.device.type != device_type:
            raise ValueError(
                f"scale() got a tensor on {outputs.device}, but this scaler was built with "
                f"device={device_type!r}; pass the loss's device, or leave device unset"
            )
        loss_scale = self._steps.note_loss(outputs, fit=self.policy.fit)
        return outputs * move(loss_scale, outputs.device)

    def loss_scale_tensor(self, device: str | torch.device | None = None) -> torch.Tensor:
        """The scale this iteration's losses are multiplied by: a float32 scalar tensor, read
        without a host synchronisation.

        For a loss whose gradient enters the backward through a custom autograd function, not
        through `scale(loss)` (a MoE auxiliary loss, multi-token prediction: Megatron's
        `MoEAuxLossAutoScaler.set_loss_scale`): multiply that gradient by this tensor and it
        carries the main loss's scale, which [`step()`][step] divides out with the rest. It is
        the iteration's own copy, the one [`scale()`][scale] multiplies by (made now if no loss
        was scaled yet), so `update()` never changes it under a backward that saved it. A rank
        that calls it counts as one that scaled a loss (a pipeline stage whose MoE layers
        inject their auxiliary gradient).

        Args:
            device: where the tensor is wanted; None: where the scale lives (the first loss's
                device, or where `device` puts it the first time).

        Raises:
            ValueError: `device` is None and no loss was scaled yet on this rank (nothing says
                where the scale lives), or the scaler is disabled and `device` is None.
        """
        home = self._home.device
        where = home.scale.device if home is not None else device
        if where is None:
            raise ValueError(
                "loss_scale_tensor() needs device= before the first scale() on this rank: "
                "nothing says yet where the scale lives"
            )
        target = torch.device(device if device is not None else where)
        if not self._enabled:
            return torch.ones((), dtype=torch.float32, device=target)
        self._steps.book.carried = True
        return move(self._steps.iteration_scale(torch.device(where)), target)

    def _scale_iterable(self, outputs: Iterable[Any]) -> Iterable[Any]:
        """`scale()` of (nested) lists and tuples of tensors, and of other iterables, lazily."""
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(output) for output in outputs)
        if isinstance(outputs, (str, bytes, Mapping)) or not isinstance(outputs, Iterable):
            raise TypeError(
                "scale() takes a Tensor or a (nested) list/tuple of Tensors, got "
                f"{type(outputs).__name__}"
            )
        return map(self.scale, outputs)

    def unscale_(self, optimizer: OptimizerTarget) -> None:
        """Divide `optimizer`'s gradients by the scale in place, and check them for inf/NaN.

        Optional: [`step()`][step] unscales by itself. Call it to clip or inspect unscaled gradients
        between backward and [`step()`][step]. The check is local; the ranks agree on it at the next
        point that needs their decision or a global norm ([`step()`][step],
        [`clip_grad_norm_()`][clip_grad_norm_], [`update()`][update]), in that point's one
        collective, so `unscale_` + `clip_grad_norm_` + `step` cost one collective. Except on
        this scaler's first step: there it agrees at once (a pipeline stage that never scaled must
        learn that some rank did before it modifies gradients, and every rank must issue the same
        collectives), so that step costs one collective more. No host synchronisation.
        `optimizer` may be a list of optimizers, or a container of them (torchtitan's
        `OptimizersContainer`, Megatron's `ChainedOptimizer`).

        Raises:
            RuntimeError: called twice for this optimizer, or after [`step()`][step], before
                [`update()`][update]; or no rank holds a gradient for it.
        """
        if self._enabled:
            waiting = self._steps.unscale(optimizer)
            if waiting:  # fused optimizers torch's step body may step itself: they agree first
                self._torch_body.agree_first(waiting)

    def step(
        self,
        optimizer: OptimizerTarget,
        *args: Any,
        closure: Callable[[], Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Unscale (unless done), then run `optimizer.step()` unless any rank overflowed.

        Optimizers that take the scale themselves (`_step_supports_amp_scaling`: torch's
        `fused=True`) receive `grad_scale` and the agreed `found_inf` and skip on device,
        with no host synchronisation; others cost one host synchronisation for the decision.

        `optimizer` may also be a list of optimizers, or a container of them (torchtitan's
        `OptimizersContainer`: an `Optimizer` holding its parts in `optimizers`;
        Megatron's `ChainedOptimizer`: `chained_optimizers`): every optimizer underneath
        is checked in ONE collective, fused ones get the scale and the flag, and the
        container's own `step()` is called once. Stepping optimizers one call at a time
        costs one collective each, as torch's rules have it.

        With a `closure` (torch's convention: it zeroes the gradients, recomputes the loss,
        calls `scaler.scale(loss).backward()` and returns the loss), `step` runs it itself, and
        where the gradients (not the loss) overflowed on any rank it backs the scale off and
        runs it again, on every rank together, up to `max_retries` times: the optimizer steps
        once per batch, and no batch is dropped to a gradient overflow. Past the bound, at the
        floor, with `dynamic=False`, or for a forward overflow (no scale fixes that) the step
        is skipped as without a closure. It costs one host read of the agreed flags per
        attempt, fused optimizers included, and two more on an attempt whose gradients
        overflowed (the forward-overflow flag, the scale against its floor); `stats.retries`
        counts the reruns.

        Returns:
            What `optimizer.step(*args, **kwargs)` returns, or None when skipped; for a list,
            a list of those. With a closure: the loss its last run returned.

        An optimizer with `_step_supports_amp_scaling` whose `step()` takes `grad_scaler`
        (torch's deprecated protocol) gets `grad_scaler=self` and torch's `FutureWarning`,
        as torch's scalers do; what it reads back (`_check_inf_per_device`,
        `_found_inf_per_device`, `_get_scale_async`) is the agreed state.

        Raises:
            RuntimeError: step() already ran since [`update()`][update].
        """
        if self._enabled:
            if passes_itself(optimizer):  # torch's deprecated protocol
                return self._step_passing_itself(optimizer, closure, args, kwargs)
            return self._steps.take(optimizer, closure, args, kwargs)
        loss = None if closure is None else closure()
        listed = isinstance(optimizer, (list, tuple))
        targets: list[Any] = list(optimizer) if listed else [optimizer]  # type: ignore[arg-type]
        results = [target.step(*args, **kwargs) for target in targets]
        return loss if closure is not None else (results if listed else results[0])

    def _step_passing_itself(
        self,
        optimizer: Any,
        closure: Callable[[], Any] | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """torch's deprecated protocol, for an optimizer that [`passes_itself`][
        shardscale.scaler.passes_itself]: `optimizer.step(grad_scaler=self)`, with torch's
        warning. The optimizer unscales and skips itself; what it reads back
        (`_check_inf_per_device`, `_found_inf_per_device`, `_get_scale_async`:
        `shardscale._compat`) is the agreed state.

        Raises:
            RuntimeError: with a `closure`, which it cannot retry (the optimizer reads the scale).
        """
        if closure is not None:
            raise RuntimeError(
                f"step(closure=...) cannot retry {type(optimizer).__name__}: its step() "
                "takes grad_scaler= (torch's deprecated protocol) and reads the scale "
                "itself; run the closure, then step(optimizer)"
            )
        steps = self._steps
        steps.loss_scale("step", optimizer)
        records = [steps.book.record(leaf) for leaf in leaves(optimizer)]
        warnings.warn(GRAD_SCALER_WARNING, FutureWarning, stacklevel=3)
        result = optimizer.step(*args, **{**kwargs, "grad_scaler": self})
        for record in records:
            steps.stepped(record)
        return result

    def clip_grad_norm_(
        self,
        parameters: torch.Tensor | Iterable[torch.Tensor],
        max_norm: float,
        norm_type: float = 2.0,
        *,
        replica_group: dist.ProcessGroup | DeviceMesh | int | None = None,
    ) -> torch.Tensor:
        """Unscale, then clip gradients to a global norm over all shards, in one collective.

        Replaces `scaler.unscale_(optimizer)` + `torch.nn.utils.clip_grad_norm_`: the
        norm's partial sums travel in the same all-reduce as the overflow flag, so scale →
        backward → clip → [`step()`][step] → [`update()`][update] costs one collective per step. The
        norm is global: every rank's shards and every pipeline stage's parameters count, and
        replicas count once. DTensor gradients (FSDP2, HSDP, TP, expert parallel) say their
        replicas themselves (their mesh and placements); plain tensors and FSDP1 flat
        parameters are replicated over `replica_group`. Two passes over the gradients (one
        read, one read+write), no host synchronisation.

        Call it on every rank, after backward and before [`step()`][step] of the optimizers owning
        `parameters`; their step then reuses this check. After [`unscale_()`][unscale_] (torch's
        order) it clips the unscaled gradients, and unscale_'s check rides in the same
        collective: still one per step.

        Args:
            parameters: the parameters (or one tensor) whose gradients to clip, as given to
                `torch.nn.utils.clip_grad_norm_`; every rank passes its own (its model or
                pipeline stage's `parameters()`).
            max_norm: the norm to clip to (> 0).
            norm_type: the p of the p-norm (> 0), or `math.inf`.
            replica_group: the ranks holding the same plain (non-DTensor) gradients as this
                rank: a `ProcessGroup`, a 1-D `DeviceMesh`, or their number. None (the
                default): every rank of the scaler's group, as under DDP. Under pipeline
                parallelism a stage's plain parameters live on that stage's ranks only: pass
                its data-parallel group (PP x DDP), or 1 (pure PP).

        Returns:
            The total (unscaled, unclipped) norm as a float32 scalar tensor, identical on every
            rank; non-finite on every rank if any rank's gradients overflowed (the coming step
            is then skipped everywhere).

        Raises:
            RuntimeError: called twice before [`update()`][update], or after some but not all of an
                optimizer's parameters were unscaled; or no rank holds a gradient.
            ValueError, TypeError: `max_norm`, `norm_type` or `replica_group` breaks its
                rule.
        """
        enabled, group = self._enabled, replica_group
        return self._clipping.clip_grad_norm_(parameters, max_norm, norm_type, group, enabled)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Move the scale: back off if any optimizer skipped, grow after enough clean steps.

        Device-side maths on the agreed flags: no collective, no host synchronisation. A step
        skipped for a forward overflow (a non-finite loss on some rank) holds the scale, its
        trackers and the hysteresis allowance.

        It also sounds the alarms, on every rank alike: the floor warning at the first gradient
        overflow that leaves the scale at `min_scale`, the error after `max_overflows_at_floor`
        of them in a row, a warning once a streak of 8 non-finite losses (each names where the
        non-finite values are, with one gather). While such a streak is under way, a step
        whose outcome the host did not read (a fused one) costs a host read here, on a GPU.

        Args:
            new_scale: set the scale to this value instead: a float in
                `[min_scale, max_scale]`, or a one-element tensor without grad (taken as given:
                checking its value would cost a host synchronisation).

        Raises:
            RuntimeError: no optimizer was stepped or unscaled since the last update().
            ShardScaleNonFiniteError: the gradients stayed non-finite at the floor
                (`max_overflows_at_floor`); the scaler is ready for the next iteration.
        """
        if not self._enabled:
            return
        state, book, policy = self._home.require("update"), self._steps.book, self._home.host.policy
        verdict = self._steps.outcome(state.scale)  # unscale_() without step() agrees now
        if new_scale is None and verdict is None:
            raise RuntimeError("No inf checks were recorded prior to update.")
        manual = None if new_scale is None else policy.new_scale_tensor(new_scale)
        taken = book.step if verdict is not None else book.step - 1  # the steps taken so far
        alarm, reporter = None, self._reporter
        with reporter.lock:  # a thread reading `stats` sees this step whole
            if verdict is not None:
                state.apply_(policy, verdict, manual, self._home.past_interval)
                # A step the host did not read as clean has its streaks watched (every rank
                # alike); one it read as clean, not a meter step, has nothing to report (no skip
                # to log, no streak, no meter reading) but to hooks, whose failure is warned.
                read = verdict.read
                if read is not False or verdict.counts is not None or reporter.hooks:
                    alarm = reporter.after_update(state, policy, taken, read)
            elif manual is not None:
                state.scale.copy_(manual)
            self._steps.begin(taken + 1)
        verify_every = self._config.verify_every
        if verify_every and verdict is not None and taken % verify_every == 0:
            self.verify_agreement()
        if alarm is not None:  # every rank alike: it names the parameters, with one gather
            losses = alarm in (Alarm.LOSS_STREAK, Alarm.SKIP_LIMIT)
            located = [] if alarm is Alarm.MISMATCH else self._steps.locate_now(book, losses)
            self._reporter.sound(alarm, located, taken, policy, float(state.scale.item()))
        # a listener's failure, said once the iteration is closed: where warnings are errors,
        # this rank raises here, and goes on like its peers
        if self._reporter.failures:
            self._reporter.warn_failures()

    def record_overflow(self) -> None:
        """Take an overflow that a check outside this scaler found, for the step just taken.

        A framework may run a check of its own (DeepSpeed's and Megatron's all-reduced gradient
        norm) and find an overflow this scaler's check did not see (a norm that overflows in
        its own sum). Call this on every rank alike, with that already-agreed decision, after
        [`step()`][step] and before [`update()`][update]: the step
        reads as skipped (`last_step_skipped`, `stats`), and `update()` backs off as for an
        overflow of its own. The optimizer step, if one ran, is the caller's to undo or skip.

        Raises:
            RuntimeError: no optimizer was stepped since the last update().
        """
        if self._enabled:
            self._steps.record_overflow()

    # ------------------------------------------------------------------ what happened

    @property
    def last_step_skipped(self) -> bool | None:
        """Whether the most recent `step()` skipped the optimizer (on every rank); None before
        the first step (no step to tell of).

        Free after a non-fused step (its decision was already read); after a fused step,
        reading it costs one host synchronisation on an accelerator.
        """
        last = self._steps.last
        if last is None:
            return None
        if last.read is not None:  # the step read it
            return last.read
        # Read each time, never remembered: a CUDA-graph replay updates this very tensor.
        return bool(last.found_inf.item())

    @property
    def stats(self) -> ScalerStats:
        """Steps, skipped steps, consecutive skips, the scale, the last overflow's step, forward
        overflows and retries.

        Identical on every rank; right for fused optimizers too (counted on the device). One
        host read of one small tensor (a synchronisation on an accelerator); no collective.
        """
        with self._reporter.lock:  # not halfway through an update() on another thread
            self._reporter.flush()
            if self._home.device is None:
                scale = self._home.host.scale.scale if self._enabled else 1.0
                return stats_of(scale, self._home.host.counters)
            return stats_from(self._home.device.packed().tolist())

    def register_stats_hook(self, hook: StatsHook) -> RemovableHandle:
        """Call `hook(stats)` after every `update()` that counted a step.

        For TensorBoard / W&B: `stats` is a [`ScalerStats`][shardscale.ScalerStats]. On the CPU
        the hook runs inside that update(); on CUDA it runs one update() later (or when
        [`stats`][shardscale.ShardedGradScaler.stats] is read), so that reading the numbers
        never stalls the step. A hook on one rank alone (rank 0's logging) changes nothing the
        ranks communicate.

        Returns:
            A handle whose `remove()` unregisters the hook.
        """
        if not callable(hook):
            raise TypeError(f"hook must be callable, got {type(hook).__name__}")
        if not self._enabled:
            warnings.warn(_DISABLED_HOOK, ShardScaleWarning, stacklevel=2)
        return self._reporter.register(hook)

    @property
    def last_overflow(self) -> list[NonFiniteGrad] | None:
        """With `locate_overflow=True`: where the last overflow step's inf/NaN values were.

        [`NonFiniteGrad`][shardscale.NonFiniteGrad] records (rank, name, num_inf, num_nan),
        identical on every rank; a forward overflow adds a `"<loss>"` record for each rank
        whose loss was non-finite. None where nothing was located: without `locate_overflow`
        (nothing is looked for; [`find_nonfinite_grads()`][shardscale.find_nonfinite_grads]
        looks once), or before the first overflow step. Reading it never communicates.
        """
        located = self._steps.last_overflow
        return None if located is None else list(located)

    def get_scale(self) -> float:
        """Return the current scale (1.0 when disabled). Costs ONE host sync on an accelerator."""
        if not self._enabled:
            return 1.0
        if self._home.device is None:
            return self._home.host.scale.scale
        return float(self._home.device.scale.item())

    def verify_agreement(self) -> None:
        """Check that every rank holds the same scaler state, in one small collective.

        Compares the scale, the trackers, the counters and the policy settings. They always
        agree if every rank ran the same steps and loaded the same state; this catches the
        cases where they did not (a state dict loaded on some ranks only, a rank restarted
        from another checkpoint). A no-op at world size 1. Costs two host transfers (the state,
        and every rank's values).

        Raises:
            ShardScaleDistributedError: the ranks differ; the message lists every rank's values
                for each field that differs. Or a rank did not arrive within `sync_timeout`.
        """
        if not self._enabled or self._agreement.exchange.world_size == 1:
            return
        numbers = state_numbers(self._home.read())
        values = torch.tensor(list(numbers.values()), dtype=torch.float64)
        device = self._home.device.scale.device if self._home.device is not None else values.device
        taken = self._steps.book.step - 1  # the steps taken so far
        self._agreement.exchange.compare(values.to(device), list(numbers), taken)

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """Return the state as Python numbers; empty when disabled, as torch's.

        Torch's keys (`scale`, `growth_factor`, `backoff_factor`, `growth_interval`,
        `_growth_tracker`) keep their meaning, so `torch.amp.GradScaler` loads it; ours add the
        hysteresis settings, floor and ceiling, the counters and `format_version`
        (docs/checkpoints.md lists them). With `state_dict` and
        [`load_state_dict()`][load_state_dict] the scaler is a `torch.distributed.checkpoint`
        Stateful.
        """
        return to_state_dict(self._home.read()) if self._enabled else {}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state dict of this class or of a torch scaler, whole or not at all.

        The state (scale, trackers, counters, the fit's learned state) is the checkpoint's.
        Where the checkpoint's settings differ from this scaler's: torch's (`growth_factor`,
        `backoff_factor`, `growth_interval`) are the checkpoint's, as torch's scalers load them
        (set them after loading to change them); of shardscale's (`hysteresis`, `min_scale`,
        `max_scale`, `dynamic`, `scale_policy`), one passed to this scaler's constructor is
        kept, even at its default's value (a run resumed to change a setting, or to go back to
        a default, gets what it asked for), and one not passed is the checkpoint's (a scaler
        built with defaults resumes as saved). Where that would fit a fixed scale, the one of
        `dynamic` and `scale_policy` that was passed decides the other. The state is brought
        within the settings that won (the scale clamped to the floor and ceiling, the
        hysteresis allowance to `hysteresis`; the fit's state dropped where the fit does not
        win: it reads gradients of long ago). One
        [`ShardScaleWarning`][shardscale.ShardScaleWarning] names every difference, both values
        and which won. A torch state dict starts a full hysteresis allowance and zeroes the
        counters; an older shardscale format starts the counters it lacks at 0. No-op when
        disabled, as torch's.

        Raises:
            RuntimeError: the dict is empty (saved by a disabled scaler); or the iteration is
                under way (a loss that requires grad was scaled, or an optimizer unscaled,
                clipped or stepped, since the last `update()`), whose gradients carry the scale
                it began with: dividing them by a loaded one would be wrong (torch's loads
                there: docs/migration.md). To abandon such an iteration (a rollback), end it
                with `update(new_scale=scaler.get_scale())`, which counts no step where none
                was taken, then load.
            ValueError, TypeError: a key is missing or unknown, or a value breaks a rule; the
                scaler is left unchanged.
        """
        if not self._enabled:
            return
        if self._steps.book.midway():
            raise RuntimeError(
                "A GradScaler state may only be loaded at the beginning of an iteration, or at "
                "the end after scaler.update(): this iteration's gradients carry the scale it "
                "began with, and would be unscaled by the loaded one. Call load_state_dict() "
                "before scale(), or after update(). To abandon this iteration instead (a "
                "rollback), end it first with scaler.update(new_scale=scaler.get_scale()), "
                "which counts no step where none was taken."
            )
        passed = self._config.passed_policy()
        state, differing = parse_state_dict(state_dict, self.policy, passed)
        if differing is not None:
            warnings.warn(differing, ShardScaleWarning, stacklevel=2)
        self._home.load(state)
        if not self.policy.fit:  # a fit switched off takes its reader's hooks with it
            self._agreement.readings.fp16.close()
        # nothing of the run before is left: its last step, overflow, meter reading, copies
        self._reporter.restart(state.counters)
        self._steps.restart(state.counters.steps)

    def __getstate__(self) -> dict[str, Any]:
        if self._steps.book.records:
            raise RuntimeError(
                "A GradScaler instance may only be pickled at the beginning "
                "of an iteration, or at the end after scaler.update()."
            )
        if self.process_group is not None:
            raise TypeError(
                "a ShardedGradScaler bound to an explicit process_group cannot be pickled "
                "(process groups cannot be); save state_dict() instead"
            )
        state = self._home.read() if self._enabled else self._home.host
        return {"config": self._config, "enabled": self._enabled, "state": state}

    def __setstate__(self, pickled: dict[str, Any]) -> None:
        self._setup(pickled["config"], pickled["enabled"], pickled["state"])


# torch's private members, answered apart from the public class (docs/migration.md's table)
_compat.answer_torchs_members(ShardedGradScaler)


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
