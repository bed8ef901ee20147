"""torchtitan: fp16 training with shardscale, by changing what a torchtitan launch runs.

torchtitan (0.3.0) trains in bf16 or fp32; its FSDP2 policy takes float16 as it is, but nothing
scales the loss. [`fp16()`][fp16] converts a trainer config so that its `Trainer`:

* scales the loss where torchtitan builds it (the pipeline schedule's last stage included; the
  other stages never call `scale()` and the scaler still agrees with them). torchtitan's default
  `ChunkedLossWrapper` runs the lm_head backward inside its call and its own backward ignores
  `grad_output`, so `scale(loss).backward()` would leave every gradient S times too small: its
  per-chunk loss is scaled instead, and losses this module cannot vouch for are refused;
* clips with `scaler.clip_grad_norm_`, in the scaler's one collective. torchtitan has no hook:
  `Trainer.train_step` calls the module-level `torchtitan.distributed.utils.clip_grad_norm_`,
  so that one name is replaced for the duration of each `train_step`. On a step the scaler
  skips, the norm handed back is [`SKIPPED_GRAD_NORM`][SKIPPED_GRAD_NORM] (-1.0), not the
  non-finite norm: torchtitan after 0.3.0 (its PR #4226) asserts on the device that the norm
  is finite before `optimizers.step()`, and would stop the job at the first fp16 overflow;
* steps torchtitan's `OptimizersContainer` with `scaler.step()`, then `update()`, every rank
  together, and holds the LR schedule on skipped steps (as DeepSpeed and Megatron-LM do);
* checkpoints the scaler (`shardscale_scaler` in the DCP checkpoint) and loads a checkpoint saved
  before fp16 with a fresh scaler and a warning;
* reports the scale, skipped steps and forward overflows with torchtitan's metrics.

`python -m shardscale.integrations.torchtitan --module M --config C [flags]` is torchtitan's
`train` entry with the config converted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.metadata
import warnings
from collections.abc import Iterator
from typing import Any, cast

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import BaseLoss, ChunkedLossWrapper, CrossEntropyLoss, MSELoss
from torchtitan.components.metrics import BaseLogger
from torchtitan.distributed import utils as dist_utils
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from shardscale import ShardedGradScaler, ShardScaleWarning

__all__ = ["SCALER_KEY", "SKIPPED_GRAD_NORM", "TESTED_VERSION", "fp16", "main"]

SCALER_KEY = "shardscale_scaler"
"""The scaler's state in torchtitan's checkpoints."""

TESTED_VERSION = "0.3.0"
"""The torchtitan release this module was written against and is tested with (and its
finite-step guard of later versions, PR #4226, applied to that release's trainer)."""

SKIPPED_GRAD_NORM = -1.0
"""The grad norm torchtitan gets, and logs, on a step the scaler skips: no norm is negative, so
it never reads as a measurement (the gradients held inf/NaN on some rank; the same record's
`shardscale/last_step_skipped` is 1). A finite stand-in, because torchtitan after 0.3.0 stops
the job on a non-finite norm before it calls `optimizers.step()`, where the scaler skips."""

_SCALABLE = (CrossEntropyLoss.Config, MSELoss.Config)  # their backward honours grad_output
_SET_BY_TRAINER = ("device", "enabled", "process_group")
_CLIP = "clip_grad_norm_"


def fp16(config: Any, **scaler_kwargs: Any) -> Any:
    """Return a copy of a torchtitan trainer config whose `build()` trains in fp16.

    FSDP2 computes in float16 (`MixedPrecisionPolicy(param_dtype=float16,
    reduce_dtype=float32)`; parameters, gradients and optimizer states stay float32) and a
    [`ShardedGradScaler`][shardscale.ShardedGradScaler] scales the loss, clips, steps and
    checkpoints (the module docstring says where). CUDA graphs are turned off: the scale is
    chosen each step on the host, which a replayed graph would not see.

    Example:
        ```python
        from torchtitan.models.llama3.config_registry import llama3_8b
        from shardscale.integrations.torchtitan import fp16

        trainer = fp16(llama3_8b(), growth_interval=1000).build()
        trainer.train()
        ```

    Args:
        config: a `Trainer.Config` (or a subclass's, for a `Trainer` subclass that keeps
            `train_step`'s clip, optimizer and LR-scheduler calls); what fp16 changes is copied.
        **scaler_kwargs: [`ShardedGradScaler`][shardscale.ShardedGradScaler] options
            (`init_scale`, `growth_interval`, `hysteresis`, `min_scale`, ...), checked now.

    Returns:
        The converted config.

    Raises:
        RuntimeError: this torch lacks `torch.distributed.set_timeout`, which torchtitan 0.3.0
            calls after the first step (torch 2.14 added it).
        TypeError: `config` is not a torchtitan trainer config, or an option is unknown.
        ValueError: the loss cannot be scaled correctly, `training.dtype` is not float32, the
            config is converted already, an option breaks its rule, or it is one the trainer
            sets (`device`, `enabled`, `process_group`).
    """
    if not hasattr(torch.distributed, "set_timeout"):
        raise RuntimeError(
            f"torchtitan {_version()} calls torch.distributed.set_timeout after the first step, "
            f"which torch {torch.__version__} lacks (torch 2.14 added it): train torchtitan in "
            "fp16 on torch 2.14 or newer"
        )
    owner: Any = getattr(type(config), "_owner", None)
    if not (isinstance(owner, type) and issubclass(owner, Trainer)):
        raise TypeError(
            "fp16() takes a torchtitan trainer config (Trainer.Config, as a config_registry "
            f"function returns), got {type(config).__qualname__}"
        )
    if issubclass(owner, _FP16Training):
        raise ValueError("this config trains in fp16 already: fp16() was applied to it")
    refused = sorted(set(scaler_kwargs) & set(_SET_BY_TRAINER))
    if refused:
        raise ValueError(
            f"the trainer sets the scaler's {', '.join(refused)} itself (every rank of the job "
            "agrees; the device follows the loss), got them as options"
        )
    ShardedGradScaler(**scaler_kwargs)  # the options' errors now, not inside build()
    if config.training.dtype != "float32":
        raise ValueError(
            "fp16 keeps float32 parameters and computes in float16: training.dtype must be "
            f"'float32', got {config.training.dtype!r}"
        )
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    fields.update(
        training=dataclasses.replace(
            config.training, mixed_precision_param="float16", disable_cuda_graphs=True
        ),
        loss=_scaled_loss(config.loss),
        checkpoint=_checkpoint(config.checkpoint),
        shardscale=dict(scaler_kwargs),
    )
    return _fp16_trainer(cast(Any, owner)).Config(**fields)


def _scaled_loss(loss: Any) -> Any:
    """The loss config, its gradient scaled where it can be: the loss itself, or the per-chunk
    loss inside `ChunkedLossWrapper` (whose own backward drops the scale)."""
    if type(loss) in _SCALABLE:
        return _ScaledLoss.Config(loss=loss)
    if type(loss) is ChunkedLossWrapper.Config and type(loss.loss_fn) in _SCALABLE:
        return dataclasses.replace(loss, loss_fn=_ScaledLoss.Config(loss=loss.loss_fn))
    inner = getattr(loss, "loss_fn", None)
    name = type(loss).__qualname__ + (f"({type(inner).__qualname__})" if inner else "")
    raise ValueError(
        "fp16() scales torchtitan's CrossEntropyLoss and MSELoss, alone or inside "
        f"ChunkedLossWrapper; got the loss {name}. A loss that runs backward inside its call, "
        "or whose backward ignores grad_output (as ChunkedLossWrapper's does), would train "
        "with gradients S times too small, silently: it is refused"
    )


def _checkpoint(checkpoint: Any) -> Any:
    """torchtitan's DCP checkpoint manager becomes one that loads pre-fp16 checkpoints."""
    if type(checkpoint) is not CheckpointManager.Config:
        return checkpoint
    values = {f.name: getattr(checkpoint, f.name) for f in dataclasses.fields(checkpoint)}
    return _CheckpointManager.Config(**values)


class _ScaledLoss(BaseLoss):  # type: ignore[misc]
    """A loss whose value is the loss and whose gradient is scaled by the scaler's scale."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(BaseLoss.Config):  # type: ignore[misc]
        loss: Any
        """The loss to scale (a `BaseLoss.Config`)."""

    def __init__(self, config: Config, *, compile_config: Any = None) -> None:
        self.loss = config.loss.build(compile_config=compile_config)
        self.scaler: ShardedGradScaler | None = None

    def __call__(
        self,
        pred: torch.Tensor,
        labels: torch.Tensor,
        global_valid_tokens: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss, metrics = self.loss(pred, labels, global_valid_tokens, **kwargs)
        if not (torch.is_grad_enabled() and loss.requires_grad):
            return loss, metrics  # validation: nothing to scale
        if self.scaler is None:
            raise RuntimeError("a scaled loss is called before its trainer gave it the scaler")
        scaled = self.scaler.scale(loss)
        # The value torchtitan logs and sums stays the loss; backward carries the scale.
        return loss.detach() + (scaled - scaled.detach()), metrics


class _CheckpointManager(CheckpointManager):  # type: ignore[misc]
    """torchtitan's DCP checkpoint manager; a checkpoint without the scaler (saved before
    fp16) loads, and the scaler starts fresh."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):  # type: ignore[misc]
        pass

    def dcp_load(
        self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool
    ) -> None:
        if SCALER_KEY in state_dict and not from_hf:
            saved = FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata
            if not any(key.split(".")[0] == SCALER_KEY for key in saved):
                scaler = state_dict.pop(SCALER_KEY)
                warnings.warn(
                    f"the checkpoint {checkpoint_id} holds no {SCALER_KEY} (saved before fp16?): "
                    f"the loss scaler starts fresh at scale {scaler.get_scale():g}",
                    ShardScaleWarning,
                    stacklevel=2,
                )
        super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)


