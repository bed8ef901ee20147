"""accelerate, and the transformers / TRL Trainer on it: shardscale as the accelerator's scaler.

accelerate (1.15) builds its own scaler for `mixed_precision="fp16"`: torch's
[`ShardedGradScaler`][] for FSDP1, a plain `torch.amp.GradScaler` for FSDP2 and DDP. Setting
`accelerator.scaler` to shardscale's before `prepare()` swaps it; three of accelerate's paths
then still need help, which [`use_shardscale()`][use_shardscale] gives:

1. **Skipped steps with fused optimizers** (accelerate issue 4242). accelerate takes a step as
   skipped when the scaler did not call the optimizer's `step()`; a fused optimizer is always
   called (it skips on the device), so its skips look like steps, and the LR schedulers of
   accelerate and of the Trainer (whose default optimizer is fused AdamW) advance. The prepared
   optimizers report the scaler's agreed decision instead, read from the device only when
   `step_was_skipped` is asked (one host sync per step where it is: accelerate's prepared
   LR scheduler and the Trainer ask every step; none where nothing asks).
2. **Resume under FSDP2** (accelerate issue 4289). `load_state` loads the scaler, then loading
   the optimizer state steps the optimizer once on zero gradients (torch's
   `_init_optim_state`) through the prepared optimizer, that is through the scaler: its
   growth tracker and step counter move. The loaded scaler state is put back afterwards.
3. **fp16 on a CPU.** accelerate leaves `native_amp` off there: no fp16 autocast, and
   `unscale_gradients` does nothing, so `clip_grad_norm_` clips still-scaled gradients. It
   is turned on.

For a transformers `Trainer` (TRL's `SFTTrainer`, `GRPOTrainer`...), which creates its
accelerator itself, mix in [`ShardScaleTrainerMixin`][].
"""

from __future__ import annotations

import functools
import types
from typing import Any

from shardscale.scaler import ShardedGradScaler

__all__ = ["ShardScaleTrainerMixin", "use_shardscale"]

_REFUSED = ("DEEPSPEED", "MEGATRON_LM")  # they scale losses with their own machinery


def use_shardscale(
    accelerator: Any, scaler: ShardedGradScaler | None = None, **scaler_kwargs: Any
) -> ShardedGradScaler:
    """Make `accelerator` scale fp16 losses with shardscale's scaler. Call before `prepare()`.

    Args:
        accelerator: an `accelerate.Accelerator` with `mixed_precision="fp16"`.
        scaler: the scaler to use; None builds one from `scaler_kwargs`.
        **scaler_kwargs: [`ShardedGradScaler`][] options.

    Returns:
        The accelerator's scaler now.

    Raises:
        ValueError: mixed precision is not fp16, the job runs DeepSpeed or Megatron-LM (their
            own scalers), or both a scaler and keyword arguments were given.
        RuntimeError: optimizers were prepared already (they keep the scaler they were given).
    """
    mixed_precision = str(accelerator.mixed_precision)
    if mixed_precision != "fp16":
        raise ValueError(
            "use_shardscale scales fp16 losses: the accelerator's mixed_precision must be "
            f"'fp16', got {mixed_precision!r}"
        )
    distributed_type = str(getattr(accelerator.distributed_type, "name", ""))
    if distributed_type in _REFUSED:
        raise ValueError(
            f"use_shardscale does not apply to {distributed_type} jobs, which scale losses "
            "themselves"
        )
    if accelerator._optimizers:
        raise RuntimeError(
            f"use_shardscale must come before accelerator.prepare(): its "
            f"{len(accelerator._optimizers)} prepared optimizer(s) keep the scaler they got"
        )
    if scaler is not None and scaler_kwargs:
        raise ValueError(
            "pass a scaler or the keyword arguments to build one, not both; got scaler and "
            f"{sorted(scaler_kwargs)}"
        )
    scaler = scaler if scaler is not None else ShardedGradScaler(**scaler_kwargs)
    accelerator.scaler = scaler
    accelerator.native_amp = True  # already so on accelerators; on a CPU it enables fp16
    accelerator.prepare_optimizer = _reporting_skips(accelerator.prepare_optimizer, scaler)
    accelerator.load_state = _restoring_scaler(accelerator.load_state, scaler)
    return scaler


