"""DeepSpeed: one agreed loss scale for ZeRO 1-3 on the torch-autocast fp16 path.

DeepSpeed (0.17.2 and later) trains fp16 with torch's autocast when its config says
`"torch_autocast": {"enabled": true, "dtype": "torch.float16"}`. Its ZeRO optimizers then build
a plain `torch.amp.GradScaler` per rank, which checks only that rank's partition and is stepped
and updated once per parameter group; DeepSpeed's own (all-reduced) overflow check is off on
this path, its clip and reported norm run at a loss scale of 1 on scaled gradients, and a skip
is not reported to the engine. [`use_shardscale()`][use_shardscale] replaces that scaler:

* at `engine.step()`, before DeepSpeed reads the gradients, one
  [`ShardedGradScaler`][shardscale.ShardedGradScaler] checks and unscales every parameter
  group's gradient partition on this rank, in one all-reduce over its process group (the world
  by default: data x model parallel), so every rank steps or skips every group together;
* DeepSpeed then reads a loss scale of 1 on unscaled gradients: its clip uses the true global
  norm, and `get_global_grad_norm()` reports it;
* the decision reaches DeepSpeed as its own overflow (`optimizer.overflow`): the engine reports
  `was_step_applied()` False, counts `skipped_steps` and holds the LR scheduler;
* an overflow DeepSpeed's own check finds (an all-reduced norm that is not finite) is taken
  with [`record_overflow()`][shardscale.ShardedGradScaler.record_overflow]; the scale moves
  once per `engine.step()`;
* the scaler's state rides in DeepSpeed's checkpoints, where DeepSpeed keeps its own loss
  scaler, and comes back with `engine.load_checkpoint()`.

The invariant: every rank, and every parameter group, steps or skips on one agreed flag,
unscaled by one agreed scale.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch

from shardscale.scaler import ShardedGradScaler

__all__ = ["TESTED_VERSIONS", "use_shardscale"]

TESTED_VERSIONS = ("0.19.8",)
"""The DeepSpeed releases CI runs this module's tests on. 0.19.7 passed them once by hand
(docs/deepspeed.md#tested); its stage 3 never resets `overflow` on this path, which `_step` does."""


class _SavedScale:
    """What a DeepSpeed checkpoint holds where DeepSpeed keeps its loss scaler: the state."""

    def __init__(self, state: Mapping[str, Any]) -> None:
        self.state = dict(state)


class _Bridge:
    """DeepSpeed's `torch_autocast_gradscaler` and `loss_scaler` at once, over one scaler."""

    dynamic = True  # DeepSpeed reads it to know a scaler is in use

    def __init__(self, scaler: ShardedGradScaler) -> None:
        self.scaler = scaler
        self.unscaled = False  # inside engine.step(), after the scaler unscaled
        self.skip = False  # the agreed decision of this step
        self.seen_by_deepspeed = False  # DeepSpeed's own check found an overflow

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the agreed scale (`engine.backward()` and `engine.scale()`)."""
        return self.scaler.scale(loss)

    def step(self, optimizer: torch.optim.Optimizer) -> Any:
        """One parameter group's step: only on a step every rank agreed to take."""
        return optimizer.step()

    def update(self) -> None:
        """Called once per parameter group: the scale moves once per engine.step() instead."""

    @property
    def cur_scale(self) -> float:
        """What DeepSpeed divides by: 1 once the scaler unscaled, else the agreed scale."""
        return 1.0 if self.unscaled else self.scaler.get_scale()

    @cur_scale.setter
    def cur_scale(self, value: float) -> None:
        raise ValueError(
            "the loss scale is shardscale's under use_shardscale(): set it with "
            f"scaler.update(new_scale), got an assignment of {value}"
        )

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def update_scale(self, overflow: bool) -> None:
        """DeepSpeed's decision point: its overflow flag becomes the agreed one."""
        self.seen_by_deepspeed = bool(overflow) and not self.skip
        self.optimizer.overflow = self.skip or self.seen_by_deepspeed

    optimizer: Any = None

    def __reduce__(self) -> tuple[type[_SavedScale], tuple[dict[str, Any]]]:
        return _SavedScale, (self.scaler.state_dict(),)


class _Partition(torch.optim.Optimizer):
    """This rank's gradient partition, as an optimizer the scaler can check and unscale in
    place: each gradient hangs on a zero-cost expanded holder. Its `step()` only records that
    the agreed decision was to step."""

    def __init__(self, grads: list[torch.Tensor]) -> None:
        holders = []
        for grad in grads:
            holder = grad.new_zeros(()).expand(grad.shape)
            holder.grad = grad
            holders.append(holder)
        super().__init__(holders or [torch.zeros(0)], {})
        self.stepped = False

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.stepped = True


def use_shardscale(engine: Any, **scaler_kwargs: Any) -> ShardedGradScaler:
    """Give a DeepSpeed engine's ZeRO optimizer one shardscale scaler, agreed on every rank.

    Call it on every rank after `deepspeed.initialize()`, before the first `engine.backward()`.

    Example:
        ```python
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        scaler = use_shardscale(engine)  # config: "torch_autocast" fp16, ZeRO 1, 2 or 3
        with torch.autocast("cuda", dtype=torch.float16):
            loss = engine(batch)
        engine.backward(loss)
        engine.step()  # skipped on every rank together; engine.was_step_applied() says so
        ```

    Args:
        engine: what `deepspeed.initialize()` returned first.
        **scaler_kwargs: [`ShardedGradScaler`][shardscale.ShardedGradScaler] options
            (`init_scale`, `growth_interval`, `process_group`, ...).

    Returns:
        The scaler, for its `stats`, `last_step_skipped`, `get_scale()` and the like.

    Raises:
        ValueError: the engine is not on the torch-autocast fp16 path with a ZeRO 1-3 optimizer,
            offloads its optimizer to the CPU, runs ZenFlow, or is converted already.
    """
    optimizer = engine.optimizer
    _refuse(engine, optimizer)
    scaler = ShardedGradScaler(**scaler_kwargs)
    bridge = _Bridge(scaler)
    bridge.optimizer = optimizer
    optimizer.torch_autocast_gradscaler = bridge
    optimizer.loss_scaler = bridge
    optimizer.step = functools.partial(_step, optimizer.step, bridge)
    optimizer.load_state_dict = functools.partial(_load, optimizer.load_state_dict, bridge)
    return scaler


def _refuse(engine: Any, optimizer: Any) -> None:
    """Raise where one agreed decision cannot hold, naming the rule and the value."""
    if not (engine.torch_autocast_enabled() and engine.torch_autocast_dtype() == torch.float16):
        dtype = engine.torch_autocast_dtype() if engine.torch_autocast_enabled() else None
        raise ValueError(
            "use_shardscale() needs DeepSpeed's torch-autocast fp16 path "
            '("torch_autocast": {"enabled": true, "dtype": "torch.float16"}), got '
            f"torch_autocast enabled={engine.torch_autocast_enabled()}, dtype={dtype}"
        )
    stage = engine.zero_optimization_stage()
    if stage not in (1, 2, 3) or not hasattr(optimizer, "averaged_gradients"):
        raise ValueError(
            "use_shardscale() needs a ZeRO stage 1, 2 or 3 optimizer, got stage "
            f"{stage} ({type(optimizer).__name__})"
        )
    if getattr(optimizer, "cpu_offload", False) or getattr(optimizer, "offload_optimizer", False):
        raise ValueError(
            "use_shardscale() does not support optimizer offload: the offloaded gradients are "
            "checked on the CPU by DeepSpeed's own tracker, got offload_optimizer enabled"
        )
    if getattr(optimizer, "zenflow", False):
        raise ValueError("use_shardscale() does not support ZenFlow, got zenflow enabled")
    if isinstance(optimizer.torch_autocast_gradscaler, _Bridge):
        raise ValueError("use_shardscale() was called on this engine already")
    if optimizer.torch_autocast_gradscaler is None:
        raise ValueError(
            f"use_shardscale() needs the optimizer's torch-autocast GradScaler, got None from "
            f"{type(optimizer).__name__}"
        )


def _partition_grads(optimizer: Any) -> list[torch.Tensor]:
    """The gradients of this rank's partition that DeepSpeed's step reads, every group's."""
    averaged = optimizer.averaged_gradients
    groups = averaged.values() if isinstance(averaged, dict) else averaged
    return [grad for group in groups if group for grad in group if grad is not None]


def _step(original: Any, bridge: _Bridge, closure: Any = None) -> Any:
    """The ZeRO optimizer's step, behind one agreed check and unscale of every group."""
    scaler, optimizer = bridge.scaler, bridge.optimizer
    partition = _Partition(_partition_grads(optimizer))
    scaler.step(partition)  # check + unscale in place, ONE all-reduce; steps `partition` if clean
    bridge.skip, bridge.seen_by_deepspeed = not partition.stepped, False
    optimizer.overflow = False  # 0.19.7's stage 3 never resets it on this path
    bridge.unscaled = True
    try:
        result = original() if closure is None else original(closure)
    finally:
        bridge.unscaled = False
    if bridge.seen_by_deepspeed:  # every rank alike: DeepSpeed's norm is all-reduced
        scaler.record_overflow()
    scaler.update()
    return result


def _load(original: Any, bridge: _Bridge, *args: Any, **kwargs: Any) -> Any:
    """DeepSpeed's optimizer load, then the scaler's state from where DeepSpeed put it back."""
    result = original(*args, **kwargs)
    saved = bridge.optimizer.loss_scaler
    if isinstance(saved, _SavedScale):
        bridge.scaler.load_state_dict(saved.state)
    bridge.optimizer.loss_scaler = bridge
    return result
