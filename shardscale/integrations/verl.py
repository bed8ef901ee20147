"""verl: shardscale as the loss scaler of verl's FSDP engine, saved with its checkpoints.

verl (0.9) builds torch's `ShardedGradScaler(growth_interval=400)` in
`FSDPEngine._build_fsdp_module` when the engine's `mixed_precision.param_dtype` is fp16, and
uses it in `forward_backward_batch` (`scale(loss).backward()`) and `optimizer_step`
(`unscale_`, verl's own clipping, `step`, `update`). Under FSDP2 with a fused AdamW that
sequence crashes inside torch's scaler after the fused kernel has already written NaN into a
parameter (its summed `found_inf` is 2.0; fused kernels skip only on 1.0); otherwise it costs
two collectives. Its device defaults to `"cuda"`, so on a CPU it disables itself and takes
overflow steps. verl saves no scaler state in its checkpoints and offers no hook for one.

Two ways in, both keeping verl's sequence and its clipping:

* [`install()`][install]: from then on every `FSDPEngine` this process builds uses shardscale's
  scaler
  (with verl's growth interval) and saves its state with the engine's checkpoints. verl imports
  the modules named in `VERL_USE_EXTERNAL_MODULES` in every process, Ray workers included, so
  `VERL_USE_EXTERNAL_MODULES=shardscale.integrations.verl_plugin` installs it everywhere.
* [`use_shardscale()`][use_shardscale]: for one engine, after `engine.initialize()`.

The scaler's state is identical on every rank: rank 0 writes it as `shardscale_scaler.pt` in
the checkpoint folder after verl's own files, and every rank reads it back.

verl's Megatron engine (`MegatronEngine`) in fp16 builds Megatron's fp16 optimizer with the
precision-aware optimizer on (`init_megatron_optim_config`), one `DynamicGradScaler` per
sub-optimizer, and raises `NotImplementedError` from `optimizer_step` on any skipped step.
`use_shardscale_megatron()` (one engine, after `initialize()`) and `install()` (every engine)
convert its optimizer with `shardscale.integrations.megatron.use_shardscale` and make a step
skipped on every rank together return as the FSDP path's does: the step is not taken and the
norm returned is `inf`. Its checkpoints carry the scaler in Megatron's own optimizer state.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import warnings
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist

from shardscale._errors import ShardScaleDistributedError, ShardScaleWarning
from shardscale.scaler import ShardedGradScaler

__all__ = ["SCALER_FILE", "install", "use_shardscale", "use_shardscale_megatron"]

SCALER_FILE = "shardscale_scaler.pt"
"""The scaler's state in a verl checkpoint folder."""

_VERL_GROWTH_INTERVAL = 400  # what verl gives its own scaler
_PATCHED = "_shardscale_patched"


