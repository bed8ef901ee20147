"""ShardedGradScaler: torch's loss-scaling protocol, with every rank of the group agreeing.

Invariant: after `step()` every rank of the process group has made the same skip/step
decision for its optimizers, and after `update()` every rank holds the same scale, trackers
and counters. That holds because each rank checks its own gradient shards and the ranks then
share ONE flag tensor in ONE all-reduce per step; everything after that (the skip decision, the
policy maths) is a deterministic function of the agreed flag.

The class orchestrates and stays thin: `_config` validates the options, `_iteration` keeps the
iteration's call-order state, `_stepping` checks, agrees, clips and steps, `_device_state` holds
the scale on the device (and `ScaleHome` says whether this rank holds one), `_checkpoint` reads
and writes state dicts. Two mixins carry the members that are not the iteration:
`_report.ReportingMembers` (what happened: stats, hooks, `last_step_skipped`, `get_scale`) and
`_torch_members.TorchPrivateMembers` (torch's private members, as public code reads them).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from dataclasses import replace
from datetime import timedelta
from typing import Any, cast, overload

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from shardscale import _compat
from shardscale._agree import Agreement
from shardscale._check import combined
from shardscale._checkpoint import Counters, ScalerState, parse_state_dict, to_state_dict
from shardscale._clip import check_clip_args
from shardscale._config import ScalerConfig
from shardscale._device_state import DeviceState, ScaleHome
from shardscale._devices import move
from shardscale._errors import ShardScaleWarning, no_scale_message
from shardscale._grads import grads_device, plain_replicas
from shardscale._iteration import IterationBook
from shardscale._optimizers import OptimizerTarget, optimizer_params, steppables
from shardscale._policy import ScalePolicy
from shardscale._report import ReportingMembers, StepReporter
from shardscale._stepping import Stepper
from shardscale._torch_members import TorchPrivateMembers

__all__ = ["ShardedGradScaler"]


# torch's _per_optimizer_states is a dict; ours a read-only view of the agreed state.
class ShardedGradScaler(  # type: ignore[misc]
    ReportingMembers, TorchPrivateMembers, torch.amp.GradScaler
):
    """Loss scaler for sharded mixed-precision training whose ranks always agree.

    A drop-in for `torch.amp.GradScaler` and
    `torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler`, with the same methods,
    call-order errors and state-dict keys. It is a `torch.amp.GradScaler` (scripts guard
    resume and clipping with that `isinstance`), built without torch's `__init__`: every
    method and attribute of torch's class is defined here, on our state, and the private
    members public code reads (`_per_optimizer_states`, `_found_inf_per_device`, `_scale`
    ...) answer with the agreed state (docs/migration.md lists them).

    Each rank checks its local gradient shards (plain, DDP, FSDP1 flat parameters,
    FSDP2/DTensor, CPU-offloaded, sparse) for inf/NaN, and the ranks agree in one all-reduce
    per step, so every rank skips or steps together. With
    no initialised process group, or a world size of 1, it issues no collective and behaves like
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

    Args:
        device: device type of the loss (`"cuda"`, `"cpu"`, ...). None (the default) takes it from
            the first tensor passed to [`scale()`][scale], so one script runs on CPU and GPU. As
            torch does, `"cuda"` without CUDA warns and disables the scaler.
        init_scale: the first step's scale. Default `2.0**16`, or 1.0 when `dynamic=False`.
        growth_factor: multiplies the scale after `growth_interval` clean steps (> 1).
        backoff_factor: multiplies the scale on an overflow (in (0, 1)).
        growth_interval: consecutive clean steps before the scale grows (>= 1).
        enabled: False makes every method a no-op and [`step()`][step] a plain `optimizer.step()`.
        process_group: the ranks that must agree. None: the default (world) group.
        hysteresis: overflows tolerated before backing off, replenished on growth (Megatron,
            DeepSpeed). 1, the default, backs off at every overflow, as torch does.
        min_scale: the floor (> 0), so the scale can never collapse to 0. Reaching it warns
            once; steps that overflow there are skipped and the scale holds. Default 1.0.
        max_scale: the ceiling for growth. None: no ceiling.
        dynamic: False keeps the scale fixed (use `init_scale=1.0` as a bf16 guard): non-finite
            steps are still skipped on every rank together.
        sync_timeout: the longest wait (a `timedelta` or seconds) for the other ranks at the
            scaler's collectives; a rank that never arrives then raises
            [`ShardScaleDistributedError`][shardscale.ShardScaleDistributedError] naming the step.
            None: the process group's own timeout (torch's defaults: 30 minutes for gloo, 10 for
            NCCL). On NCCL it is counted from the enqueue, so choose more than the longest step's
            GPU time (docs/reliability.md).
        verify_every: call
            [`verify_agreement()`][shardscale.ShardedGradScaler.verify_agreement] every N steps
            (one small collective and one host sync each time). 0, the default: never.
        max_consecutive_skips: raise [`ShardScaleSkipError`][shardscale.ShardScaleSkipError] (naming
            the step and the scale) when more consecutive steps than this are skipped, instead of
            skipping forever. None, the default: no limit.
        locate_overflow: on steps that overflow, find which parameters hold the inf/NaN gradients on
            which rank ([`find_nonfinite_grads()`][shardscale.find_nonfinite_grads]), keep the
            records in [`last_overflow`][shardscale.ShardedGradScaler.last_overflow] and log
            them (WARNING, logger `"shardscale"`). Clean steps pay one host read of the agreed
            flag (free after a plain step, which reads it anyway); an overflow step pays host
            reads and one gather of the records. Name the parameters by building the optimizer
            from `model.named_parameters()`.

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: an argument is out of range; the message states the rule and the value.
    """

    def __init__(
        self,
        device: str | torch.device | None = None,
        *,
        init_scale: float | None = None,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        process_group: dist.ProcessGroup | None = None,
        hysteresis: int = 1,
        min_scale: float = 1.0,
        max_scale: float | None = None,
        dynamic: bool = True,
        sync_timeout: timedelta | float | None = None,
        verify_every: int = 0,
        max_consecutive_skips: int | None = None,
        locate_overflow: bool = False,
    ) -> None:
        config = ScalerConfig(
            device=device,  # type: ignore[arg-type]  # normalised to its type by the config
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
            process_group=process_group,
            hysteresis=hysteresis,
            min_scale=min_scale,
            max_scale=max_scale,
            dynamic=dynamic,
            sync_timeout=sync_timeout,
            verify_every=verify_every,
            max_consecutive_skips=max_consecutive_skips,
            locate_overflow=locate_overflow,
        )
        if enabled and config.device == "cuda" and not torch.cuda.is_available():
            warnings.warn(
                "ShardedGradScaler(device='cuda') is enabled, but CUDA is not available. "
                "Disabling (as torch.amp.GradScaler does); leave device unset to follow the loss.",
                ShardScaleWarning,
                stacklevel=2,
            )
            enabled = False
        policy = config.policy()
        state = ScalerState(
            policy=policy, scale=policy.initial_state(config.first_scale()), counters=Counters()
        )
        self._setup(config, enabled, state)

    def _setup(self, config: ScalerConfig, enabled: bool, state: ScalerState) -> None:
        self._config = config
        self._enabled = enabled
        self._agreement = self._make_agreement(config)
        # The state on the host until the first scale() (or step) puts it on a device.
        self._home = ScaleHome(state)
        self._stepper = Stepper(
            self._agreement,
            self._home,
            locate_overflow=config.locate_overflow,
            defers_agreement=self._defers_agreement,
        )
        self._reporter = StepReporter(config.max_consecutive_skips)
        # The steps counted so far, kept on the host too: messages name the step without a read.
        self._steps = state.counters.steps
        self._book = IterationBook(step=self._steps + 1)
        # The last step()'s decision: a bool where the host already read it, else the device flag.
        self._last_skip: bool | torch.Tensor = False

    _defers_agreement = True
    """Whether `unscale_` may leave its agreement to the next step, clip or update (a subclass
    whose steps run on another thread says False)."""

    def _make_agreement(self, config: ScalerConfig) -> Agreement:
        """The agreement this scaler runs its collectives on (a subclass may give it a group
        of its own)."""
        return Agreement(config.process_group, config.timeout)

    @property
    def policy(self) -> ScalePolicy:
        """The current scale policy (growth, backoff, hysteresis, floor, ceiling)."""
        return self._home.host.policy

    def _set_policy(self, **changes: Any) -> None:
        self._home.host = replace(
            self._home.host, policy=replace(self._home.host.policy, **changes)
        )

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The group whose ranks agree (None: the default group)."""
        return self._agreement.process_group

    def is_enabled(self) -> bool:
        """Return whether this scaler scales and checks (False: every method is a no-op)."""
        return self._enabled

    def get_growth_factor(self) -> float:
        """Return the scale growth factor."""
        return self.policy.growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the scale growth factor (> 1)."""
        self._set_policy(growth_factor=new_factor)

    def get_backoff_factor(self) -> float:
        """Return the scale backoff factor."""
        return self.policy.backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the scale backoff factor (in (0, 1))."""
        self._set_policy(backoff_factor=new_factor)

    def get_growth_interval(self) -> int:
        """Return the number of clean steps before the scale grows."""
        return self.policy.growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the number of clean steps before the scale grows (>= 1)."""
        self._set_policy(growth_interval=new_interval)

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

        The result keeps each input's dtype. Other iterables are scaled lazily, as torch does.

        Raises:
            TypeError: an output is not a floating-point tensor.
            ValueError: a tensor is on another device type than `device` named.
        """
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            return self._scale_tensor(outputs)
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(output) for output in outputs)
        if isinstance(outputs, (str, bytes, Mapping)) or not isinstance(outputs, Iterable):
            raise TypeError(
                "scale() takes a Tensor or a (nested) list/tuple of Tensors, got "
                f"{type(outputs).__name__}"
            )
        return map(self.scale, outputs)

    def _scale_tensor(self, output: torch.Tensor) -> torch.Tensor:
        if not output.is_floating_point():
            raise TypeError(f"scale() takes floating-point tensors, got dtype {output.dtype}")
        device_type = self._config.device
        if device_type is not None and output.device.type != device_type:
            raise ValueError(
                f"scale() got a tensor on {output.device}, but this scaler was built with "
                f"device={device_type!r}; pass the loss's device, or leave device unset"
            )
        state = self._home.at_loss(output.device)
        book = self._book
        if book.loss_scale is None:
            # A copy of the live scale, once per iteration: update() then never modifies a
            # tensor autograd saved for a backward still to come.
            book.loss_scale = state.scale.clone()
        return (output * move(book.loss_scale, output.device)).to(output.dtype)

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
        if not self._enabled:
            return
        leaves = [leaf for item in steppables(optimizer) for leaf in item.leaves]
        scale = self._ensure_state("unscale_", leaves).scale
        self._stepper.unscale(self._book, optimizer, scale)

    def step(self, optimizer: OptimizerTarget, *args: Any, **kwargs: Any) -> Any:
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

        Returns:
            What `optimizer.step(*args, **kwargs)` returns, or None when skipped; for a list,
            a list of those.

        An optimizer with `_step_supports_amp_scaling` whose `step()` takes `grad_scaler`
        (torch's deprecated protocol) gets `grad_scaler=self` and torch's `FutureWarning`,
        as torch's scalers do; what it reads back (`_check_inf_per_device`,
        `_found_inf_per_device`, `_get_scale_async`) is the agreed state.

        Raises:
            RuntimeError: a `closure` is passed, or step() already ran since [`update()`][update].
        """
        if not self._enabled:
            results = [item.target.step(*args, **kwargs) for item in steppables(optimizer)]
            return results if isinstance(optimizer, (list, tuple)) else results[0]
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        if _compat.passes_itself(optimizer):  # one attribute read for most optimizers
            return self._step_passing_itself(cast(torch.optim.Optimizer, optimizer), args, kwargs)
        leaves = [leaf for item in steppables(optimizer) for leaf in item.leaves]
        scale = self._ensure_state("step", leaves).scale
        result, self._last_skip, _ = self._stepper.step(self._book, optimizer, scale, args, kwargs)
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
        max_norm, norm_type = check_clip_args(max_norm, norm_type)
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        replicas = plain_replicas(replica_group, self._agreement.world_size)
        if not self._enabled:
            return self._stepper.clip(None, params, max_norm, norm_type, replicas, None)
        scale = self._ensure_state("clip_grad_norm_", params).scale
        return self._stepper.clip(self._book, params, max_norm, norm_type, replicas, scale)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Move the scale: back off if any optimizer skipped, grow after enough clean steps.

        Device-side maths on the agreed flags: no collective, no host synchronisation.

        Args:
            new_scale: set the scale to this value instead: a float in
                `[min_scale, max_scale]`, or a one-element tensor without grad (taken as given:
                checking its value would cost a host synchronisation).

        Raises:
            RuntimeError: no optimizer was stepped or unscaled since the last update().
        """
        if not self._enabled:
            return
        scale = self._require_state("update").scale
        self._stepper.resolve_pending(self._book, scale, "update")  # unscale_() without step()
        found_infs = self._book.found_infs()
        if new_scale is None and not found_infs:
            raise RuntimeError("No inf checks were recorded prior to update.")
        manual = None if new_scale is None else self.policy.new_scale_tensor(new_scale)
        self._apply(found_infs, manual)
        self._book = IterationBook(step=self._steps + 1)

    def _apply(self, found_infs: list[torch.Tensor], manual: torch.Tensor | None) -> None:
        """Count the step and move the scale from the agreed flags (or set it to `manual`)."""
        state = self._require_state("update")
        if found_infs:
            found_inf = combined(found_infs)
            state.count_step_(found_inf)
            self._steps += 1
            if manual is None:
                self.policy.update_(
                    state.scale, state.growth_tracker, state.hysteresis_tracker, found_inf
                )
        if manual is not None:
            state.scale.copy_(manual)
        if state.scale.device.type == "cpu":  # reading the state costs no device synchronisation
            self._reporter.warn_if_at_floor(state, self.policy, self._steps)
        if found_infs:
            self._reporter.push(state)
        verify_every = self._config.verify_every
        if verify_every and found_infs and self._steps % verify_every == 0:
            self.verify_agreement()

    def state_dict(self) -> dict[str, Any]:
        """Return the state as Python numbers; empty when disabled, as torch's.

        Torch's keys (`scale`, `growth_factor`, `backoff_factor`, `growth_interval`,
        `_growth_tracker`) keep their meaning, so `torch.amp.GradScaler` loads it; ours add the
        hysteresis settings, floor and ceiling, the counters and `format_version`
        (docs/checkpoints.md lists them). With `state_dict` and
        [`load_state_dict()`][load_state_dict] the scaler is a `torch.distributed.checkpoint`
        Stateful.
        """
        if not self._enabled:
            return {}
        return to_state_dict(self._read_state())

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state dict of this class or of a torch scaler, whole or not at all.

        A torch state dict keeps this scaler's hysteresis, floor and ceiling settings, starts a
        full hysteresis allowance and zeroes the counters. No-op when disabled, as torch's.

        Raises:
            RuntimeError: the dict is empty (saved by a disabled scaler).
            ValueError, TypeError: a key is missing or unknown, or a value breaks a rule; the
                scaler is left unchanged.
        """
        if not self._enabled:
            return
        state = parse_state_dict(state_dict, self.policy)
        self._home.load(state)
        self._steps = state.counters.steps
        self._book.loss_scale = None  # the next loss takes the loaded scale

    def __getstate__(self) -> dict[str, Any]:
        if self._book.records:
            raise RuntimeError(
                "A GradScaler instance may only be pickled at the beginning "
                "of an iteration, or at the end after scaler.update()."
            )
        if self.process_group is not None:
            raise TypeError(
                "a ShardedGradScaler bound to an explicit process_group cannot be pickled "
                "(process groups cannot be); save state_dict() instead"
            )
        state = self._read_state() if self._enabled else self._home.host
        return {"config": self._config, "enabled": self._enabled, "state": state}

    def __setstate__(self, pickled: dict[str, Any]) -> None:
        self._setup(pickled["config"], pickled["enabled"], pickled["state"])

    def _require_state(self, funcname: str) -> DeviceState:
        return self._home.require(funcname)

    def _ensure_state(
        self, funcname: str, source: Iterable[torch.optim.Optimizer] | list[torch.Tensor]
    ) -> DeviceState:
        """The state on its device; a rank that never called `scale()` gets it now.

        In a pipeline only the last stage computes a loss; the others never call `scale()`,
        yet hold the same scale (every rank does) and must check, step and update with the
        rest: their state goes where their gradients are ([`ScaleHome.for_gradients()`][]).
        Alone in its group, a rank without a scale raises torch's error instead: nobody else
        can have scaled its loss.
        """
        if self._home.device is not None:
            return self._home.device
        if self._agreement.world_size == 1:
            raise RuntimeError(no_scale_message(funcname))
        items = list(source)
        params = (
            [p for optimizer in items for p in optimizer_params(optimizer)]  # type: ignore[arg-type]
            if items and not isinstance(items[0], torch.Tensor)
            else items
        )
        return self._home.for_gradients(grads_device(params))  # type: ignore[arg-type]

    def _read_state(self) -> ScalerState:
        if self._home.device is None:
            return self._home.host
        self._agreement.settle()  # a host read of agreed values: bounded by sync_timeout
        return self._home.device.read(self.policy)