class _ScalerMetrics(BaseLogger):  # type: ignore[misc]
    """torchtitan's metric logger, with the scaler's numbers added to each record."""

    def __init__(self, inner: Any, scaler: ShardedGradScaler) -> None:
        self.inner, self.scaler = inner, scaler

    def log(self, metrics: dict[str, Any], step: int) -> None:
        stats = self.scaler.stats
        self.inner.log(
            {
                **metrics,
                "shardscale/scale": stats.scale,
                "shardscale/skipped_steps": stats.skipped_steps,
                "shardscale/last_step_skipped": int(stats.last_step_skipped),
                "shardscale/forward_overflows": stats.forward_overflows,
            },
            step,
        )

    def close(self) -> None:
        self.inner.close()


class _Stepping:
    """A component of the trainer whose `step()` is replaced during one `train_step`."""

    def __init__(self, target: Any, step: Any) -> None:
        self._target, self.step = target, step

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)


class _FP16Training:
    """What fp16 changes in a torchtitan `Trainer` (mixed in before the config's trainer)."""

    config: Any
    step: int
    optimizers: Any
    lr_schedulers: Any
    loss_fn: Any
    checkpointer: Any
    metrics_processor: Any
    parallel_dims: Any

    def __init__(self, config: Any) -> None:
        if not callable(getattr(dist_utils, _CLIP, None)):
            raise RuntimeError(
                f"torchtitan {_version()} has no torchtitan.distributed.utils.{_CLIP}, which "
                f"fp16 replaces to clip with the scaler (written for torchtitan {TESTED_VERSION})"
            )
        super().__init__(config)  # type: ignore[call-arg]
        self.scaler = ShardedGradScaler(**config.shardscale)
        chunked = isinstance(self.loss_fn, ChunkedLossWrapper)
        scaled = self.loss_fn.loss_fn if chunked else self.loss_fn
        if not isinstance(scaled, _ScaledLoss):
            raise RuntimeError(f"fp16 built no scaled loss, got {type(scaled).__qualname__}")
        scaled.scaler = self.scaler
        if self.checkpointer.enable:
            self.checkpointer.states[SCALER_KEY] = self.scaler
        self.metrics_processor.logger = _ScalerMetrics(self.metrics_processor.logger, self.scaler)
        # Plain (non-DTensor) gradients are replicated over a pipeline stage's ranks.
        self._replicas = self.parallel_dims.world_size // self.parallel_dims.pp

    def train_step(self, data_iterator: Iterator[Any]) -> None:
        """torchtitan's step, with the scaler's clip, step and update; the LR schedule holds
        when the step is skipped."""
        optimizers, schedulers, scaler = self.optimizers, self.lr_schedulers, self.scaler
        stepped: list[bool] = []

        def step_optimizers(closure: Any = None) -> None:
            if closure is not None:
                raise RuntimeError("the scaler steps torchtitan's optimizers without a closure")
            scaler.step(optimizers)
            scaler.update()
            stepped.append(True)

        def step_schedulers() -> None:
            if not scaler.last_step_skipped:
                schedulers.step()

        self.optimizers = _Stepping(optimizers, step_optimizers)
        self.lr_schedulers = _Stepping(schedulers, step_schedulers)
        try:
            with _clipping_by(scaler, self._replicas):
                super().train_step(data_iterator)  # type: ignore[misc]
        finally:
            self.optimizers, self.lr_schedulers = optimizers, schedulers
        if not stepped:
            raise RuntimeError(
                f"{type(self).__qualname__}.train_step did not call self.optimizers.step(): "
                "fp16 steps through the scaler there, so this trainer cannot train in fp16"
            )
        if self.metrics_processor.should_log(self.step):
            stats = scaler.stats
            taken = (
                "skipped (inf/NaN gradients on some rank)" if stats.last_step_skipped else "taken"
            )
            logger.info(
                f"shardscale: step {self.step} {taken}, "
                f"scale {stats.scale:g}, skipped steps {stats.skipped_steps}, "
                f"forward overflows {stats.forward_overflows}"
            )