def _reporting_skips(prepare_optimizer: Any, scaler: ShardedGradScaler) -> Any:
    """`prepare_optimizer`, whose optimizers report the scaler's decision as skipped or not."""

    @functools.wraps(prepare_optimizer)
    def prepare(*args: Any, **kwargs: Any) -> Any:
        prepared = prepare_optimizer(*args, **kwargs)
        step = prepared.step

        def step_and_report(self: Any, *step_args: Any, **step_kwargs: Any) -> Any:
            result = step(*step_args, **step_kwargs)
            if self.gradient_state.sync_gradients:  # a step happened (not accumulating)
                # The agreed decision, unread: a fused optimizer's is a device flag, read
                # (one host sync) only if step_was_skipped is asked.
                self._shardscale_scaler = scaler
                self._shardscale_skip = None  # read at most once, when asked
            return result

        # A bound method, as torch's LR schedulers expect to find (they wrap it in turn).
        prepared.step = types.MethodType(functools.wraps(step)(step_and_report), prepared)
        prepared.__class__ = _reading_skips_lazily(prepared.__class__)
        return prepared

    return prepare


@functools.cache
def _reading_skips_lazily(optimizer_class: type) -> type:
    """`optimizer_class` (accelerate's `AcceleratedOptimizer`) whose `step_was_skipped`
    reports the scaler's agreed decision, read from the device only when asked.

    accelerate's own answer is "the scaler did not call `step()`", wrong for fused
    optimizers, which are always called and skip on the device. Reading the decision in every
    `step()` would add a host synchronisation per step to every fused job; read here it costs
    one per step only where something asks (accelerate's prepared LR scheduler and the
    Trainer do, every step), and none in a loop that never asks.
    """

    def step_was_skipped(self: Any) -> bool:
        scaler = self.__dict__.get("_shardscale_scaler")
        if scaler is None:  # no synced step yet
            return bool(self._is_overflow)
        if self._shardscale_skip is None:  # a fused step's decision: one host read, kept
            self._shardscale_skip = bool(scaler.last_step_skipped)
        return bool(self._shardscale_skip)

    return type(
        optimizer_class.__name__,
        (optimizer_class,),
        {
            "step_was_skipped": property(step_was_skipped, doc="Whether the step was skipped."),
            "__module__": optimizer_class.__module__,
            "__qualname__": optimizer_class.__qualname__,
        },
    )


def _restoring_scaler(load_state: Any, scaler: ShardedGradScaler) -> Any:
    """`load_state`, after which the scaler holds the state it loaded, whatever stepped it."""

    @functools.wraps(load_state)
    def load(*args: Any, **kwargs: Any) -> Any:
        loaded: list[dict[str, Any]] = []
        original = scaler.load_state_dict

        def remember(state_dict: Any) -> None:
            original(state_dict)
            loaded.append(dict(state_dict))

        scaler.load_state_dict = remember  # type: ignore[method-assign]
        try:
            result = load_state(*args, **kwargs)
        finally:
            del scaler.load_state_dict
        if loaded:
            scaler.load_state_dict(loaded[-1])
        return result

    return load


class ShardScaleTrainerMixin:
    """Mix into a transformers `Trainer` (TRL's trainers too) to train fp16 with shardscale.

    ```python
    class SFTTrainer(ShardScaleTrainerMixin, trl.SFTTrainer):
        pass

    trainer = SFTTrainer(model=model, args=SFTConfig(fp16=True, ...), ...)
    ```

    With `fp16=True` the Trainer's accelerator gets shardscale's scaler (through
    [`use_shardscale()`][use_shardscale], so fused AdamW, the Trainer's default, reports skipped
    steps and the LR schedule holds on them); its checkpoints save and restore the scaler
    (`scaler.pt`). Override [`make_shardscale_scaler()`][make_shardscale_scaler] to set the scaler's
    options.
    """

    accelerator: Any

    def make_shardscale_scaler(self) -> ShardedGradScaler:
        """The scaler to train with (default options unless overridden)."""
        return ShardedGradScaler()

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()  # type: ignore[misc]
        if str(self.accelerator.mixed_precision) == "fp16":
            use_shardscale(self.accelerator, self.make_shardscale_scaler())
