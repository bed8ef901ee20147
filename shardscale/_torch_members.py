"""torch's private members on the scaler class, answered from our agreed state.

`torch.amp.GradScaler`'s private members are part of its de-facto API: public training scripts,
frameworks and torch's own tests read `_scale`, `_per_optimizer_states`, `_found_inf_per_device`,
call `_unscale_grads_`, `_check_inf_per_device`, `_maybe_opt_step`, and set `_init_scale`. This
mixin gives [`ShardedGradScaler`][shardscale.ShardedGradScaler] every one of them, defined here
(never torch's logic on our state), each reading the agreed state or refusing a write it cannot
honour. The view objects themselves live in `shardscale._compat`.

Invariant: nothing here runs on a step unless it is called or read.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from shardscale import _compat
from shardscale._check import combined
from shardscale._device_state import DeviceState, ScaleHome
from shardscale._iteration import IterationBook, Stage
from shardscale._optimizers import OptimizerTarget, steppables

if TYPE_CHECKING:
    from shardscale._agree import Agreement
    from shardscale._checkpoint import ScalerState
    from shardscale._config import ScalerConfig
    from shardscale._policy import ScalePolicy
    from shardscale._stepping import Stepper

__all__ = ["TorchPrivateMembers"]


class TorchPrivateMembers:
    """The private members of `torch.amp.GradScaler`, for a scaler that holds our parts.

    A mixin: the scaler class provides the state below (its `_setup` sets it).
    """

    _enabled: bool
    _config: ScalerConfig
    _home: ScaleHome
    _agreement: Agreement
    _stepper: Stepper
    _book: IterationBook
    _last_skip: bool | torch.Tensor

    if TYPE_CHECKING:

        @property
        def policy(self) -> ScalePolicy: ...
        def get_growth_factor(self) -> float: ...
        def set_growth_factor(self, new_factor: float) -> None: ...
        def get_backoff_factor(self) -> float: ...
        def set_backoff_factor(self, new_factor: float) -> None: ...
        def get_growth_interval(self) -> int: ...
        def set_growth_interval(self, new_interval: int) -> None: ...
        def _require_state(self, funcname: str) -> DeviceState: ...
        def _ensure_state(
            self, funcname: str, source: Iterable[torch.optim.Optimizer] | list[torch.Tensor]
        ) -> DeviceState: ...
        def _read_state(self) -> ScalerState: ...

    @property
    def _scale(self) -> torch.Tensor | None:
        """The scale tensor (None before the first `scale()`), under torch's private name.

        The live tensor: in-place writes (`fill_`) set the scale. Assigning another tensor is
        refused: use `update(new_scale=...)` or `load_state_dict`.
        """
        return None if self._home.device is None else self._home.device.scale

    @_scale.setter
    def _scale(self, value: object) -> None:
        self._refuse_write("_scale", "update(new_scale=...) or load_state_dict()")

    @property
    def _growth_tracker(self) -> torch.Tensor | None:
        """The int32 growth tracker tensor (None before the first `scale()`), as torch's."""
        return None if self._home.device is None else self._home.device.growth_tracker

    @_growth_tracker.setter
    def _growth_tracker(self, value: object) -> None:
        self._refuse_write("_growth_tracker", "load_state_dict()")

    def _get_scale_async(self) -> torch.Tensor | None:
        """The scale tensor without a sync (torch's private accessor, used by frameworks)."""
        return self._scale

    def _get_growth_tracker(self) -> int:
        """The growth tracker as an int (one host read once the state is on a device)."""
        return self._read_state().scale.growth_tracker if self._enabled else 0

    @property
    def _device(self) -> str:
        """The device type, under torch's private name (accelerate reads it on resume)."""
        if self._home.device is not None:
            return self._home.device.scale.device.type
        return self._config.device or "cpu"

    @_device.setter
    def _device(self, value: object) -> None:
        self._refuse_write("_device", "the device argument, or the first loss's device")

    @property
    def _init_scale(self) -> float:
        """The scale the state starts from when it is put on a device (torch's meaning: set by
        the constructor and by `load_state_dict`; later steps do not change it)."""
        return self._home.host.scale.scale

    @_init_scale.setter
    def _init_scale(self, value: float) -> None:
        scale = float(value)
        self.policy.check_scale("_init_scale", scale)
        self._home.host = replace(
            self._home.host, scale=replace(self._home.host.scale, scale=scale)
        )

    @property
    def _init_growth_tracker(self) -> int:
        """The growth tracker the state starts from, as `_init_scale` (torch's meaning)."""
        return self._home.host.scale.growth_tracker

    @_init_growth_tracker.setter
    def _init_growth_tracker(self, value: int) -> None:
        # Any int >= 0, as torch takes it (its own tests write 7 with growth_interval 1); a
        # tracker at or past the interval grows the scale at the next clean step.
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"_init_growth_tracker must be an int >= 0, got {value!r}")
        self._home.host = replace(
            self._home.host, scale=replace(self._home.host.scale, growth_tracker=value)
        )

    @property
    def _growth_factor(self) -> float:
        """`get_growth_factor()`; writing it is `set_growth_factor()` (checked)."""
        return self.get_growth_factor()

    @_growth_factor.setter
    def _growth_factor(self, value: float) -> None:
        self.set_growth_factor(value)

    @property
    def _backoff_factor(self) -> float:
        """`get_backoff_factor()`; writing it is `set_backoff_factor()` (checked)."""
        return self.get_backoff_factor()

    @_backoff_factor.setter
    def _backoff_factor(self, value: float) -> None:
        self.set_backoff_factor(value)

    @property
    def _growth_interval(self) -> int:
        """`get_growth_interval()`; writing it is `set_growth_interval()` (checked)."""
        return self.get_growth_interval()

    @_growth_interval.setter
    def _growth_interval(self, value: int) -> None:
        self.set_growth_interval(value)

    @property
    def _per_optimizer_states(self) -> _compat.OptimizerStates:
        """Per `id(optimizer)`: `{"stage": OptState, "found_inf_per_device": {device: flag}}`.

        A read-only view of this iteration, built when read: the flag is the AGREED one, so
        `sum(v.item() for v in ...["found_inf_per_device"].values())` says whether the step
        was skipped, alike on every rank. Readable after `step()` and before `update()`;
        after `update()` it is empty, as torch's (see `shardscale._compat.OptimizerStates`).
        """
        return _compat.OptimizerStates(self._compat_book(), self._settle)

    @_per_optimizer_states.setter
    def _per_optimizer_states(self, value: object) -> None:
        self._refuse_write("_per_optimizer_states", "unscale_(), step() and update()")

    def _compat_book(self) -> IterationBook:
        """The iteration torch's private views read."""
        return self._book

    def _settle(self, book: IterationBook) -> None:
        """Run the agreement `unscale_()` deferred, for a view that must show agreed flags."""
        self._stepper.resolve_pending(book, self._require_state("unscale_").scale, "unscale_")

    def _found_inf_per_device(self, optimizer: OptimizerTarget) -> dict[str, Any]:
        """`optimizer`'s agreed flag as `{device: flag}` (empty if not checked yet).

        (Annotated as torch annotates it; the keys are devices.)
        """
        states = self._per_optimizer_states
        leaves = [leaf for item in steppables(optimizer) for leaf in item.leaves]
        if len(leaves) == 1:
            return states[id(leaves[0])]["found_inf_per_device"]  # type: ignore[no-any-return]
        flags = [f for leaf in leaves for f in states[id(leaf)]["found_inf_per_device"].values()]
        if not flags:
            return _compat.ReadOnlyDict()
        flag = combined(flags)
        return _compat.ReadOnlyDict({flag.device: flag})

    def _check_inf_per_device(self, optimizer: OptimizerTarget) -> dict[str, Any]:
        """Check `optimizer`'s gradients (not unscaling them) and agree: one collective.

        torch's optimizers of the `grad_scaler=` protocol call it from their `step()`; the
        flag it returns, and records for `update()`, is the group's, alike on every rank.

        Raises:
            RuntimeError: no `scale()` yet on a rank alone (torch's words), or disabled.
        """
        if not self._enabled:
            raise RuntimeError("_check_inf_per_device() was called on a disabled scaler")
        leaves = [leaf for item in steppables(optimizer) for leaf in item.leaves]
        scale = self._ensure_state("_check_inf_per_device", leaves).scale
        records = [self._book.record(leaf) for leaf in leaves]
        self._stepper._check_and_agree(self._book, [], records, scale, "_check_inf_per_device")
        return self._found_inf_per_device(optimizer)

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool = True,
    ) -> dict[torch.device, torch.Tensor]:
        """torch's local unscale-and-check of `optimizer`'s gradients, on our gradient walk.

        As torch's: multiplies by `inv_scale`, raises `found_inf` (and copies of it on other
        devices), involves no other rank and records nothing (`shardscale._compat.unscale_grads`).
        `allow_fp16` defaults to True, as in torch's ShardedGradScaler.
        """
        return _compat.unscale_grads(optimizer, inv_scale, found_inf, allow_fp16)

    def _check_scale_growth_tracker(self, funcname: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The scale and growth tracker tensors; torch's words if `scale()` never ran.

        Raises:
            RuntimeError: no state on a device yet (torch raises AssertionError, same words).
        """
        state = self._require_state(funcname)
        return state.scale, state.growth_tracker

    def _lazy_init_scale_growth_tracker(self, dev: str | torch.device) -> None:
        """Put the state on `dev` now rather than at the first `scale()` (torch's private
        hook: accelerate calls it after loading a state dict for FSDP2). A no-op once there."""
        if self._enabled and self._home.device is None:
            device = torch.device(dev)
            if device.type != "cpu" and device.index is None:
                device = torch.device(
                    device.type, torch.get_device_module(device.type).current_device()
                )
            self._home.device = DeviceState.create(self._home.host, device)

    def _maybe_opt_step(
        self,
        optimizer: torch.optim.Optimizer,
        optimizer_state: Mapping[str, Any],
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        """torch's helper: step `optimizer` unless `optimizer_state`'s flags say inf/NaN
        (with our `_per_optimizer_states`, the agreed flag: every rank alike). The read is
        bounded by `sync_timeout`: the collective in flight is settled first."""
        flags = optimizer_state["found_inf_per_device"].values()
        if not any(self._agreement.read_flag(flag) for flag in flags):
            return optimizer.step(*args, **kwargs)
        return None

    def _step_passing_itself(
        self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """torch's deprecated protocol: call `optimizer.step(grad_scaler=self)`, warning.

        The optimizer unscales and skips itself; what it reads back is the agreed state.
        """
        leaves = [leaf for item in steppables(optimizer) for leaf in item.leaves]
        self._ensure_state("step", leaves)
        records, _adopted = self._book.begin_step(leaves)
        warnings.warn(_compat.GRAD_SCALER_WARNING, FutureWarning, stacklevel=3)
        result = optimizer.step(*args, **{**kwargs, "grad_scaler": self})
        flags = [record.found_inf for record in records]
        self._last_skip = combined(flags) if any(f is not None for f in flags) else False
        for record in records:
            record.stage = Stage.STEPPED
        return result

    def _refuse_write(self, name: str, instead: str) -> NoReturn:
        raise AttributeError(
            f"{type(self).__name__}.{name} mirrors shardscale's agreed state and cannot be "
            f"assigned; use {instead}"
        )
