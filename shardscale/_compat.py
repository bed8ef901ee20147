"""torch's private surface, answered from our agreed state.

Public code reads `torch.amp.GradScaler`'s private members: skip detection sums
`scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]`, trainers call
`_found_inf_per_device`, torch's own tests call `_unscale_grads_`, optimizers that take the
deprecated `step(grad_scaler=...)` call `_check_inf_per_device`, and torch's own step body
(a subclass's `step()`, or `torch.amp.GradScaler.step` run on ours) reads a state, calls
`unscale_()` and `_maybe_opt_step()`, and writes the state's stage. This module answers those
for a [`ShardedGradScaler`][shardscale.ShardedGradScaler].

Invariant: a read never communicates, and a view costs nothing until it is read: nothing here
runs on a step that nobody reads it (no kernel, no host read, no dict built, no collective).
`_per_optimizer_states[id(optimizer)]` is live, as torch's dict is: read before `unscale_()`,
it answers what `unscale_()` did after. Once the group has agreed on an optimizer's gradients
(in `step()`, `clip_grad_norm_()`, or a scaler's first `unscale_()`) every view answers with
what it AGREED, the flag every rank holds alike, or nothing where no rank held a gradient (as
torch's holds nothing then). Between an `unscale_()` and the agreement it left for the next
call, the only flag there is without a collective is this rank's own: the views answer it, as
`torch.amp.GradScaler`'s do (its flags are always a rank's own), and on several ranks warn that
it is not the group's (docs/migration.md); a rank without a gradient there answers its own zero
flag, so that torch's body (which asserts that some flag exists) reaches the agreement on every
rank. torch's body then agrees where it decides: `_maybe_opt_step()` is our step, and a fused
optimizer's step, which it runs itself, agrees first (`shardscale._stepping`).
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any, NoReturn, cast

import torch
from torch.amp.grad_scaler import OptState

from shardscale._errors import ShardScaleWarning, no_inf_checks_message
from shardscale._grads import Flags, Kernels, grad_groups, move
from shardscale._state import Verdict, combined
from shardscale._stepping import (
    IterationBook,
    OptimizerRecord,
    Stage,
    Steps,
    leaves,
    optimizer_params,
)

LOCAL_FLAGS_WARNING = (
    "scaler._found_inf_per_device() / _per_optimizer_states read between unscale_() and the "
    "call that agrees on it (step(), clip_grad_norm_() or update()): shardscale agrees in that "
    "call's one collective, and a read never communicates, so this is THIS rank's own flag "
    "(torch.amp.GradScaler's value), which may differ between ranks. Do not branch on it in "
    "ways that change what ranks do; read it after step() for the flag every rank agreed on. "
    "(torch's own step body does not decide on it: its _maybe_opt_step() agrees as step() "
    "does, and a fused optimizer it steps agrees first.)"
)

_READ_ONLY = (
    "scaler._per_optimizer_states mirrors shardscale's agreed state (the flag every rank holds "
    "alike): of its entries only 'stage' may be set, to OptState.STEPPED, as torch's step body "
    "does after stepping an optimizer the scaler has seen. Drive it with unscale_(), step() "
    "and update()."
)


def _refuse(*args: object, **kwargs: object) -> NoReturn:
    raise TypeError(_READ_ONLY)


class ReadOnlyDict(dict[Any, Any]):
    """A `dict` (it compares equal to one, as torch's states do) that refuses every write."""

    __setitem__ = __delitem__ = __ior__ = _refuse
    clear = pop = popitem = setdefault = update = _refuse


class OptimizerState(MutableMapping[str, Any]):
    """`_per_optimizer_states[id(optimizer)]`, live: `{"stage": OptState, "found_inf_per_device":
    {device: flag}}`, read from the optimizer's record at each read (module docstring); an
    optimizer not seen in the iteration reads `{"stage": OptState.READY, "found_inf_per_device":
    {}}`, as torch's fresh state. Writing `"stage"` as torch's step body does (STEPPED, after it
    stepped the optimizer) marks it stepped; other writes are refused."""

    def __init__(self, steps: Steps, book: IterationBook, key: object) -> None:
        self._steps, self._book, self._key = steps, book, key

    def _record(self) -> OptimizerRecord | None:
        return self._book.records.get(self._key) if isinstance(self._key, int) else None

    def __getitem__(self, name: str) -> Any:
        record = self._record()
        if name == "stage":
            return OptState.READY if record is None else OptState[record.stage.name]
        if name == "found_inf_per_device":
            world_size = self._steps.agreement.exchange.world_size
            return ReadOnlyDict() if record is None else flags_of([record], world_size)
        raise KeyError(name)

    def __setitem__(self, name: str, value: Any) -> None:
        record = self._record()
        if name != "stage" or value is not OptState.STEPPED or record is None:
            _refuse()
        if record.stage is not Stage.STEPPED:
            self._steps.stepped(record)

    __delitem__ = _refuse

    def __iter__(self) -> Iterator[str]:
        return iter(("stage", "found_inf_per_device"))

    def __len__(self) -> int:
        return 2

    def __repr__(self) -> str:
        return repr(dict(self.items()))


class OptimizerStates(Mapping[Any, OptimizerState]):
    """`_per_optimizer_states`: per `id(optimizer)`, its live state (module docstring).

    Like torch's `defaultdict`, an optimizer not seen in the iteration reads a fresh state
    (without being inserted). The view holds the iteration it was taken in: after `update()`
    the scaler starts a new one (and `scaler._per_optimizer_states` reads it, empty), as torch
    replaces its dict in `update()`; a view kept from before still reads the old iteration, as
    torch's old dict.
    """

    def __init__(self, steps: Steps) -> None:
        self._steps, self._book = steps, steps.book

    def __getitem__(self, key: object) -> OptimizerState:
        return OptimizerState(self._steps, self._book, key)

    def get(self, key: object, default: Any = None) -> Any:
        """As `dict.get`: `default` for an optimizer not seen (no default state made)."""
        return self[key] if key in self._book.records else default

    def __contains__(self, key: object) -> bool:
        return key in self._book.records

    def __iter__(self) -> Iterator[Any]:
        return iter(list(self._book.records))

    def __len__(self) -> int:
        return len(self._book.records)

    __setitem__ = __delitem__ = _refuse

    def __repr__(self) -> str:
        return f"{type(self).__name__}({dict(self.items())!r})"


def flags_of(records: list[OptimizerRecord], world_size: int) -> ReadOnlyDict:
    """`{device: flag}` of `records`, as torch's states hold it: the agreed flag once the group
    agreed (none where no rank held a gradient); before, between `unscale_()` and its
    agreement, this rank's own (with a warning, on several ranks; a zero flag where this rank
    holds no gradient, so that the group's agreement is still reached); empty where none was
    checked."""
    agreed = combined(record.verdict for record in records)
    flags = {}
    if agreed is not None and agreed.has_grads is not False:
        flags[agreed.found_inf.device] = agreed.found_inf
    waiting = [record for record in records if record.waiting_flags() is not None]
    for record in waiting:
        for device, flag in (record.waiting_flags() or {}).items():
            flags[device] = torch.maximum(flags[device], flag) if device in flags else flag
    if waiting and world_size > 1:  # unscale_()d, not agreed: on every rank, gradients or not
        if not flags:
            first = next(optimizer_params((waiting[0].optimizer,)), None)
            device = torch.device("cpu") if first is None else first.device
            flags[device] = torch.zeros((), dtype=torch.float32, device=device)
        warnings.warn(LOCAL_FLAGS_WARNING, ShardScaleWarning, stacklevel=3)
    return ReadOnlyDict(flags)


def unscale_grads(
    scaler: object,
    optimizer: torch.optim.Optimizer,
    inv_scale: torch.Tensor,
    found_inf: torch.Tensor,
    allow_fp16: bool = True,
) -> Flags:
    """torch's `GradScaler._unscale_grads_` on our gradient walk: a local unscale and check.

    It is `ShardedGradScaler._unscale_grads_` itself (`scaler`: the scaler it is called on,
    which it does not need); `allow_fp16` defaults to True, as in torch's ShardedGradScaler.

    Multiplies `optimizer`'s local gradients (DTensor shards, FSDP1 flat shards, sparse
    values, coalesced as torch does) by `inv_scale` and raises `found_inf` where any element
    is inf/NaN: `found_inf` itself on its device, a copy of it on each other device holding
    gradients. Like torch's, it involves no other rank and records nothing in the iteration.

    Returns:
        `{device: flag}` for each device holding gradients (empty when none has one).

    Raises:
        ValueError: `allow_fp16` is False and a gradient is float16 (torch's words).
    """
    params = tuple(optimizer_params((optimizer,)))
    if not allow_fp16 and any(p.grad is not None and p.grad.dtype == torch.float16 for p in params):
        raise ValueError("Attempting to unscale FP16 gradients.")
    with torch.no_grad():
        groups, _has_elements = grad_groups(params)
        flags: Flags = {found_inf.device: found_inf}
        for device, _dtype in groups:
            if device not in flags:
                flags[device] = found_inf.to(device=device, copy=True)
        Kernels().check_(groups, inv_scale, flags)
    return {device: flags[device] for device, _dtype in groups}


def get_scale_async(scaler: Any) -> torch.Tensor | None:
    """torch's `_get_scale_async`: the scale tensor without a sync (frameworks read it)."""
    return None if scaler._home.device is None else scaler._home.device.scale


def get_growth_tracker(scaler: Any) -> int:
    """torch's `_get_growth_tracker`: the tracker as an int (one host read once on a device)."""
    return scaler._home.read().scale.growth_tracker if scaler._enabled else 0


def found_inf_per_device(scaler: Any, optimizer: Any) -> dict[str, Any]:
    """torch's `_found_inf_per_device`: `optimizer`'s flag as `{device: flag}`, the agreed one
    after `step()`; between `unscale_()` and `step()` this rank's own, with a warning (as
    `_per_optimizer_states`); empty if not checked yet. (Annotated as torch annotates it; the
    keys are devices.)
    """
    book = scaler._steps.book
    records = [book.records[id(leaf)] for leaf in leaves(optimizer) if id(leaf) in book.records]
    return flags_of(records, scaler._agreement.exchange.world_size)


def check_inf_per_device(scaler: Any, optimizer: Any) -> dict[str, Any]:
    """torch's `_check_inf_per_device`: check `optimizer`'s gradients (not unscaling them) and
    agree, in one collective.

    torch's optimizers of the `grad_scaler=` protocol call it from their `step()`, and torch's
    step body for a fused optimizer; the flag it returns, and records for `update()`, is the
    group's, alike on every rank.

    Raises:
        RuntimeError: no `scale()` yet on a rank alone (torch's words), or disabled.
    """
    if not scaler._enabled:
        raise RuntimeError("_check_inf_per_device() was called on a disabled scaler")
    steps = scaler._steps
    scale = steps.loss_scale("_check_inf_per_device", optimizer)
    records = [steps.book.record(leaf) for leaf in leaves(optimizer)]
    steps.agree(scale, "_check_inf_per_device", check=records)
    return found_inf_per_device(scaler, optimizer)


def check_scale_growth_tracker(scaler: Any, funcname: str) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's `_check_scale_growth_tracker`: the scale and growth tracker tensors; torch's
    words if `scale()` never ran.

    Raises:
        RuntimeError: no state on a device yet (torch raises AssertionError, same words).
    """
    state = scaler._home.require(funcname)
    return state.scale, state.growth_tracker


def lazy_init_scale_growth_tracker(scaler: Any, dev: str | torch.device) -> None:
    """torch's `_lazy_init_scale_growth_tracker`: put the state on `dev` now rather than at the
    first `scale()` (accelerate calls it after loading a state dict for FSDP2). A no-op once
    there."""
    if scaler._enabled and scaler._home.device is None:
        scaler._home.at(torch.device(dev))  # "cuda": the tensors land on the current GPU


def maybe_opt_step(
    scaler: Any,
    optimizer: torch.optim.Optimizer,
    optimizer_state: Mapping[str, Any],
    *args: Any,
    **kwargs: Any,
) -> Any:
    """torch's `GradScaler._maybe_opt_step` (`ShardedGradScaler._maybe_opt_step` itself:
    `scaler` is the scaler it is called on): the step body of subclasses and framework scalers
    written on torch.amp, `unscale_(optimizer)` then this, runs our step of `optimizer`.

    torch's steps unless `optimizer_state`'s flags say inf/NaN; between `unscale_()` and the
    agreement those flags are this rank's own, so a rank holding the inf would skip while the
    others step. Here the group's agreement decides, in the collective our step issues on
    every rank (as torch's `ShardedGradScaler` agrees inside `unscale_`); `optimizer_state` is
    not read. It is our step's machinery, never `scaler.step()`, which a subclass whose
    `step()` is torch's body overrides (calling that would recurse).
    """
    return scaler._steps.take(optimizer, None, args, kwargs)


class TorchBody:
    """What torch's step body needs of a fused optimizer it steps itself.

    That body (subclasses and framework scalers written on torch.amp) calls `unscale_()`, then
    steps a fused optimizer itself, handing it the flags `_per_optimizer_states` holds: this
    rank's own while the check waits. A hook on the optimizer's step agrees first (the
    collective this scaler's step would issue there, on every rank that runs the body) and
    hands it the agreed flag instead. Registered once per optimizer, at the `unscale_()` that
    leaves its check waiting; it does nothing where the flag handed is the agreed one already
    (this scaler's own step), or where none is (no scaler's step).
    """

    def __init__(self, steps: Steps) -> None:
        self.steps = steps
        self._hooked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()

    def agree_first(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Hook each of `optimizers` (fused, left waiting by `unscale_()`), once."""
        for optimizer in optimizers:
            register = getattr(optimizer, "register_step_pre_hook", None)
            if register is not None and optimizer not in self._hooked:
                self._hooked.add(optimizer)
                # weakly: a dropped scaler's hooks must not keep its steps alive
                register(functools.partial(_agree_first, weakref.ref(self.steps)))


def _agree_first(steps: weakref.ref[Steps], optimizer: Any, args: Any, kwargs: Any) -> None:
    """A fused optimizer's step pre-hook (`TorchBody`): agree first, while the scaler lives.

    Raises:
        RuntimeError: no rank held a gradient when `unscale_()` checked it (as this scaler's
            own step raises there: the gradients since were never checked).
    """
    alive = steps()
    record = None if alive is None else alive.book.records.get(id(optimizer))
    found_inf = getattr(optimizer, "found_inf", None)  # torch's sum: the int 0 of no flag
    if alive is None or record is None or record.waiting_flags() is None or found_inf is None:
        return
    alive.agree(alive.loss_scale("step", optimizer), "step")
    verdict = cast(Verdict, record.verdict)
    if not verdict.has_grads:
        raise RuntimeError(no_inf_checks_message(alive.agreement.exchange.world_size))
    device = found_inf.device if isinstance(found_inf, torch.Tensor) else verdict.flags.device
    optimizer.found_inf = move(verdict.found_inf, device)


def torch_view(name: str, read: Callable[[Any], Any], instead: str) -> property:
    """A read-only property under torch's private `name`; assigning it raises, saying what to
    use `instead` (it mirrors the agreed state, which only the protocol moves)."""

    def refuse(scaler: Any, value: object) -> NoReturn:
        raise AttributeError(
            f"{type(scaler).__name__}.{name} mirrors shardscale's agreed state and cannot be "
            f"assigned; use {instead}"
        )

    return property(read, refuse, doc=read.__doc__)


def growth_tracker_tensor(scaler: Any) -> torch.Tensor | None:
    """The int32 growth tracker tensor (None before the first `scale()`), as torch's."""
    return None if scaler._home.device is None else scaler._home.device.growth_tracker


def device_type(scaler: Any) -> str:
    """The device type (accelerate reads it on resume)."""
    if scaler._home.device is not None:
        return str(scaler._home.device.scale.device.type)
    return scaler._config.device or "cpu"


def optimizer_states(scaler: Any) -> OptimizerStates:
    """Per `id(optimizer)`: `{"stage": OptState, "found_inf_per_device": {device: flag}}`.

    A live view of this iteration, read when read: after `step()` the flag is the AGREED one,
    so `sum(v.item() for v in ...["found_inf_per_device"].values())` says whether the step was
    skipped, alike on every rank; between `unscale_()` and `step()` this rank's own, with a
    warning on several ranks (a read never communicates: docs/migration.md). After `update()`
    it is empty, as torch's.
    """
    return OptimizerStates(scaler._steps)


def start_value(field: str) -> Any:
    """torch's `_init_scale` (`field` "scale") or `_init_growth_tracker` ("growth_tracker"): the
    value the state starts from when it is put on a device. Writing it is effective until the
    first `scale()`, as torch's, and checked: a scale the policy can hold; a tracker any int
    >= 0, as torch takes it (its own tests write 7 with `growth_interval` 1: a tracker at or
    past the interval grows the scale at the next clean step)."""
    name = f"_init_{field}"

    def write(scaler: Any, value: Any) -> None:
        if field == "scale":
            scaler.policy.check_scale(name, float(value))
            value = float(value)
        elif isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        scaler._home.set_start(**{field: value})

    return property(lambda scaler: getattr(scaler._home.host.scale, field), write)


def torch_alias(getter: str, setter: str) -> Any:
    """torch's private attribute for a setting: reading is `getter()`, writing `setter()`."""
    return property(
        lambda self: getattr(self, getter)(),
        lambda self, value: getattr(self, setter)(value),
        doc=f"`{getter}()`; writing it is `{setter}()` (checked).",
    )


def answer_torchs_members(scaler_class: type) -> None:
    """Give `scaler_class` (`ShardedGradScaler`) torch's private members, each answered here.

    Public code reads them (skip detection sums `_per_optimizer_states[id(opt)]
    ["found_inf_per_device"]`, trainers call `_found_inf_per_device`, optimizers of the
    deprecated `grad_scaler=` protocol call `_check_inf_per_device`, accelerate sets up FSDP2
    through `_lazy_init_scale_growth_tracker`). They are set on the class from here, not written
    in its body, so that the class reads as its public API and keeps torch's base alone.
    """
    views = {
        "_scale": (get_scale_async, "update(new_scale=...) or load_state_dict()"),
        "_growth_tracker": (growth_tracker_tensor, "load_state_dict()"),
        "_device": (device_type, "the device argument, or the first loss's device"),
        "_per_optimizer_states": (optimizer_states, "unscale_(), step() and update()"),
    }
    members: dict[str, Any] = {
        name: torch_view(name, read, instead) for name, (read, instead) in views.items()
    }
    members |= {
        "_growth_factor": torch_alias("get_growth_factor", "set_growth_factor"),
        "_backoff_factor": torch_alias("get_backoff_factor", "set_backoff_factor"),
        "_growth_interval": torch_alias("get_growth_interval", "set_growth_interval"),
        "_init_scale": start_value("scale"),
        "_init_growth_tracker": start_value("growth_tracker"),
        "_get_scale_async": get_scale_async,
        "_get_growth_tracker": get_growth_tracker,
        "_found_inf_per_device": found_inf_per_device,
        "_check_inf_per_device": check_inf_per_device,
        "_unscale_grads_": unscale_grads,
        "_check_scale_growth_tracker": check_scale_growth_tracker,
        "_lazy_init_scale_growth_tracker": lazy_init_scale_growth_tracker,
        "_maybe_opt_step": maybe_opt_step,
    }
    for name, member in members.items():
        setattr(scaler_class, name, member)
