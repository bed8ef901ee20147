"""Megatron-core: one agreed loss scale for a Megatron fp16 optimizer, checked once a step.

Megatron-core (0.19) gives each sub-optimizer of a `ChainedOptimizer` (dense and expert
parameters get one each) a `DynamicGradScaler` of its own. `MixedPrecisionOptimizer.prepare_grads`
unscales by its own scale, all-reduces its own flag over its own grad-stats group and updates its
own scaler from that flag; the chain ORs the flags to skip, and `get_loss_scale()` is the first
one's. An overflow in one group moves one scaler: the scales drift apart, and the other groups'
gradients are unscaled by a scale their loss was never multiplied by. And a second
`prepare_grads()` in a step (slime and miles call it, then `step()`, which prepares again) divides
the gradients by the scale twice. [`use_shardscale()`][use_shardscale] converts the optimizer in
place (its class becomes a subclass of its own, as FSDP2's `fully_shard` does with a module):

* one [`ShardedGradScaler`][shardscale.ShardedGradScaler] for every sub-optimizer: its scale is
  `get_loss_scale()`, `scale_loss()` (Megatron's `grad_scale_func`) and every sub-optimizer's
  `grad_scaler.scale`, on every rank alike;
* `prepare_grads()` copies the gradients as Megatron does, then checks and unscales every
  sub-optimizer's in one all-reduce over the scaler's group (the world by default), in which the
  gradient norm that `step()` and `get_grad_norm()` read travels too, where one replica count
  describes every sub-optimizer's gradients; the scale moves once;
* a second `prepare_grads()` in the same iteration does nothing and returns the same flag; the
  iteration ends when `step()` returns, at `zero_grad()`, or when a loss is scaled again (a loop
  without `zero_grad()` trains);
* the replica count the norm needs is agreed once, at conversion, so that every rank takes the
  same branch (a pipeline stage without experts has no expert sub-optimizer);
* the precision-aware optimizer's `decoupled_grad`s and megatron-core's `MimoOptimizer` are
  taken; `agree_loss_scale_funcs()` gives MoE and MTP losses the agreed scale times a stack's
  own factor; `install()` converts every optimizer `get_megatron_optimizer` builds (Megatron-LM's
  `pretrain()`);
* each sub-optimizer's `grad_scaler` is a view of the one scaler, so Megatron's own checkpoint
  code (`state_dict()`, `sharded_state_dict()`, `load_state_dict()`) saves and restores the
  scaler, and a checkpoint saved by Megatron's own scalers resumes.

The invariant: every sub-optimizer on every rank steps or skips on one agreed flag, scaled and
unscaled by one agreed scale.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import warnings
from abc import ABC
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.optimizer import clip_grads  # type: ignore[import-not-found]
from megatron.core.optimizer.grad_scaler import (  # type: ignore[import-not-found]
    ConstantGradScaler,
    DynamicGradScaler,
)
from megatron.core.optimizer.optimizer import (  # type: ignore[import-not-found]
    ChainedOptimizer,
    MixedPrecisionOptimizer,
)

from shardscale._errors import ShardScaleWarning
from shardscale.scaler import ShardedGradScaler

__all__ = [
    "STATE_KEY",
    "TESTED_VERSION",
    "agree_loss_scale_funcs",
    "install",
    "scaler_of",
    "use_shardscale",
]

STATE_KEY = "shardscale"
"""The scaler's state dict, inside each sub-optimizer's `grad_scaler` entry of a checkpoint."""

TESTED_VERSION = "0.19.2"
"""The megatron-core release this module was written against and is tested with."""

# A norm no gradient reaches: clip_grad_norm_ then only measures (its coefficient is 1).
_NO_CLIP = float(torch.finfo(torch.float32).max)


def use_shardscale(optimizer: Any, **scaler_kwargs: Any) -> ShardedGradScaler:
    """Give a Megatron fp16 optimizer one shardscale scaler, agreed on every rank.

    Call it on every rank once the optimizer is built (`get_megatron_optimizer(...)`), before
    `config.grad_scale_func = optimizer.scale_loss` or after it (either way the scale is the
    scaler's). The scaler takes the optimizer's own scaler settings and state (Megatron's
    defaults: initial scale 2**32, floor 1.0, window 1000, hysteresis 2), unless
    `scaler_kwargs` name others; with `init_scale` given, Megatron's current scale and
    trackers are not taken.

    Example:
        ```python
        optimizer = get_megatron_optimizer(OptimizerConfig(fp16=True, ...), model)
        scaler = use_shardscale(optimizer, max_overflows_at_floor=8)
        config.grad_scale_func = optimizer.scale_loss  # as Megatron's training loop does
        update_successful, grad_norm, _ = optimizer.step()  # skipped on every rank together
        ```

    Args:
        optimizer: a `ChainedOptimizer` of `MixedPrecisionOptimizer`s (what
            `get_megatron_optimizer` returns), or one `MixedPrecisionOptimizer`, with fp16
            grad scalers (`OptimizerConfig(fp16=True)`).
        **scaler_kwargs: [`ShardedGradScaler`][shardscale.ShardedGradScaler] options
            (`min_scale`, `max_overflows_at_floor`, `scale_policy`, `underflow_every`,
            `process_group`, ...).

    Returns:
        The scaler, for its `stats`, `last_step_skipped` and the like.

    Raises:
        TypeError: `optimizer` or one of its sub-optimizers is not of a kind named above.
        ValueError: a sub-optimizer has no grad scaler (bf16) or keeps its gradients in
            `decoupled_grad` (the precision-aware optimizer), the chain is empty, or the
            optimizer is converted already.
    """
    leaves = _leaves(optimizer)
    settings, states = _megatron_scalers(leaves)
    if _fits(scaler_kwargs.get("scale_policy")):  # the interval rule's: the fit moves by neither
        settings.pop("growth_factor", None)
        settings.pop("growth_interval", None)
    scaler = ShardedGradScaler(**{**settings, **scaler_kwargs})
    agreement = _Agreement(optimizer, leaves, scaler)
    if "init_scale" not in scaler_kwargs:
        agreement.load_states(states)
    for leaf in leaves:
        leaf.grad_scaler = _AgreedScale(agreement)
    optimizer._shardscale = agreement
    optimizer.__class__ = _converted(type(optimizer))
    for config in _model_configs(optimizer):
        agree_loss_scale_funcs(config, optimizer)
    return scaler


def _model_configs(optimizer: Any) -> list[Any]:
    """The model configs the optimizer knows of (a `DistributedOptimizer`'s model chunks,
    which a `ChainedOptimizer` collects; megatron-core's float16 optimizer keeps none)."""
    from megatron.core.utils import get_model_config  # type: ignore[import-not-found]

    configs: dict[int, Any] = {}
    for chunk in getattr(optimizer, "model_chunks", None) or []:
        config = get_model_config(chunk)
        configs.setdefault(id(config), config)
    return list(configs.values())


def scaler_of(optimizer: Any) -> ShardedGradScaler:
    """The scaler of an optimizer converted to shardscale's agreement.

    See [`use_shardscale()`][shardscale.integrations.megatron.use_shardscale] and
    [`install()`][shardscale.integrations.megatron.install].

    Raises:
        ValueError: `optimizer` was not converted.
    """
    if not isinstance(optimizer, _AgreedOptimizer):
        raise ValueError(
            "scaler_of() takes an optimizer converted by use_shardscale() or install(), got "
            f"{type(optimizer).__qualname__}"
        )
    return optimizer._shardscale.scaler


def install(**scaler_kwargs: Any) -> None:
    """Convert every optimizer `get_megatron_optimizer` builds from now on, in this process.

    The way in for Megatron-LM's `pretrain()`: its `setup_model_and_optimizer` calls
    `get_megatron_optimizer` and loads the checkpoint into the optimizer right after, with no
    place for a line between. Call this before `pretrain(...)` (at the top of
    `pretrain_gpt.py`, say) on every rank: the optimizer is converted as it is built, before
    the checkpoint loads, so a converted checkpoint resumes whole. Patches
    `megatron.core.optimizer.get_megatron_optimizer` and every imported `megatron` module's
    binding of it (`megatron.training.training` imports it by name). Idempotent; a second call
    with other options raises.

    Args:
        **scaler_kwargs: as
            [`use_shardscale()`][shardscale.integrations.megatron.use_shardscale]
            takes them, for every optimizer built.

    Raises:
        ValueError: installed already with other options.
    """
    import megatron.core.optimizer as megatron_optimizer  # type: ignore[import-not-found]

    build = megatron_optimizer.get_megatron_optimizer
    installed = getattr(build, _INSTALLED, None)
    if installed is not None:
        if installed != scaler_kwargs:
            raise ValueError(
                f"install() was called already with {installed!r}: one set of options per "
                f"process, got {scaler_kwargs!r}"
            )
        return

    @functools.wraps(build)
    def get_megatron_optimizer(*args: Any, **kwargs: Any) -> Any:
        optimizer = build(*args, **kwargs)
        use_shardscale(optimizer, **scaler_kwargs)
        return optimizer

    setattr(get_megatron_optimizer, _INSTALLED, dict(scaler_kwargs))
    for module in list(sys.modules.values()):
        name = getattr(module, "__name__", "")
        if name.startswith("megatron") and getattr(module, "get_megatron_optimizer", None) is build:
            setattr(module, "get_megatron_optimizer", get_megatron_optimizer)  # noqa: B010


_INSTALLED = "_shardscale_install"


def agree_loss_scale_funcs(config: Any, optimizer: Any) -> None:
    """Give MoE auxiliary and MTP losses the agreed scale times the stack's own factor.

    Megatron's schedule scales them by `config.moe_grad_scale_func()` /
    `config.mtp_grad_scale_func()` where a stack sets them, else by `config.grad_scale_func(1)`,
    else by 1. A stack that sets them itself (NeMo-RL, each step, to its own factor) or sets no
    `grad_scale_func` (AReaL: the schedule feeds 1) leaves those gradients without the loss
    scale, and the one unscale makes them S times too small. After this call, `config`'s two
    attributes read as the agreed scale times what was assigned to them, whenever and however
    often the stack assigns them: its code stays as it is. Where nothing is assigned, they
    read as None while `config.grad_scale_func` is set (the schedule then scales by it, as it
    does unconverted) and as the agreed scale where it is not (AReaL).

    [`use_shardscale()`][shardscale.integrations.megatron.use_shardscale]
    does this itself for the configs of the model chunks the optimizer holds (the
    `DistributedOptimizer`'s); call it for the others (megatron-core's float16 optimizer keeps
    no model chunks). A config given another converted optimizer's scale
    before follows this one's from now on.

    Example:
        ```python
        optimizer = get_megatron_optimizer(OptimizerConfig(fp16=True, ...), model)
        use_shardscale(optimizer)
        agree_loss_scale_funcs(get_model_config(model[0]), optimizer)
        config.moe_grad_scale_func = lambda: torch.tensor(0.5)  # the stack's: now 0.5 * scale
        ```

    Args:
        config: the model's `TransformerConfig` (what `get_model_config(model)` returns, which
            the schedule reads).
        optimizer: an optimizer that
            [`use_shardscale()`][shardscale.integrations.megatron.use_shardscale]
            converted.

    Raises:
        ValueError: the optimizer is not converted.
    """
    scaler_of(optimizer)  # raises where it is not converted
    agreement = optimizer._shardscale
    if isinstance(config, _AgreedScaleFuncs):  # its class is its own: point it at this scale
        type(config)._agreement = agreement
        return
    cls = type(config)
    config.__class__ = type(f"ShardScale{cls.__name__}", (_AgreedScaleFuncs, cls), {})
    type(config)._agreement = agreement


def _is_mimo(optimizer: Any) -> bool:
    """Whether `optimizer` is megatron-core's `MimoOptimizer` (one optimizer per module of a
    model whose modules run on grids of their own), without importing its model package."""
    return any(
        cls.__name__ == "MimoOptimizer" and cls.__module__ == "megatron.core.models.mimo.optimizer"
        for cls in type(optimizer).__mro__
    )


def _fits(policy: Any) -> bool:
    """Whether a `scale_policy` argument is the fit (by name, or a policy object that fits)."""
    return policy == "fit" or getattr(policy, "fit", False) is True


def _leaves(optimizer: Any) -> list[Any]:
    """The optimizer's sub-optimizers (itself, unchained), checked.

    Raises:
        TypeError, ValueError: as `use_shardscale` says.
    """
    if isinstance(optimizer, _AgreedOptimizer):
        raise ValueError("this optimizer uses shardscale already: use_shardscale() was applied")
    if isinstance(optimizer, ChainedOptimizer):
        leaves = list(optimizer.chained_optimizers)
    elif isinstance(optimizer, MixedPrecisionOptimizer):
        leaves = [optimizer]
    elif _is_mimo(optimizer):  # each active module's optimizer, its sub-optimizers flattened
        leaves = [leaf for module in optimizer._active_optimizers for leaf in _leaves(module)]
    else:
        raise TypeError(
            "use_shardscale() takes a Megatron ChainedOptimizer, MixedPrecisionOptimizer or "
            f"MimoOptimizer, got {type(optimizer).__qualname__}"
        )
    if not leaves:
        raise ValueError("the ChainedOptimizer holds no sub-optimizer on this rank, got []")
    for index, leaf in enumerate(leaves):
        name = f"sub-optimizer {index} ({type(leaf).__qualname__})"
        if not isinstance(leaf, MixedPrecisionOptimizer):
            raise TypeError(f"use_shardscale() converts MixedPrecisionOptimizers, got {name}")
        if not leaf.grad_scaler:
            raise ValueError(
                f"use_shardscale() converts fp16 optimizers (OptimizerConfig(fp16=True): every "
                f"sub-optimizer has a grad scaler), got {name} without one (bf16?)"
            )
    return leaves


def _megatron_scalers(leaves: list[Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The scaler settings the sub-optimizers' own scalers hold, and their states.

    Raises:
        TypeError: a scaler is of a kind other than Megatron's two, or the kinds are mixed.
    """
    scalers = [leaf.grad_scaler for leaf in leaves]
    if all(type(s) is ConstantGradScaler for s in scalers):
        return {"dynamic": False, "init_scale": min(float(s.scale) for s in scalers)}, []
    if not all(type(s) is DynamicGradScaler for s in scalers):
        kinds = sorted({type(s).__qualname__ for s in scalers})
        raise TypeError(
            "use_shardscale() takes sub-optimizers whose grad scalers are all Megatron's "
            f"DynamicGradScaler or all its ConstantGradScaler, got {kinds}"
        )
    first = scalers[0]
    settings = {
        "min_scale": float(first.min_scale),
        "growth_factor": float(first.growth_factor),
        "backoff_factor": float(first.backoff_factor),
        # OptimizerConfig.loss_scale_window is a float (1000.0), which Megatron compares as is
        "growth_interval": _integral(first.growth_interval),
        "hysteresis": first.hysteresis,
        "init_scale": min(float(s.scale) for s in scalers),
    }
    return settings, [s.state_dict() for s in scalers]


def _integral(value: Any) -> Any:
    """`value` as an int where it is a whole float; as it is otherwise (the scaler judges it)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


class _Grads:
    """A sub-optimizer's main gradients, as the scaler walks them (each a tensor's `.grad`);
    stepping it does nothing (Megatron's `step_with_ready_grads` steps, after its clip).

    The precision-aware optimizer (`use_precision_aware_optimizer`, verl's fp16 setting) keeps
    each main gradient in `param.decoupled_grad`, a view of the DDP buffer in its own dtype,
    because torch wants a parameter's `.grad` in the parameter's dtype: there each gradient is
    handed to the scaler as the `.grad` of a detached alias of itself (no copy), so the scaler
    checks and unscales the buffer in place, as Megatron's own unscale does.
    """

    def __init__(self, leaf: Any) -> None:
        self.param_groups: list[dict[str, Any]] = leaf.param_groups
        self.by_grad: dict[int, torch.Tensor] = {}  # a decoupled gradient's holder, by its id
        if _decoupled(leaf):
            holders = []
            for group in leaf.param_groups:
                for param in group["params"]:
                    grad = getattr(param, "decoupled_grad", None)
                    if grad is not None:
                        holder = grad.detach()
                        holder.grad = grad
                        holders.append(holder)
                        self.by_grad[id(grad)] = holder
            self.param_groups = [{"params": holders}]

    def step(self) -> None:
        pass


def _decoupled(leaf: Any) -> bool:
    """Whether a sub-optimizer keeps its main gradients in `decoupled_grad` (Megatron's test)."""
    return bool(getattr(leaf.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False))


class _Chain:
    """The sub-optimizers of one agreement, for the scaler: one collective for all of them."""

    def __init__(self, chained_optimizers: list[_Grads]) -> None:
        self.chained_optimizers = chained_optimizers
        self.param_groups: list[dict[str, Any]] = []  # a rank with no sub-optimizer walks none

    def step(self) -> None:
        pass


class _Agreement:
    """One converted optimizer's scaler and the state of its iteration.

    Args:
        root: the converted optimizer.
        leaves: its sub-optimizers.
        scaler: the one scaler.
    """

    def __init__(self, root: Any, leaves: list[Any], scaler: ShardedGradScaler) -> None:
        self.scaler = scaler
        self.leaves = leaves
        self.device = _device(leaves)  # then the device of the last loss scaled
        # None: the norm is Megatron's (a bare optimizer's clip, or replicas that differ);
        # agreed here, once, so that every rank takes the same branch of prepare()
        local = _replicas(leaves, scaler) if isinstance(root, ChainedOptimizer) else None
        self.replicas = _agreed_replicas(local, scaler)
        self.found_inf: bool | None = None  # this iteration's agreed flag, once prepared
        self.norm: torch.Tensor | None = None
        self.stepped = False
        # the iteration is over (stepped, skipped, or a new loss scaled): the next
        # prepare_grads() starts the next one, zero_grad() or not
        self.closed = False
        self._loading: list[Mapping[str, Any]] | None = None

    def prepare(self) -> bool:
        """Copy, check and unscale every sub-optimizer's gradients, agree, and move the scale:
        once an iteration; a second call in the same iteration returns the same flag and
        touches nothing. The iteration ends at `zero_grad()`, when `step()` or
        `step_with_ready_grads()` returns, or when a loss is scaled again: a loop that never
        calls `zero_grad()` (Megatron's own optimizer trains in one) prepares each step anew.
        """
        if self.closed:
            self.next_iteration()
        if self.found_inf is not None:
            return self.found_inf  # prepared: the gradients are unscaled already
        live = [leaf for leaf in self.leaves if not leaf.is_stub_optimizer]
        with torch.no_grad():
            for leaf in live:
                leaf._copy_model_grads_to_main_grads()  # Megatron's own first half of prepare
            grads = [_Grads(leaf) for leaf in self.leaves]
            chain: Any = _Chain(grads)
            if self.replicas is not None:  # the norm rides the flags' one collective
                self.scaler.unscale_(chain)
                params = list(_norm_params(live, grads))
                self.norm = self.scaler.clip_grad_norm_(
                    params, _NO_CLIP, replica_group=self.replicas
                )
            self.scaler.step(chain)
            self.scaler.update()
        self.found_inf = bool(self.scaler.last_step_skipped)  # a step was just taken: a bool
        return self.found_inf

    def start_step(self) -> None:
        """Check that the iteration may step now (prepared, agreed clean, not stepped yet).

        Raises:
            RuntimeError: it may not, saying why.
        """
        if self.found_inf is None:
            raise RuntimeError(
                "step_with_ready_grads() before prepare_grads(): the gradients still carry the "
                "loss scale"
            )
        if self.found_inf:
            raise RuntimeError(
                "step_with_ready_grads() after prepare_grads() found inf/NaN gradients on some "
                "rank: this step is skipped on every rank"
            )
        if self.stepped:
            raise RuntimeError("step_with_ready_grads() was called already in this iteration")
        self.stepped = True

    def next_iteration(self) -> None:
        self.found_inf, self.norm, self.stepped, self.closed = None, None, False, False

    def close(self) -> None:
        """End the iteration where it was prepared: the next `prepare()` starts the next."""
        if self.found_inf is not None:
            self.closed = True

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` times the scale; a new loss after `prepare()` ends that iteration, and the
        scale's reads follow the loss's device from now on."""
        self.close()
        self.device = loss.device
        return self.scaler.scale(loss)

    def loss_scale(self) -> torch.Tensor:
        """The iteration's scale, shaped `[1]` as Megatron's, a copy (Megatron's MoE scaler
        keeps the tensor it is first given and copies later scales into it), on the device of
        the last loss scaled (before any: Megatron's, the current CUDA device where there is
        one)."""
        return self.scaler.loss_scale_tensor(self.device).reshape(1).clone()

    def megatron_state(self) -> dict[str, Any]:
        """The scaler's state as a sub-optimizer's `grad_scaler` entry: Megatron's three keys
        (so Megatron's own `DynamicGradScaler` loads it back), and the scaler's whole state."""
        state = self.scaler.state_dict()
        if not state:  # a disabled scaler has none, as torch's
            return {}
        return {
            "scale": torch.tensor([state["scale"]], dtype=torch.float32),
            "growth_tracker": state["_growth_tracker"],
            "hysteresis_tracker": state["_hysteresis_tracker"],
            STATE_KEY: state,
        }

    @contextlib.contextmanager
    def loading(self) -> Iterator[None]:
        """Collect the sub-optimizers' saved states while the block loads them, then load the
        scaler once from them all."""
        self._loading = []
        try:
            yield
            states = self._loading
        finally:
            self._loading = None
        self.load_states(states)

    def load(self, state: Mapping[str, Any]) -> None:
        """One sub-optimizer's saved `grad_scaler` entry: collected while `loading()`."""
        if self._loading is not None:
            self._loading.append(state)
        else:
            self.load_states([state])

    def load_states(self, states: Sequence[Mapping[str, Any]]) -> None:
        """Load the scaler from the sub-optimizers' saved entries: shardscale's state where
        they hold it (one state, saved by a converted optimizer), else Megatron's own scalers'.

        Raises:
            ValueError: the entries hold different shardscale states.
        """
        ours = [state[STATE_KEY] for state in states if STATE_KEY in state]
        if ours:
            if any(state != ours[0] for state in ours):
                raise ValueError(
                    "the sub-optimizers' saved shardscale states must be one state (a converted "
                    f"optimizer saves the same in each), got {len(set(map(repr, ours)))} "
                    "different ones"
                )
            self.scaler.load_state_dict(ours[0])
            return
        megatron = [state for state in states if "scale" in state]  # a ConstantGradScaler: {}
        if megatron and self.scaler.is_enabled():
            self.scaler.load_state_dict(_from_megatron(megatron, self.scaler.state_dict()))


def _from_megatron(states: Sequence[Mapping[str, Any]], current: dict[str, Any]) -> dict[str, Any]:
    """Our state dict with the scale and trackers of Megatron's `DynamicGradScaler` states:
    the smallest scale where their scales drifted apart (warned), trackers within our
    settings. Megatron's hysteresis tracker counts down past 1 (to 0 and below) where ours
    stays at 1: both mean that the next overflow backs off."""
    scales = [float(state["scale"]) for state in states]
    chosen = states[scales.index(min(scales))]
    if len(set(scales)) > 1:
        warnings.warn(
            f"Megatron's per-optimizer grad scalers had drifted apart (scales {scales}): "
            f"shardscale resumes all of them at the smallest, {min(scales):g}",
            ShardScaleWarning,
            stacklevel=4,
        )
    growth = min(max(int(chosen["growth_tracker"]), 0), current["growth_interval"] - 1)
    hysteresis = min(max(int(chosen["hysteresis_tracker"]), 1), current["hysteresis"])
    return {
        **current,
        "scale": min(scales),
        "_growth_tracker": growth,
        "_hysteresis_tracker": hysteresis,
    }


def _device(leaves: list[Any]) -> torch.device:
    """The scale's device for Megatron's reads before a loss is scaled: where Megatron's own
    scalers keep theirs (`device='cuda'`), else where the main parameters live. Not the main
    parameters first: an optimizer converted while offloaded to the CPU would hand the CUDA
    loss a CPU scale."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    for leaf in leaves:
        for group in leaf.param_groups:
            for param in group["params"]:
                return torch.device(param.device)
    return torch.device("cpu")


def _replicas(leaves: list[Any], scaler: ShardedGradScaler) -> int | None:
    """How many ranks of the scaler's group hold each gradient Megatron's norm counts, where
    that is one number for every sub-optimizer; else None.

    Megatron sums a sub-optimizer's filtered gradients (no tensor-parallel duplicates, no
    shared copies) over its grad-stats group: the global norm. The ranks outside that group
    hold the same gradients: its size divides the scaler's group's that many times. The
    distributed optimizer (the world as that group): 1. Dense and expert sub-optimizers of the
    non-distributed one under expert parallelism: data-parallel against expert-data-parallel
    replicas, two numbers (the scaler's clip takes one)."""
    if not dist.is_initialized():
        return 1
    world = dist.get_world_size(scaler.process_group)
    counts = set()
    for leaf in leaves:
        size = dist.get_world_size(leaf.get_grad_stats_parallel_group())
        counts.add(world // size if world % size == 0 else 0)
    return counts.pop() if len(counts) == 1 and 0 not in counts else None


def _agreed_replicas(local: int | None, scaler: ShardedGradScaler) -> int | None:
    """The replica count every rank of the scaler's group uses: `local` where every rank
    found the same, else None (the norm stays Megatron's on every rank). One all-reduce, at
    conversion: a pipeline stage without experts builds no expert sub-optimizer, so ranks'
    own chains can count differently, and each must take the same branch of `prepare()`."""
    if not dist.is_initialized():
        return local
    bounds = torch.tensor([local or 0, -(local or 0)], dtype=torch.float64)
    if dist.get_backend(scaler.process_group) == "nccl":
        bounds = bounds.cuda()
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=scaler.process_group)
    most, least = int(bounds[0]), -int(bounds[1])
    return most if most == least and most > 0 else None


def _norm_params(leaves: list[Any], grads: list[_Grads]) -> Iterator[torch.Tensor]:
    """The tensors whose `.grad` Megatron's norm counts (its own filter): the main parameters,
    or the holders of the precision-aware optimizer's decoupled gradients."""
    holders: dict[int, torch.Tensor] = {}
    for each in grads:
        holders.update(each.by_grad)
    for leaf in leaves:
        counted = leaf.get_grads_for_grad_norm()
        yield from (holders[id(grad)] for grad in counted if id(grad) in holders)
        ids = {id(grad) for grad in counted}
        for param in leaf.get_parameters():
            if param.grad is not None and id(param.grad) in ids:
                yield param


def _as_megatron_norm(norm: torch.Tensor) -> Any:
    """The norm as Megatron's `get_grad_norm_fp32` returns it here: a tensor where its
    multi-tensor scale kernel takes one (Transformer Engine), else a Python float."""
    if getattr(clip_grads, "multi_tensor_scale_tensor_impl", None) is not None:
        return norm.reshape(1)
    return float(norm)


class _AgreedScale:
    """A sub-optimizer's `grad_scaler`: a view of the one scaler. Reads give its scale; the
    moves Megatron's own `prepare_grads` would make through it raise, before any gradient is
    touched; its state dict is the scaler's, in a form Megatron's own scaler loads too."""

    def __init__(self, agreement: _Agreement) -> None:
        self._agreement = agreement

    @property
    def scale(self) -> torch.Tensor:
        return self._agreement.loss_scale()

    @property
    def inv_scale(self) -> torch.Tensor:
        raise RuntimeError(
            "a sub-optimizer of a shardscale optimizer was asked to unscale its own gradients "
            "(its own prepare_grads()): call the converted optimizer's prepare_grads() or step()"
        )

    def update(self, found_inf: bool) -> None:
        raise RuntimeError(
            "the shardscale scale moves once per step, in the converted optimizer's "
            f"prepare_grads(), not per sub-optimizer; got update(found_inf={found_inf})"
        )

    def state_dict(self) -> dict[str, Any]:
        return self._agreement.megatron_state()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self._agreement.load(state_dict)


class _TimesAgreed:
    """A stack's loss-scale function (or None: 1), times the agreed scale when called."""

    def __init__(self, agreement: _Agreement, factor: Any) -> None:
        self.agreement = agreement
        self.factor = factor

    def __call__(self) -> torch.Tensor:
        scale = self.agreement.loss_scale()
        factor = self.factor() if callable(self.factor) else self.factor
        if factor is None:
            return scale
        return scale * torch.as_tensor(factor, dtype=torch.float32).to(scale.device)


def _times_agreed(name: str) -> property:
    """A config attribute that stores what the stack assigns and reads it times the scale."""

    def get(self: Any) -> _TimesAgreed | None:
        assigned = self.__dict__.get(name)
        if assigned is None and getattr(self, "grad_scale_func", None) is not None:
            return None  # the schedule falls back to grad_scale_func(1): the stack's scaling
        return _TimesAgreed(type(self)._agreement, assigned)

    def set_(self: Any, value: Any) -> None:  # a read value assigned back is not wrapped twice
        self.__dict__[name] = value.factor if isinstance(value, _TimesAgreed) else value

    return property(get, set_, doc=f"`{name}` as assigned, times the agreed loss scale.")


class _AgreedScaleFuncs:
    """What `agree_loss_scale_funcs()` changes in a model config (mixed in before its class)."""

    _agreement: _Agreement
    moe_grad_scale_func = _times_agreed("moe_grad_scale_func")
    mtp_grad_scale_func = _times_agreed("mtp_grad_scale_func")


class _AgreedOptimizer(ABC):
    """What `use_shardscale()` changes in a Megatron optimizer (mixed in before its class).

    An `ABC` as Megatron's optimizers are (`MegatronOptimizer(ABC)`): a mixin of another
    lineage would change the instances' layout, and Python refuses the `__class__` swap."""

    _shardscale: _Agreement

    def get_loss_scale(self) -> torch.Tensor:
        """The agreed scale, shaped `[1]` (a copy)."""
        return self._shardscale.loss_scale()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` times the agreed scale (Megatron's `grad_scale_func`); the scaler also notes
        whether the loss is finite (a forward overflow skips with the scale held)."""
        return self._shardscale.scale_loss(loss)

    def prepare_grads(self) -> bool:
        """Check and unscale every sub-optimizer's gradients in one agreement; once a step.

        Returns:
            Whether any rank's gradients held inf/NaN: then the step is skipped everywhere.
        """
        return self._shardscale.prepare()

    def get_grad_norm(self) -> Any:
        """The norm agreed in `prepare_grads()`'s collective where it travelled there, else
        Megatron's."""
        norm = self._shardscale.norm
        return super().get_grad_norm() if norm is None else _as_megatron_norm(norm)  # type: ignore[misc]

    def step_with_ready_grads(self) -> bool:
        self._shardscale.start_step()
        try:
            return bool(super().step_with_ready_grads())  # type: ignore[misc]
        finally:
            self._shardscale.close()

    def step(self) -> Any:
        """Megatron's own step (prepare, norm, clip, step); the iteration ends with it, taken
        or skipped, so that a loop without `zero_grad()` prepares the next one anew."""
        try:
            return super().step()  # type: ignore[misc]
        finally:
            self._shardscale.close()

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)  # type: ignore[misc]
        self._shardscale.next_iteration()

    def load_state_dict(self, state_dict: Any) -> None:
        with self._shardscale.loading():
            super().load_state_dict(state_dict)  # type: ignore[misc]


def _converted(cls: type) -> type:
    """`cls` with shardscale's agreement mixed in (an `isinstance` of `cls` still), one class
    per Megatron class."""
    if cls not in _CONVERTED:
        _CONVERTED[cls] = type(f"ShardScale{cls.__name__}", (_AgreedOptimizer, cls), {})
    return _CONVERTED[cls]


_CONVERTED: dict[type, type] = {}
