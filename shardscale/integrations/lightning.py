"""Lightning: fp16 precision plugins whose scaler is shardscale's, for Fabric and the Trainer.

Lightning (2.6) refuses `precision="16-mixed"` with `ModelParallelStrategy` (FSDP2, tensor
parallel: "does not support ... precision='16-mixed'") and, on a CPU, silently turns it into
bf16. It accepts a precision *plugin* instance with any strategy but `FSDPStrategy` (FSDP1,
which demands its own `FSDPPrecision`, whose constructor rejects any scaler passed to it). So
these are Lightning's own `MixedPrecision` classes, subclassed, with a
[`ShardedGradScaler`][]: every rank skips or steps together, and clipping is global
over shards in the step's one collective.

    fabric = L.Fabric(strategy=ModelParallelStrategy(parallelize), plugins=FabricPrecision("cuda"))
    trainer = L.Trainer(strategy=ModelParallelStrategy(), plugins=TrainerPrecision("cuda"),
                        gradient_clip_val=1.0)

Do not also pass `precision=`: Lightning refuses both. Both classes support fused optimizers,
including with gradient clipping (Lightning's own refuses that combination).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from lightning.fabric.plugins.precision.amp import MixedPrecision as _FabricMixedPrecision
from lightning.pytorch.plugins.precision import MixedPrecision as _TrainerMixedPrecision
from lightning.pytorch.utilities import GradClipAlgorithmType

from shardscale.scaler import ShardedGradScaler

__all__ = ["FabricPrecision", "TrainerPrecision"]


def _scaler(scaler: ShardedGradScaler | None, scaler_kwargs: dict[str, Any]) -> ShardedGradScaler:
    if scaler is not None and scaler_kwargs:
        raise ValueError(
            "pass a scaler or the keyword arguments to build one, not both; got scaler and "
            f"{sorted(scaler_kwargs)}"
        )
    if scaler is not None and not isinstance(scaler, ShardedGradScaler):
        raise TypeError(
            f"scaler must be a shardscale.ShardedGradScaler, got {type(scaler).__name__}"
        )
    return scaler if scaler is not None else ShardedGradScaler(**scaler_kwargs)


class FabricPrecision(_FabricMixedPrecision):  # type: ignore[misc]
    """fp16 autocast with shardscale's scaler, for `lightning.Fabric`.

    Fabric calls the plugin for `fabric.backward` (`scaler.scale(loss).backward()`) and the wrapped
    `optimizer.step()` (`scaler.step` + `scaler.update`). Clip with
    [`clip_grad_norm_()`][clip_grad_norm_] (global over shards, in the step's one collective), or
    with `fabric.clip_gradients(..., error_if_nonfinite=False)` (torch's clipping after `unscale_`;
    with Fabric's default `True` an overflow step raises instead of being skipped). Save the scaler
    in Fabric checkpoints yourself: `state["scaler"] = scaler`.

    Args:
        device: the autocast device type (`"cuda"`, `"cpu"`...).
        scaler: the scaler to use; None builds one from `scaler_kwargs`.
        **scaler_kwargs: [`ShardedGradScaler`][] options.
    """

    def __init__(
        self, device: str = "cuda", scaler: ShardedGradScaler | None = None, **scaler_kwargs: Any
    ) -> None:
        super().__init__("16-mixed", device, scaler=_scaler(scaler, scaler_kwargs))
        self.scaler: ShardedGradScaler

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """`scaler.unscale_(optimizer)`, fused optimizers included (they then step unscaled)."""
        self.scaler.unscale_(optimizer)

    def clip_grad_norm_(
        self,
        parameters: Iterable[torch.Tensor],
        max_norm: float,
        norm_type: float = 2.0,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Unscale and clip to the global norm.

        As [`ShardedGradScaler.clip_grad_norm_()`][ShardedGradScaler.clip_grad_norm_].
        """
        return self.scaler.clip_grad_norm_(parameters, max_norm, norm_type, **kwargs)


class TrainerPrecision(_TrainerMixedPrecision):  # type: ignore[misc]
    """fp16 autocast with shardscale's scaler, for `lightning.Trainer`.

    The Trainer's order is kept: after the closure (forward, backward) the gradients are
    unscaled (locally), `on_before_optimizer_step` sees them unscaled, then
    `gradient_clip_val` clips them to the global norm over shards, and the step is skipped on
    every rank if any overflowed, all in one collective. The scaler's state is saved in Trainer
    checkpoints under this class's name.

    The Trainer steps learning-rate schedulers after skipped steps too; to hold them, override
    `lr_scheduler_step` in the `LightningModule`:

    ```python
    def lr_scheduler_step(self, scheduler, metric):
        if not self.trainer.precision_plugin.scaler.last_step_skipped:
            scheduler.step()
    ```

    Args:
        device: the autocast device type (`"cuda"`, `"cpu"`...).
        scaler: the scaler to use; None builds one from `scaler_kwargs`.
        **scaler_kwargs: [`ShardedGradScaler`][] options.
    """

    def __init__(
        self, device: str = "cuda", scaler: ShardedGradScaler | None = None, **scaler_kwargs: Any
    ) -> None:
        super().__init__("16-mixed", device, scaler=_scaler(scaler, scaler_kwargs))
        self.scaler: ShardedGradScaler

    def clip_gradients(
        self,
        optimizer: torch.optim.Optimizer,
        clip_val: float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Clip as the Trainer asks; fused optimizers too (Lightning's plugin refuses them)."""
        if clip_val <= 0:
            return
        if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            self.clip_grad_by_value(optimizer, clip_val)
        else:
            self.clip_grad_by_norm(optimizer, clip_val)

    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        """Clip to the global norm over every shard and replica, in the flag's collective."""
        self.scaler.clip_grad_norm_(list(self.main_params(optimizer)), clip_val)

    def clip_grad_by_value(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        """Unscale fused optimizers' gradients (the others are unscaled by now), then clamp."""
        if getattr(optimizer, "_step_supports_amp_scaling", False):  # fused: steps itself
            self.scaler.unscale_(optimizer)
        super().clip_grad_by_value(optimizer, clip_val)