def use_shardscale(
    engine: Any,
    scaler: ShardedGradScaler | None = None,
    *,
    fold_clip: bool = False,
    **scaler_kwargs: Any,
) -> ShardedGradScaler:
    """Give an initialised verl FSDP engine shardscale's scaler, and checkpoint it.

    Args:
        engine: a verl `FSDPEngine` (`FSDPEngineWithLMHead`...), after `initialize()`,
            configured for fp16 (`mixed_precision={"param_dtype": "fp16"}`).
        scaler: the scaler to use; None builds one from `scaler_kwargs` (default
            `growth_interval`: verl's 400).
        fold_clip: replace verl's `optimizer_step` by one that clips with
            `scaler.clip_grad_norm_` (the same `clip_grad`, a global norm over shards):
            its norm travels in the scaler's one collective, where verl's own FSDP2 clipping
            costs one more. False (the default) keeps verl's clipping.
        **scaler_kwargs: [`ShardedGradScaler`][] options.

    Returns:
        The engine's scaler now.

    Raises:
        ValueError: the engine has no scaler (verl builds one only for fp16), or both a scaler
            and keyword arguments were given.
        RuntimeError: the engine was not initialised yet.
    """
    if not hasattr(engine, "scaler") or not hasattr(engine, "optimizer"):
        raise RuntimeError(
            "use_shardscale needs an initialised verl FSDP engine: call engine.initialize() "
            f"first (got {type(engine).__name__} without scaler/optimizer)"
        )
    if engine.scaler is None:
        raise ValueError(
            "this verl engine has no loss scaler: verl builds one only for fp16, set "
            "engine_config.mixed_precision={'param_dtype': 'fp16'}"
        )
    if scaler is not None and scaler_kwargs:
        raise ValueError(
            "pass a scaler or the keyword arguments to build one, not both; got scaler and "
            f"{sorted(scaler_kwargs)}"
        )
    if scaler is None:
        scaler = ShardedGradScaler(**{"growth_interval": _VERL_GROWTH_INTERVAL, **scaler_kwargs})
    engine.scaler = scaler
    engine.save_checkpoint = _saving(engine.save_checkpoint, lambda: engine.scaler)
    engine.load_checkpoint = _loading(engine.load_checkpoint, lambda: engine.scaler)
    if fold_clip:
        engine.optimizer_step = functools.partial(_optimizer_step_folding_clip, engine)
    return scaler


def _optimizer_step_folding_clip(engine: Any) -> float:
    """verl's `optimizer_step` (clip, skip on overflow, step, return the norm), with the clip
    norm in the scaler's collective."""
    clip_grad = engine.optimizer_config.clip_grad
    if clip_grad is None:
        raise ValueError("verl's optimizer_step needs optimizer_config.clip_grad, got None")
    grad_norm = engine.scaler.clip_grad_norm_(engine.module.parameters(), clip_grad)
    engine.scaler.step(engine.optimizer)
    engine.scaler.update()
    if getattr(engine, "_qat_enabled", False):  # as verl does after its step
        from verl.utils.qat.core import invalidate_all_scales

        invalidate_all_scales(engine.module)
    return float(grad_norm.item())


def use_shardscale_megatron(engine: Any, **scaler_kwargs: Any) -> ShardedGradScaler:
    """Give an initialised verl Megatron engine's fp16 optimizer one agreed scaler.

    Converts `engine.optimizer` in place ([`shardscale.integrations.megatron.use_shardscale`][]:
    one scale for every sub-optimizer, one agreed flag, the precision-aware optimizer's
    `decoupled_grad`s included), points every model chunk's `grad_scale_func` at the converted
    `scale_loss`, and replaces `engine.optimizer_step` by verl's own, which returns `inf` where
    every rank skipped the step together instead of raising.

    Args:
        engine: a verl `MegatronEngine` (`MegatronEngineWithLMHead`...), after `initialize()`,
            in fp16 (its optimizer has Megatron's grad scalers).
        **scaler_kwargs: as [`shardscale.integrations.megatron.use_shardscale`][] takes them.

    Returns:
        The scaler.

    Raises:
        RuntimeError: the engine has no optimizer (not initialised, or forward only).
        ValueError, TypeError: the optimizer is not an fp16 Megatron one (the Megatron
            integration's refusals).
    """
    from shardscale.integrations import megatron

    if getattr(engine, "optimizer", None) is None:
        raise RuntimeError(
            "use_shardscale_megatron needs an initialised verl Megatron engine with an "
            f"optimizer: call engine.initialize() first (got {type(engine).__name__} without one)"
        )
    scaler = megatron.use_shardscale(engine.optimizer, **scaler_kwargs)
    _rewire_grad_scale_func(engine)
    engine.optimizer_step = functools.partial(
        _optimizer_step_through_skips, engine, type(engine).optimizer_step
    )
    return scaler


