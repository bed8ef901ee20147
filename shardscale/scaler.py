"""ShardedGradScaler: torch's loss-scaling protocol, with every rank of the group agreeing.

Invariant: after ``step(optimizer)`` every rank of the process group has made the same skip/step
decision for that optimizer, and after ``update()`` every rank holds the same scale, trackers and
counters. That holds because each rank checks its own gradient shards and the ranks then share
ONE flag tensor in ONE all-reduce per optimizer per step (``_agree``); everything after that
(the skip decision, the policy maths) is a deterministic function of the agreed flag.

The class orchestrates and stays thin: ``_grads`` finds the local gradients, ``_check`` checks
and unscales them, ``_agree`` runs the collective, ``_policy`` moves the scale, ``_state`` reads
and validates state dicts.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import timedelta
from enum import Enum
from typing import Any, overload

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.hooks import RemovableHandle

from shardscale._agree import Agreement, Verdict
from shardscale._check import check_and_unscale_, multiply_
from shardscale._clip import (
    apply_,
    by_device_dtype,
    check_clip_args,
    local_norms,
    norm_flags_exact,
)
from shardscale._devices import move
from shardscale._errors import ShardScaleWarning, no_scale_message
from shardscale._grads import GradCache, grads_device
from shardscale._locate import NonFiniteGrad, locate, optimizer_named_params
from shardscale._optimizers import (
    OptimizerTarget,
    Steppable,
    optimizer_params,
    steppables,
    takes_scale,
)
from shardscale._policy import ScalePolicy
from shardscale._report import ScalerStats, StatsHook, StepReporter, logger, stats_from, stats_of
from shardscale._state import (
    Counters,
    DeviceState,
    ScalerState,
    parse_state_dict,
    to_state_dict,
)

__all__ = ["ShardedGradScaler"]

_CPU = torch.device("cpu")


class _Stage(Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


@dataclass(slots=True)
class _OptimizerRecord:
    """Where one optimizer is in the current iteration, and its agreed overflow flag."""

    optimizer: torch.optim.Optimizer
    step: int
    """The number of the step this iteration takes (error messages name it)."""
    stage: _Stage = _Stage.READY
    found_inf: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class _Clipped:
    """What ``clip_grad_norm_`` unscaled and agreed on this iteration, for ``step`` to reuse."""

    param_ids: frozenset[int]
    found_inf: torch.Tensor


@dataclass(slots=True)
class _Pending:
    """Gradients ``unscale_()`` checked and unscaled locally, whose flags await the agreement.

    The agreement waits for the next point that needs it (``step``, ``clip_grad_norm_``,
    ``update``), so ``unscale_`` + clip + step still cost one collective.
    """

    records: list[_OptimizerRecord]
    flags: list[torch.Tensor]
    holds: bool


def _device_type(device: str | torch.device | None) -> str | None:
    if device is None:
        return None
    if not isinstance(device, (str, torch.device)):
        raise TypeError(
            f"device must be a str, a torch.device or None, got {type(device).__name__}: {device!r}"
        )
    try:
        return torch.device(device).type
    except RuntimeError as error:
        raise ValueError(f"device must name a torch device type, got {device!r}") from error


def _combined(found_infs: list[torch.Tensor | None]) -> torch.Tensor:
    """The largest of agreed flags: itself when they are one tensor (the usual case)."""
    distinct = list({id(f): f for f in found_infs if f is not None}.values())
    if len(distinct) == 1:
        return distinct[0]
    return torch.stack([move(f, distinct[0].device) for f in distinct]).amax()


def _inverse(scale: torch.Tensor) -> torch.Tensor:
    """1/scale in float32, taken in float64: fp32 division can be imprecise under some compile
    options."""
    return scale.double().reciprocal().float()


def _timeout(sync_timeout: timedelta | float | None) -> timedelta | None:
    if sync_timeout is None:
        return None
    if isinstance(sync_timeout, timedelta):
        seconds = sync_timeout.total_seconds()
    elif isinstance(sync_timeout, (int, float)) and not isinstance(sync_timeout, bool):
        seconds = float(sync_timeout)
    else:
        raise TypeError(
            "sync_timeout must be a datetime.timedelta, a number of seconds or None, got "
            f"{type(sync_timeout).__name__}"
        )
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"sync_timeout must be a finite time > 0, got {seconds} s")
    return timedelta(seconds=seconds)


class ShardedGradScaler:
    """Loss scaler for sharded mixed-precision training whose ranks always agree.

    A drop-in for ``torch.amp.GradScaler`` and
    ``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler``, with the same methods,
    call-order errors and state-dict keys. Each rank checks its local gradient shards (plain,
    DDP, FSDP1 flat parameters, FSDP2/DTensor, CPU-offloaded, sparse) for inf/NaN, and the ranks
    agree in one all-reduce per optimizer per step, so every rank skips or steps together. With
    no initialised process group, or a world size of 1, it issues no collective and behaves like
    ``torch.amp.GradScaler``.

    Example::

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

    Args:
        device: device type of the loss (``"cuda"``, ``"cpu"``, ...). None (the default) takes
            it from the first tensor passed to :meth:`scale`, so one script runs on CPU and GPU.
            As torch does, ``"cuda"`` without CUDA warns and disables the scaler.
        init_scale: the first step's scale. Default ``2.0**16``, or 1.0 when ``dynamic=False``.
        growth_factor: multiplies the scale after ``growth_interval`` clean steps (> 1).
        backoff_factor: multiplies the scale on an overflow (in (0, 1)).
        growth_interval: consecutive clean steps before the scale grows (>= 1).
        enabled: False makes every method a no-op and :meth:`step` a plain ``optimizer.step()``.
        process_group: the ranks that must agree. None: the default (world) group.
        hysteresis: overflows tolerated before backing off, replenished on growth (Megatron,
            DeepSpeed). 1, the default, backs off at every overflow, as torch does.
        min_scale: the floor (> 0), so the scale can never collapse to 0. Reaching it warns
            once; steps that overflow there are skipped and the scale holds. Default 1.0.
        max_scale: the ceiling for growth. None: no ceiling.
        dynamic: False keeps the scale fixed (use ``init_scale=1.0`` as a bf16 guard): non-finite
            steps are still skipped on every rank together.
        sync_timeout: the longest wait (a ``timedelta`` or seconds) for the other ranks at the
            scaler's collectives; a rank that never arrives then raises
            :class:`ShardScaleDistributedError` naming the step. None: the process group's own
            timeout (30 minutes by default).
        verify_every: call :meth:`verify_agreement` every N steps (one small collective and
            one host sync each time). 0, the default: never.
        max_consecutive_skips: raise :class:`ShardScaleSkipError` (naming the step and the
            scale) when more consecutive steps than this are skipped, instead of skipping
            forever. None, the default: no limit.
        locate_overflow: on steps that overflow, find which parameters hold the inf/NaN
            gradients on which rank (:func:`find_nonfinite_grads`), keep the records in
            :attr:`last_overflow` and log them (WARNING, logger ``"shardscale"``). Clean steps
            pay nothing; an overflow step pays host reads and one ``all_gather_object``. Name
            the parameters by building the optimizer from ``model.named_parameters()``.

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: an argument is out of range; the message states the rule and the value.
    """

    # Whether unscale_() leaves the agreement to the next step/clip/update. The async scaler
    # agrees at once: its update() runs on another thread than its unscale_().
    _defers_agreement = True

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
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}: {enabled!r}")
        if not isinstance(dynamic, bool):
            raise TypeError(f"dynamic must be a bool, got {type(dynamic).__name__}: {dynamic!r}")
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(
                "process_group must be a torch.distributed.ProcessGroup or None, got "
                f"{type(process_group).__name__}"
            )
        device_type = _device_type(device)
        timeout = _timeout(sync_timeout)
        if isinstance(verify_every, bool) or not isinstance(verify_every, int):
            raise TypeError(f"verify_every must be an int, got {type(verify_every).__name__}")
        if verify_every < 0:
            raise ValueError(f"verify_every must be >= 0 (0: never), got {verify_every}")
        if max_consecutive_skips is not None:
            if isinstance(max_consecutive_skips, bool) or not isinstance(
                max_consecutive_skips, int
            ):
                raise TypeError(
                    "max_consecutive_skips must be an int or None, got "
                    f"{type(max_consecutive_skips).__name__}"
                )
            if max_consecutive_skips < 1:
                raise ValueError(
                    "max_consecutive_skips must be >= 1 (None: no limit), got "
                    f"{max_consecutive_skips}"
                )
        if not isinstance(locate_overflow, bool):
            raise TypeError(f"locate_overflow must be a bool, got {type(locate_overflow).__name__}")
        policy = ScalePolicy(
            init_scale=(2.0**16 if dynamic else 1.0) if init_scale is None else init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            hysteresis=hysteresis,
            min_scale=min_scale,
            max_scale=float("inf") if max_scale is None else max_scale,
            dynamic=dynamic,
        )
        if enabled and device_type == "cuda" and not torch.cuda.is_available():
            warnings.warn(
                "ShardedGradScaler(device='cuda') is enabled, but CUDA is not available. "
                "Disabling (as torch.amp.GradScaler does); leave device unset to follow the loss.",
                ShardScaleWarning,
                stacklevel=2,
            )
            enabled = False
        initial = ScalerState(policy=policy, scale=policy.initial_state(), counters=Counters())
        self._setup(
            device_type,
            enabled,
            Agreement(process_group, timeout),
            initial,
            verify_every,
            max_consecutive_skips,
            locate_overflow,
        )

    def _setup(
        self,
        device_type: str | None,
        enabled: bool,
        agreement: Agreement,
        initial: ScalerState,
        verify_every: int,
        max_consecutive_skips: int | None,
        locate_overflow: bool,
    ) -> None:
        self._device_type = device_type
        self._enabled = enabled
        self._agreement = agreement
        self._verify_every = verify_every
        self._reporter = StepReporter(max_consecutive_skips)
        self._locate_overflow = locate_overflow
        self._last_overflow: list[NonFiniteGrad] = []
        # The steps counted so far, kept on the host too: error messages name the step without
        # reading the device.
        self._steps = initial.counters.steps
        # Host-side state until the first scale() puts it on the loss's device.
        self._initial = initial
        self._device_state: DeviceState | None = None
        # The scale the losses are multiplied by: a copy of the live scale, made once per
        # update, so update() never modifies a tensor autograd saved for a pending backward.
        self._loss_scale: torch.Tensor | None = None
        self._records: dict[int, _OptimizerRecord] = {}
        self._clipped: _Clipped | None = None
        # The last step()'s decision: a bool where the host already read it, else the device flag.
        self._last_skip: bool | torch.Tensor = False
        self._warned_at_floor = False
        # Whether this rank called scale() (a pipeline stage before the last never does).
        self._scaled_here = False
        # This rank's state was made by a step, not by scale(): until the group confirms that
        # some rank scales, its gradients are checked but not modified.
        self._scale_unconfirmed = False
        self._warned_plain_replicas = False
        # This rank's gradient walks, reused while the gradients stay the same tensors.
        self._grad_cache = GradCache()
        self._pending: _Pending | None = None

    # ------------------------------------------------------------------ settings

    @property
    def policy(self) -> ScalePolicy:
        """The current scale policy (growth, backoff, hysteresis, floor, ceiling)."""
        return self._initial.policy

    def _set_policy(self, **changes: Any) -> None:
        self._initial = replace(self._initial, policy=replace(self._initial.policy, **changes))

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

        The result keeps each input's dtype. Other iterables are scaled lazily, as torch does.

        Raises:
            TypeError: an output is not a floating-point tensor.
            ValueError: a tensor is on another device type than ``device`` named.
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
        if self._device_type is not None and output.device.type != self._device_type:
            raise ValueError(
                f"scale() got a tensor on {output.device}, but this scaler was built with "
                f"device={self._device_type!r}; pass the loss's device, or leave device unset"
            )
        if self._device_state is None:
            # The scale lives where the first loss does.
            self._device_state = DeviceState.create(self._initial, output.device)
        self._scaled_here = True
        return (output * move(self._loss_factor(), output.device)).to(output.dtype)

    def _loss_factor(self) -> torch.Tensor:
        """The scale to multiply losses by: a copy of the live scale, made once per update."""
        if self._loss_scale is None:
            self._loss_scale = self._require_state("scale").scale.clone()
        return self._loss_scale

    def unscale_(self, optimizer: OptimizerTarget) -> None:
        """Divide ``optimizer``'s gradients by the scale in place, and check them for inf/NaN.

        Optional: :meth:`step` unscales by itself. Call it to clip or inspect unscaled
        gradients between backward and :meth:`step`. The check is local; the ranks agree on it
        at the next point that needs their decision or a global norm (:meth:`step`,
        :meth:`clip_grad_norm_`, :meth:`update`), in that point's one collective, so
        ``unscale_`` + ``clip_grad_norm_`` + ``step`` cost one collective. No host
        synchronisation. ``optimizer`` may be a list of optimizers, or a container of them
        (torchtitan's ``OptimizersContainer``, Megatron's ``ChainedOptimizer``).

        Raises:
            RuntimeError: called twice for this optimizer, or after :meth:`step`, before
                :meth:`update`; or no rank holds a gradient for it.
        """
        if not self._enabled:
            return
        leaves = [leaf for item in steppables(optimizer) for leaf in item.leaves]
        self._ensure_state("unscale_", leaves)
        begun = [self._begin(leaf, "unscale_") for leaf in leaves]
        pending = []
        for record, _scale in begun:
            if self._take_clipped(record):  # clip_grad_norm_ unscaled these already
                continue
            if record.stage is _Stage.UNSCALED:
                raise RuntimeError(
                    "unscale_() has already been called on this optimizer since the last update()."
                )
            if record.stage is _Stage.STEPPED:
                raise RuntimeError("unscale_() is being called after step().")
            pending.append(record)
        if pending and (self._scale_unconfirmed or not self._defers_agreement):
            self._check_and_agree(pending, [], begun[0][1], "unscale_")
        elif pending:
            self._check_locally(pending, begun[0][1])
        for record, _scale in begun:
            self._end(record)

    def _check_locally(self, records: list[_OptimizerRecord], scale: torch.Tensor) -> None:
        """Unscale and check ``records``' gradients in place; leave the agreement pending."""
        with torch.no_grad():
            walk = self._grad_cache.walk(
                ("unscale", *(id(r.optimizer) for r in records)),
                (p for record in records for p in optimizer_params(record.optimizer)),
            )
            flags = check_and_unscale_(walk.kernel_groups(), _inverse(scale))
        if self._pending is None:
            self._pending = _Pending(records=[], flags=[], holds=False)
        self._pending.records.extend(records)
        self._pending.flags.extend(flags.values())
        self._pending.holds = self._pending.holds or walk.holds
        for record in records:
            record.stage = _Stage.UNSCALED

    def step(self, optimizer: OptimizerTarget, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless done), then run ``optimizer.step()`` unless any rank overflowed.

        Optimizers that take the scale themselves (``_step_supports_amp_scaling``: torch's
        ``fused=True``) receive ``grad_scale`` and the agreed ``found_inf`` and skip on device,
        with no host synchronisation; others cost one host synchronisation for the decision.

        ``optimizer`` may also be a list of optimizers, or a container of them (torchtitan's
        ``OptimizersContainer``: an ``Optimizer`` holding its parts in ``optimizers``;
        Megatron's ``ChainedOptimizer``: ``chained_optimizers``): every optimizer underneath
        is checked in ONE collective, fused ones get the scale and the flag, and the
        container's own ``step()`` is called once. Stepping optimizers one call at a time
        costs one collective each, as torch's rules have it.

        Returns:
            What ``optimizer.step(*args, **kwargs)`` returns, or None when skipped; for a list,
            a list of those.

        Raises:
            RuntimeError: a ``closure`` is passed, or step() already ran since :meth:`update`.
        """
        items = steppables(optimizer)
        if not self._enabled:
            results = [item.target.step(*args, **kwargs) for item in items]
            return results if isinstance(optimizer, (list, tuple)) else results[0]
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        leaves = [leaf for item in items for leaf in item.leaves]
        self._ensure_state("step", leaves)
        begun = [self._begin(leaf, "step") for leaf in leaves]
        if any(record.stage is _Stage.STEPPED for record, _scale in begun):
            raise RuntimeError("step() has already been called since the last update().")
        scale = begun[0][1]
        for record, _scale in begun:
            self._take_clipped(record)
        ready = [record for record, _scale in begun if record.stage is _Stage.READY]
        # Fused optimizers unscale inside their own kernel: check their gradients, don't write.
        still_scaled = [record for record in ready if takes_scale(record.optimizer)]
        to_unscale = [record for record in ready if not takes_scale(record.optimizer)]
        if ready or self._pending is not None:
            self._check_and_agree(to_unscale, still_scaled, scale, "step")
        records = {id(record.optimizer): record for record, _scale in begun}
        decisions: dict[int, bool] = {}  # host reads of agreed flags, one per distinct flag
        results = []
        for item in items:
            item_records = [records[id(leaf)] for leaf in item.leaves]
            found_inf = _combined([r.found_inf for r in item_records])
            if all(takes_scale(leaf) for leaf in item.leaves):
                results.append(
                    self._step_on_device(item, item_records, found_inf, scale, args, kwargs)
                )
            else:
                if id(found_inf) not in decisions:  # the step's one host synchronisation
                    decisions[id(found_inf)] = bool(found_inf.item())
                skipped = decisions[id(found_inf)]
                results.append(
                    None
                    if skipped
                    else self._step_on_device(item, item_records, found_inf, scale, args, kwargs)
                )
            for record in item_records:
                record.stage = _Stage.STEPPED
        overall = _combined([record.found_inf for record, _scale in begun])
        self._last_skip = decisions.get(id(overall), overall)
        for record, _scale in begun:
            self._end(record)
        return results if isinstance(optimizer, (list, tuple)) else results[0]

    def _step_on_device(
        self,
        item: Steppable,
        records: list[_OptimizerRecord],
        found_inf: torch.Tensor,
        scale: torch.Tensor,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """Step ``item``, handing every fused optimizer in it the scale and the agreed flag.

        A fused optimizer whose gradients are still scaled gets ``grad_scale`` (times its
        own, if the user set one); one already unscaled (``unscale_``, ``clip_grad_norm_``)
        gets only its own. It then skips on the device if ``found_inf`` is 1.0.
        """
        handed = []
        for leaf, record in zip(item.leaves, records, strict=True):
            if not takes_scale(leaf):
                continue
            user_grad_scale = getattr(leaf, "grad_scale", None)
            if record.stage is _Stage.READY:  # still scaled
                grad_scale = scale if user_grad_scale is None else scale * user_grad_scale
            else:
                grad_scale = user_grad_scale
            leaf.grad_scale = grad_scale  # type: ignore[attr-defined]
            leaf.found_inf = found_inf  # type: ignore[attr-defined]
            handed.append(leaf)
        try:
            return item.target.step(*args, **kwargs)
        finally:
            for leaf in handed:
                del leaf.grad_scale  # type: ignore[attr-defined]
                del leaf.found_inf  # type: ignore[attr-defined]

    def clip_grad_norm_(
        self,
        parameters: torch.Tensor | Iterable[torch.Tensor],
        max_norm: float,
        norm_type: float = 2.0,
        *,
        replica_group: dist.ProcessGroup | DeviceMesh | int | None = None,
    ) -> torch.Tensor:
        """Unscale, then clip gradients to a global norm over all shards, in one collective.

        Replaces ``scaler.unscale_(optimizer)`` + ``torch.nn.utils.clip_grad_norm_``: the
        norm's partial sums travel in the same all-reduce as the overflow flag, so scale →
        backward → clip → :meth:`step` → :meth:`update` costs one collective per step. The
        norm is global: every rank's shards and every pipeline stage's parameters count, and
        replicas count once. DTensor gradients (FSDP2, HSDP, TP, expert parallel) say their
        replicas themselves (their mesh and placements); plain tensors and FSDP1 flat
        parameters are replicated over ``replica_group``. Two passes over the gradients (one
        read, one read+write), no host synchronisation.

        Call it on every rank, after backward and before :meth:`step` of the optimizers owning
        ``parameters``; their step then reuses this check. After :meth:`unscale_` (torch's
        order) it clips the unscaled gradients, and unscale_'s check rides in the same
        collective: still one per step.

        Args:
            parameters: the parameters (or one tensor) whose gradients to clip, as given to
                ``torch.nn.utils.clip_grad_norm_``; every rank passes its own (its model or
                pipeline stage's ``parameters()``).
            max_norm: the norm to clip to (> 0).
            norm_type: the p of the p-norm (> 0), or ``math.inf``.
            replica_group: the ranks holding the same plain (non-DTensor) gradients as this
                rank: a ``ProcessGroup``, a 1-D ``DeviceMesh``, or their number. None (the
                default): every rank of the scaler's group, as under DDP. Under pipeline
                parallelism a stage's plain parameters live on that stage's ranks only: pass
                its data-parallel group (PP x DDP), or 1 (pure PP).

        Returns:
            The total (unscaled, unclipped) norm as a float32 scalar tensor, identical on every
            rank; non-finite on every rank if any rank's gradients overflowed (the coming step
            is then skipped everywhere).

        Raises:
            RuntimeError: called twice before :meth:`update`, or after some but not all of an
                optimizer's parameters were unscaled; or no rank holds a gradient.
            ValueError, TypeError: ``max_norm``, ``norm_type`` or ``replica_group`` breaks its
                rule.
        """
        max_norm, norm_type = check_clip_args(max_norm, norm_type)
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        replicas = self._replicas_of(replica_group)
        if not self._enabled:
            return self._clip(params, max_norm, norm_type, replicas, None).total_norm  # type: ignore[return-value]
        self._ensure_state("clip_grad_norm_", params)
        scale = self._require_state("clip_grad_norm_").scale
        if self._clipped is not None:
            raise RuntimeError("clip_grad_norm_() has already been called since the last update().")
        ids = frozenset(id(p) for p in params)
        unscaled = [r for r in self._records.values() if r.stage is not _Stage.READY]
        done = {id(p) for r in unscaled for p in optimizer_params(r.optimizer)}
        if done and ids <= done:  # unscale_() ran for these already: exchange only the norm
            return self._clip(params, max_norm, norm_type, replicas, None).total_norm  # type: ignore[return-value]
        if ids & done:
            raise RuntimeError(
                "clip_grad_norm_() got parameters of which some, but not all, were already "
                "unscaled by unscale_(): clip each optimizer's parameters after its unscale_(), "
                "or all of them before any unscale_()"
            )
        verdict = self._clip(params, max_norm, norm_type, replicas, scale)
        self._clipped = _Clipped(param_ids=ids, found_inf=verdict.found_inf)
        assert verdict.total_norm is not None
        return verdict.total_norm

    def _replicas_of(self, replica_group: dist.ProcessGroup | DeviceMesh | int | None) -> int:
        if replica_group is None:
            return self._agreement.world_size
        if isinstance(replica_group, DeviceMesh):
            if replica_group.ndim != 1:
                raise ValueError(
                    f"replica_group must be a 1-D DeviceMesh, got one of shape "
                    f"{tuple(replica_group.shape)}: slice it by the data-parallel dimension"
                )
            return replica_group.size()
        if isinstance(replica_group, dist.ProcessGroup):
            return dist.get_world_size(replica_group)
        if isinstance(replica_group, bool) or not isinstance(replica_group, int):
            raise TypeError(
                "replica_group must be a ProcessGroup, a 1-D DeviceMesh, an int or None, got "
                f"{type(replica_group).__name__}"
            )
        world_size = self._agreement.world_size
        if not 1 <= replica_group <= world_size:
            raise ValueError(
                f"replica_group must be in [1, {world_size}] (the scaler's group size), got "
                f"{replica_group}"
            )
        return replica_group

    def _clip(
        self,
        params: list[torch.Tensor],
        max_norm: float,
        norm_type: float,
        replicas: int,
        scale: torch.Tensor | None,
    ) -> Verdict:
        """Norm (one read), agreement (one collective), unscale and clip (one read+write).

        ``scale``: the scale the gradients still carry, or None if they carry none (already
        unscaled, or a disabled scaler). Checks :meth:`unscale_` left pending are agreed on in
        the same collective.
        """
        pending, self._pending = self._pending, None
        with torch.no_grad():
            walk = self._grad_cache.walk(("clip", replicas), params)
            groups, plain = walk.norm_groups(replicas)
            self._warn_if_plain_replicas_assumed(plain, replicas)
            if scale is not None:
                device = scale.device
                inv_scale = _inverse(scale)
            else:
                device = next(iter(groups))[0] if groups else _CPU
                inv_scale = torch.ones((), dtype=torch.float32, device=device)
            share, norm_flags = local_norms(groups, norm_type, inv_scale, device)
            flags = list(pending.flags) if pending is not None else []
            if scale is not None:  # this pass is the check of still-scaled gradients
                if not norm_flags_exact(groups, norm_type):
                    norm_flags = check_and_unscale_(by_device_dtype(groups), None)
                flags.extend(norm_flags.values())
            confirm = "clip_grad_norm_" if scale is not None and self._scale_unconfirmed else None
            holds = walk.holds or (pending is not None and pending.holds)
            ballot = self._agreement.ballot(
                device, holds_grads=holds, has_scale=confirm is None, with_norm=True
            )
            verdict = self._agreement.agree(
                ballot,
                flags,
                device=device,
                step=self._steps + 1,
                confirm_scale=confirm,
                norm_share=share,
                norm_type=norm_type,
            )
            self._scale_unconfirmed = self._scale_unconfirmed and confirm is None
            assert verdict.total_norm is not None
            apply_(groups, max_norm, verdict.total_norm, None if scale is None else inv_scale)
        if pending is not None:
            for record in pending.records:
                record.found_inf = verdict.found_inf
            self._locate_if_overflowed(verdict.found_inf, pending.records)
        return verdict

    def _warn_if_plain_replicas_assumed(self, plain: bool, replicas: int) -> None:
        """Warn, once, where the default replica group is most likely wrong: a pipeline stage."""
        world_size = self._agreement.world_size
        if not plain or self._scaled_here or replicas != world_size or world_size == 1:
            return
        if self._warned_plain_replicas:
            return
        self._warned_plain_replicas = True
        warnings.warn(
            "clip_grad_norm_ on a rank that never called scale() (a pipeline stage that computes "
            "no loss?) got plain (non-DTensor) gradients and, with replica_group=None, takes "
            f"them as replicated on all {world_size} ranks of the scaler's group (as under DDP). "
            "If they are this stage's own, pass replica_group= (the stage's data-parallel group, "
            "or 1 for pure pipeline parallelism): otherwise the norm is too small.",
            ShardScaleWarning,
            stacklevel=3,
        )

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Move the scale: back off if any optimizer skipped, grow after enough clean steps.

        Device-side maths on the agreed flags: no collective, no host synchronisation.

        Args:
            new_scale: set the scale to this value instead: a float in
                ``[min_scale, max_scale]``, or a one-element tensor without grad (taken as given:
                checking its value would cost a host synchronisation).

        Raises:
            RuntimeError: no optimizer was stepped or unscaled since the last update().
        """
        if not self._enabled:
            return
        scale = self._require_state("update").scale
        if self._pending is not None:  # unscale_() without step(): agree on its check now
            self._check_and_agree([], [], scale, "update")
        found_infs = [r.found_inf for r in self._records.values() if r.found_inf is not None]
        if new_scale is None and not found_infs:
            raise RuntimeError("No inf checks were recorded prior to update.")
        manual = None if new_scale is None else self._checked_new_scale(new_scale)
        self._records = {}
        self._clipped = None
        self._apply(found_infs, manual)

    def _apply(self, found_infs: list[torch.Tensor], manual: torch.Tensor | None) -> None:
        """Count the step and move the scale from the agreed flags (or set it to ``manual``)."""
        device_state = self._require_state("update")
        scale = device_state.scale
        if found_infs:
            found_inf = found_infs[0] if len(found_infs) == 1 else torch.stack(found_infs).amax()
            device_state.count_step_(found_inf)
            self._steps += 1
            if manual is None:
                self.policy.update_(
                    scale, device_state.growth_tracker, device_state.hysteresis_tracker, found_inf
                )
        if manual is not None:
            scale.copy_(manual)
        self._loss_scale = None
        if scale.device.type == "cpu":  # reading the state costs no device synchronisation
            self._warn_if_at_floor()
        if found_infs:
            self._reporter.push(device_state)
        if self._verify_every and found_infs and self._steps % self._verify_every == 0:
            self.verify_agreement()

    def _checked_new_scale(self, new_scale: float | torch.Tensor) -> torch.Tensor:
        if isinstance(new_scale, torch.Tensor):
            if new_scale.numel() != 1 or new_scale.requires_grad:
                raise ValueError(
                    "new_scale must be a float or a one-element tensor with requires_grad=False, "
                    f"got shape {tuple(new_scale.shape)}, requires_grad={new_scale.requires_grad}"
                )
            return new_scale.detach().reshape(())
        if isinstance(new_scale, bool) or not isinstance(new_scale, (int, float)):
            raise TypeError(
                f"new_scale must be a float or a tensor, got {type(new_scale).__name__}"
            )
        self.policy.check_scale("new_scale", float(new_scale))
        return torch.tensor(float(new_scale), dtype=torch.float32)

    # ------------------------------------------------------------------ what happened

    @property
    def last_step_skipped(self) -> bool:
        """Whether the most recent :meth:`step` skipped the optimizer (on every rank).

        Free after a non-fused step (its decision was already read); after a fused step,
        reading it costs one host synchronisation on an accelerator.
        """
        if isinstance(self._last_skip, torch.Tensor):
            # Read each time, never cached: a CUDA-graph replay updates this very tensor.
            return bool(self._last_skip.item())
        return self._last_skip

    @property
    def stats(self) -> ScalerStats:
        """Steps, skipped steps, consecutive skips, the scale and the last overflow's step.

        Identical on every rank; right for fused optimizers too (counted on the device). One
        host read of one small tensor (a synchronisation on an accelerator); no collective.
        """
        self._reporter.flush()
        if self._device_state is None:
            scale = self._initial.scale.scale if self._enabled else 1.0
            return stats_of(scale, self._initial.counters)
        return stats_from(self._device_state.packed().tolist())

    def register_stats_hook(self, hook: StatsHook) -> RemovableHandle:
        """Call ``hook(stats)`` after every :meth:`update` that counted a step.

        For TensorBoard / W&B: ``stats`` is a :class:`ScalerStats`. On the CPU the hook runs
        inside that update(); on an accelerator it runs one update() later (or when
        :attr:`stats` is read), so that reading the numbers never stalls the step.

        Returns:
            A handle whose ``remove()`` unregisters the hook.
        """
        if not callable(hook):
            raise TypeError(f"hook must be callable, got {type(hook).__name__}")
        return self._reporter.register(hook)

    @property
    def last_overflow(self) -> list[NonFiniteGrad]:
        """With ``locate_overflow=True``: where the last overflow step's inf/NaN gradients were.

        :class:`NonFiniteGrad` records (rank, name, num_inf, num_nan), identical on every
        rank. Empty before the first overflow, or without ``locate_overflow``.
        """
        return list(self._last_overflow)

    def get_scale(self) -> float:
        """Return the current scale (1.0 when disabled). Costs a host sync on an accelerator."""
        if not self._enabled:
            return 1.0
        if self._device_state is None:
            return self._initial.scale.scale
        self._warn_if_at_floor()
        return float(self._device_state.scale.item())

    @property
    def _scale(self) -> torch.Tensor | None:
        """The scale tensor, under torch's private name (frameworks read it)."""
        return None if self._device_state is None else self._device_state.scale

    def _get_scale_async(self) -> torch.Tensor | None:
        """The scale tensor without a sync (torch's private accessor, used by frameworks)."""
        return self._scale

    @property
    def _device(self) -> str:
        """The device type, under torch's private name (accelerate reads it on resume)."""
        if self._device_state is not None:
            return self._device_state.scale.device.type
        return self._device_type or "cpu"

    def _lazy_init_scale_growth_tracker(self, dev: str | torch.device) -> None:
        """Put the state on ``dev`` now rather than at the first :meth:`scale` (torch's private
        hook: accelerate calls it after loading a state dict for FSDP2)."""
        if self._enabled and self._device_state is None:
            device = torch.device(dev)
            if device.type != "cpu" and device.index is None:
                device = torch.device(
                    device.type, torch.get_device_module(device.type).current_device()
                )
            self._device_state = DeviceState.create(self._initial, device)

    def _get_growth_tracker(self) -> int:
        return self._read_state().scale.growth_tracker if self._enabled else 0

    def verify_agreement(self) -> None:
        """Check that every rank holds the same scaler state, in one small collective.

        Compares the scale, the trackers, the counters and the policy settings. They always
        agree if every rank ran the same steps and loaded the same state; this catches the
        cases where they did not (a state dict loaded on some ranks only, a rank restarted
        from another checkpoint). A no-op at world size 1. Costs one host synchronisation.

        Raises:
            ShardScaleDistributedError: the ranks differ; the message lists every rank's values
                for each field that differs. Or a rank did not arrive within ``sync_timeout``.
        """
        if not self._enabled or self._agreement.world_size == 1:
            return
        state = self._device_state
        device = torch.device("cpu") if state is None else state.scale.device
        self._agreement.compare(to_state_dict(self._read_state()), device, self._steps)

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """Return the state as Python numbers; empty when disabled, as torch's.

        Torch's keys (``scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``,
        ``_growth_tracker``) keep their meaning, so ``torch.amp.GradScaler`` loads it; ours add
        ``hysteresis``, ``_hysteresis_tracker``, ``min_scale``, ``max_scale``, ``dynamic``,
        ``steps``, ``skipped_steps`` and ``consecutive_skips``. With ``state_dict`` and
        :meth:`load_state_dict` the scaler is a ``torch.distributed.checkpoint`` Stateful.
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
        self._initial = state
        self._steps = state.counters.steps
        self._loss_scale = None
        if self._device_state is not None:
            self._device_state.write(state)

    def __getstate__(self) -> dict[str, Any]:
        if self._records:
            raise RuntimeError(
                "A GradScaler instance may only be pickled at the beginning "
                "of an iteration, or at the end after scaler.update()."
            )
        if self.process_group is not None:
            raise TypeError(
                "a ShardedGradScaler bound to an explicit process_group cannot be pickled "
                "(process groups cannot be); save state_dict() instead"
            )
        return {
            "device_type": self._device_type,
            "enabled": self._enabled,
            "state": self._read_state() if self._enabled else self._initial,
            "sync_timeout": self._agreement.timeout,
            "verify_every": self._verify_every,
            "max_consecutive_skips": self._reporter.max_consecutive_skips,
            "locate_overflow": self._locate_overflow,
        }

    def __setstate__(self, pickled: dict[str, Any]) -> None:
        agreement = Agreement(None, pickled["sync_timeout"])
        self._setup(
            pickled["device_type"],
            pickled["enabled"],
            agreement,
            pickled["state"],
            pickled["verify_every"],
            pickled["max_consecutive_skips"],
            pickled["locate_overflow"],
        )

    # ------------------------------------------------------------------ internals

    def _require_state(self, funcname: str) -> DeviceState:
        if self._device_state is None:
            raise RuntimeError(no_scale_message(funcname))
        return self._device_state

    def _ensure_state(
        self, funcname: str, source: Iterable[torch.optim.Optimizer] | list[torch.Tensor]
    ) -> None:
        """Give a rank that never called ``scale()`` its state, where its gradients are.

        In a pipeline only the last stage computes a loss; the others never call ``scale()``,
        yet hold the same scale (every rank does) and must check, step and update with the
        rest. Alone in its group, a rank without a scale raises torch's error instead: nobody
        else can have scaled its loss.
        """
        if self._device_state is not None:
            return
        if self._agreement.world_size == 1:
            raise RuntimeError(no_scale_message(funcname))
        items = list(source)
        params = (
            [p for optimizer in items for p in optimizer_params(optimizer)]  # type: ignore[arg-type]
            if items and not isinstance(items[0], torch.Tensor)
            else items
        )
        self._device_state = DeviceState.create(self._initial, grads_device(params))  # type: ignore[arg-type]
        self._scale_unconfirmed = True

    def _begin(
        self, optimizer: torch.optim.Optimizer, funcname: str
    ) -> tuple[_OptimizerRecord, torch.Tensor]:
        """This iteration's record for ``optimizer``, and the scale its losses were given."""
        scale = self._require_state(funcname).scale
        record = self._records.get(id(optimizer))
        if record is None:
            record = _OptimizerRecord(optimizer, step=self._steps + 1)
            self._records[id(optimizer)] = record
        return record, scale

    def _end(self, record: _OptimizerRecord) -> None:
        """Called after unscale_() or step() finished with ``record`` (a hook for subclasses)."""

    def _take_clipped(self, record: _OptimizerRecord) -> bool:
        """Adopt ``clip_grad_norm_``'s unscale and flag if it covered this optimizer's grads."""
        clipped = self._clipped
        if clipped is None or record.stage is not _Stage.READY:
            return False
        with torch._C.DisableTorchFunctionSubclass():  # DTensor .grad: 0.1 us, not 0.25
            mine = {id(p) for p in optimizer_params(record.optimizer) if p.grad is not None}
        if mine <= clipped.param_ids:
            record.found_inf = clipped.found_inf
            record.stage = _Stage.UNSCALED
            self._locate_if_overflowed(clipped.found_inf, [record])
            return True
        if mine & clipped.param_ids:
            raise RuntimeError(
                "clip_grad_norm_() unscaled some, but not all, of this optimizer's gradients: "
                "pass every parameter of the optimizers it precedes (e.g. model.parameters())"
            )
        return False

    def _check_and_agree(
        self,
        to_unscale: list[_OptimizerRecord],
        to_check: list[_OptimizerRecord],
        scale: torch.Tensor,
        funcname: str,
    ) -> None:
        """Check (and unscale) the records' gradients, then agree on ONE flag for all of them.

        ``to_unscale``'s gradients are divided by the scale in place (their stage becomes
        UNSCALED); ``to_check``'s are only checked (fused optimizers unscale them in their own
        kernel). Every record gets the agreed ``found_inf``. On a rank that never called
        ``scale()`` nothing is modified until the group has confirmed that some rank did.
        """
        confirm = funcname if self._scale_unconfirmed else None
        inv_scale = _inverse(scale)
        pending, self._pending = self._pending, None
        earlier = pending.records if pending is not None else []
        records = to_unscale + to_check + earlier
        with torch.no_grad():
            unscaling = self._grad_cache.walk(
                ("unscale", *(id(r.optimizer) for r in to_unscale)),
                (p for record in to_unscale for p in optimizer_params(record.optimizer)),
            )
            checking = self._grad_cache.walk(
                ("check", *(id(r.optimizer) for r in to_check)),
                (p for record in to_check for p in optimizer_params(record.optimizer)),
            )
            unscale_groups = unscaling.kernel_groups()
            holds = unscaling.holds or checking.holds or (pending is not None and pending.holds)
            ballot = self._agreement.ballot(scale.device, holds_grads=holds, has_scale=not confirm)
            inverse = None if confirm else inv_scale
            flags = check_and_unscale_(unscale_groups, inverse, ballot.flags())
            flags = check_and_unscale_(checking.kernel_groups(), None, flags)
            verdict = self._agreement.agree(
                ballot,
                [*flags.values(), *(pending.flags if pending is not None else ())],
                device=scale.device,
                step=self._steps + 1,
                confirm_scale=confirm,
            )
            if confirm:  # the group confirmed that some rank scaled: unscale now
                self._scale_unconfirmed = False
                multiply_(unscale_groups, inv_scale)
        for record in records:
            record.found_inf = verdict.found_inf
        for record in to_unscale:
            record.stage = _Stage.UNSCALED
        self._locate_if_overflowed(verdict.found_inf, records)

    def _locate_if_overflowed(
        self, found_inf: torch.Tensor, records: list[_OptimizerRecord]
    ) -> None:
        """With ``locate_overflow``: on an overflow step, find and log the non-finite grads."""
        if not (self._locate_overflow and found_inf.item()):  # every rank reads the same flag
            return
        self._last_overflow = locate(
            (pair for record in records for pair in optimizer_named_params(record.optimizer)),
            self._agreement.process_group,
        )
        logger.warning(
            "step %d overflowed; non-finite gradients at: %s",
            records[0].step,
            "; ".join(map(str, self._last_overflow)) or "(none: already cleared)",
        )

    def _warn_if_at_floor(self) -> None:
        """Warn, once, when the scale has backed off to ``min_scale`` and cannot go lower."""
        if self._warned_at_floor or self._device_state is None or not self.policy.dynamic:
            return
        device_state = self._device_state
        if device_state.scale.item() <= self.policy.min_scale and device_state.counters[1] > 0:
            self._warned_at_floor = True
            warnings.warn(
                f"the loss scale has backed off to min_scale={self.policy.min_scale} (by step "
                f"{self._steps}) and cannot go lower: steps that still "
                "overflow are skipped and the scale holds. Gradients that are non-finite even "
                "at this scale usually mean a NaN/inf in the model or the loss.",
                ShardScaleWarning,
                stacklevel=3,
            )

    def _read_state(self) -> ScalerState:
        if self._device_state is None:
            return self._initial
        return self._device_state.read(self.policy)