@contextlib.contextmanager
def _clipping_by(scaler: ShardedGradScaler, replicas: int) -> Iterator[None]:
    """torchtitan's clip function is the scaler's while the block runs."""
    original = getattr(dist_utils, _CLIP)

    def clip_grad_norm_(
        parameters: Any, max_norm: float, norm_type: float = 2.0, **torchtitan_options: Any
    ) -> torch.Tensor:
        # pp_mesh and ep_enabled are not needed: the scaler sums stages and expert shards
        norm = scaler.clip_grad_norm_(parameters, max_norm, norm_type, replica_group=replicas)
        return _reported(norm)

    setattr(dist_utils, _CLIP, clip_grad_norm_)
    try:
        yield
    finally:
        setattr(dist_utils, _CLIP, original)


def _reported(norm: torch.Tensor) -> torch.Tensor:
    """The norm torchtitan gets: the agreed norm, or `SKIPPED_GRAD_NORM` where it is not finite
    (on every rank alike: the scaler skips that step everywhere). On the device, no host read."""
    return torch.where(torch.isfinite(norm), norm, SKIPPED_GRAD_NORM)


@functools.cache
def _fp16_trainer(trainer: type) -> Any:
    """`trainer` with fp16 mixed in, and its config with the scaler's options."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(trainer.Config):  # type: ignore[name-defined,misc]
        shardscale: dict[str, Any] = dataclasses.field(default_factory=dict)
        """`ShardedGradScaler` options."""

    name = f"FP16{trainer.__name__}"
    Config.__qualname__ = f"{name}.Config"
    return type(name, (_FP16Training, trainer), {"Config": Config})


def _version() -> str:
    try:
        return importlib.metadata.version("torchtitan")
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


def main(argv: list[str] | None = None) -> None:
    """torchtitan's `train` entry (`torchtitan.train.main`) with the config converted by
    [`fp16()`][fp16]: `--module`, `--config` and torchtitan's flags, as torchtitan takes them."""
    import torch.distributed as dist
    from torchtitan.config import ConfigManager
    from torchtitan.observability import structured_logger
    from torchtitan.tools.logging import init_logger

    init_logger()
    logger.info(f"torchtitan {_version()}, in fp16 with shardscale")
    config = fp16(ConfigManager().parse_args(argv))
    structured_logger.init_structured_logger(
        source="training",
        output_dir=config.dump_folder,
        enable=config.debug.enable_structured_logging,
    )
    if config.comm.mode == "local_tensor":  # as torchtitan's entry: nothing is trained
        return
    trainer = None
    try:
        trainer = config.build()
        if config.checkpoint.create_seed_checkpoint:  # as torchtitan's entry: save, no training
            trainer.checkpointer.save(curr_step=0, last_step=True)
        else:
            trainer.train()
    finally:
        if trainer is not None:
            trainer.close()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