def _rewire_grad_scale_func(engine: Any) -> None:
    """Every chunk's `grad_scale_func` is the converted `scale_loss` (verl set it to the
    method before the conversion, which bypasses the scaler's check of the loss)."""
    from megatron.core.utils import get_model_config  # type: ignore[import-not-found]

    for chunk in getattr(engine, "module", None) or []:
        get_model_config(chunk).grad_scale_func = engine.optimizer.scale_loss


def _optimizer_step_through_skips(engine: Any, verl_step: Callable[[Any], Any]) -> Any:
    """verl's `optimizer_step`; where it raises because the step was skipped on every rank
    for inf/NaN gradients (verl raises on any step Megatron did not take), `inf`: the norm of
    gradients that overflowed, as the FSDP path reports a skipped step's."""
    from shardscale.integrations import megatron

    scaler = megatron.scaler_of(engine.optimizer)
    try:
        return verl_step(engine)
    except NotImplementedError:
        if not scaler.last_step_skipped:
            raise  # not ours: Megatron's grad_norm_skip_threshold, say
        return math.inf


def _install_megatron() -> None:
    """Patch verl's `MegatronEngine` (where megatron-core imports): an fp16 engine's optimizer
    is converted as it is built, and its skipped steps return. Where verl's Megatron engine
    module does not import (a megatron-core or bridge verl cannot use), nothing is patched:
    no Megatron engine can be built in this process either."""
    try:
        from verl.workers.engine.megatron.transformer_impl import MegatronEngine
    except ImportError:
        return

    if getattr(MegatronEngine, _PATCHED, False):
        return
    build, step = MegatronEngine._build_optimizer, MegatronEngine.optimizer_step

    @functools.wraps(build)
    def build_with_shardscale(self: Any) -> Any:
        from shardscale.integrations import megatron

        optimizer = build(self)
        if getattr(optimizer.config, "fp16", False):
            megatron.use_shardscale(optimizer)
            self.optimizer = optimizer
            _rewire_grad_scale_func(self)
        return optimizer

    @functools.wraps(step)
    def step_through_skips(self: Any) -> Any:
        if getattr(self.optimizer.config, "fp16", False):
            return _optimizer_step_through_skips(self, step)
        return step(self)

    MegatronEngine._build_optimizer = build_with_shardscale
    MegatronEngine.optimizer_step = step_through_skips
    setattr(MegatronEngine, _PATCHED, True)


def _megatron_importable() -> bool:
    """Whether megatron-core can be imported here (verl's Megatron engine needs it)."""
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:  # no `megatron` package at all
        return False


def install() -> None:
    """Make every verl `FSDPEngine` (and, where megatron-core is installed, every
    `MegatronEngine`) built from now on in this process use shardscale.

    Patches `FSDPEngine._build_fsdp_module` (an fp16 engine gets
    `ShardedGradScaler(growth_interval=400)` where verl would build torch's) and its
    `save_checkpoint`/`load_checkpoint` (the scaler's state goes with the checkpoint);
    `MegatronEngine._build_optimizer` (an fp16 optimizer is converted as it is built) and
    `optimizer_step` (a step skipped on every rank returns `inf` instead of raising).
    Idempotent.
    """
    if _megatron_importable():
        _install_megatron()
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    if getattr(FSDPEngine, _PATCHED, False):
        return
    build = FSDPEngine._build_fsdp_module

    @functools.wraps(build)
    def build_with_shardscale(self: Any, *args: Any, **kwargs: Any) -> Any:
        module = build(self, *args, **kwargs)
        if getattr(self, "scaler", None) is not None and not isinstance(
            self.scaler, ShardedGradScaler
        ):
            self.scaler = ShardedGradScaler(growth_interval=_VERL_GROWTH_INTERVAL)
        return module

    save, load = FSDPEngine.save_checkpoint, FSDPEngine.load_checkpoint

    @functools.wraps(save)
    def save_with_scaler(self: Any, local_path: str, *args: Any, **kwargs: Any) -> None:
        _saving(functools.partial(save, self), lambda: self.scaler)(local_path, *args, **kwargs)

    @functools.wraps(load)
    def load_with_scaler(self: Any, local_path: str, *args: Any, **kwargs: Any) -> None:
        _loading(functools.partial(load, self), lambda: self.scaler)(local_path, *args, **kwargs)

    FSDPEngine._build_fsdp_module = build_with_shardscale
    FSDPEngine.save_checkpoint = save_with_scaler
    FSDPEngine.load_checkpoint = load_with_scaler
    setattr(FSDPEngine, _PATCHED, True)


def _saving(
    save: Callable[..., None], scaler: Callable[[], ShardedGradScaler | None]
) -> Callable[..., None]:
    """`save`, then the scaler's state beside verl's files (rank 0; identical everywhere)."""

    @functools.wraps(save)
    def save_checkpoint(local_path: str | None, *args: Any, **kwargs: Any) -> None:
        save(local_path, *args, **kwargs)
        current = scaler()
        if local_path is None or not isinstance(current, ShardedGradScaler):
            return
        state = current.state_dict()  # on every rank: reading the state may synchronise
        if not dist.is_initialized() or dist.get_rank() == 0:
            os.makedirs(local_path, exist_ok=True)
            torch.save(state, os.path.join(local_path, SCALER_FILE))
        if dist.is_initialized():
            dist.barrier()  # no rank loads the folder before the file is there

    return save_checkpoint


def _loading(
    load: Callable[..., None], scaler: Callable[[], ShardedGradScaler | None]
) -> Callable[..., None]:
    """`load`, and the scaler's state from the same folder (read first: verl may delete
    local copies of remote checkpoints after loading them), agreed: rank 0 alone wrote it, and
    on node-local checkpoint folders (verl's FSDP shards are per rank) only its node has it,
    so every rank takes what the ranks that found the file read ([`_agreed_state`][])."""

    @functools.wraps(load)
    def load_checkpoint(local_path: str | None, *args: Any, **kwargs: Any) -> None:
        path = None if local_path is None else os.path.join(local_path, SCALER_FILE)
        state = torch.load(path, weights_only=True) if path and os.path.exists(path) else None
        current = scaler()
        if isinstance(current, ShardedGradScaler):  # alike on every rank: verl built it so
            state = _agreed_state(current, state)
        load(local_path, *args, **kwargs)
        if not isinstance(current, ShardedGradScaler) or local_path is None:
            return
        if state is None:
            warnings.warn(
                f"no {SCALER_FILE} in the checkpoint {local_path} (saved without shardscale?): "
                f"the loss scale stays {current.get_scale():g}",
                ShardScaleWarning,
                stacklevel=2,
            )
            return
        current.load_state_dict(state)
        current.verify_agreement()  # every rank loaded the same state, or we stop here

    return load_checkpoint


def _agreed_state(scaler: ShardedGradScaler, state: dict[str, Any] | None) -> dict[str, Any] | None:
    """The scaler's state every rank loads: what the ranks that found the file read (each
    rank's, None where it found none, gathered over the scaler's group, bounded by its
    `sync_timeout` like its own collectives), so that a rank on a node without the file takes
    it too, and no rank waits for one that warned and went on.

    Raises:
        ShardScaleDistributedError: ranks that found a file read different states; or a rank
            did not arrive within `sync_timeout`.
    """
    exchange = scaler._agreement.exchange  # the scaler's group and its bounded gather
    read = exchange.gather_objects(state, None, f"the {SCALER_FILE} each rank read")
    found = [
        (rank, cast(dict[str, Any], them)) for rank, them in enumerate(read) if them is not None
    ]
    differing = [rank for rank, them in found if them != found[0][1]]
    if differing:
        raise ShardScaleDistributedError(
            f"the {SCALER_FILE} files the ranks read from their checkpoint folders differ: rank "
            f"{found[0][0]} read {found[0][1]}, rank(s) {differing} another (a stale copy on "
            "some node?); load the same checkpoint on every rank"
        )
    return found[0][1] if found else None
