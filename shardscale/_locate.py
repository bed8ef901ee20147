"""Which parameters overflowed, or underflow, on which rank: named as in the user's model.

A sharded model hides its parameters behind wrappers: DDP's `module.`, FSDP1's
`_fsdp_wrapped_module.` and flat parameters (one `_flat_param` holding many original
parameters, each rank a slice of it), activation checkpointing's `_checkpoint_wrapped_module.`,
`torch.compile`'s `_orig_mod.`, FSDP2's DTensors. Each rank counts the infs and NaNs in the
gradient elements it holds, per original parameter (an FSDP1 flat shard is cut back into the
original parameters by the offsets FSDP records), and the exchange gathers the records, so
every rank gets the same list (within the scaler's `sync_timeout`). A step whose loss itself was
non-finite (a forward overflow) adds a record named `<loss>` for each rank whose loss was.

Locating costs host reads and a collective, so the scaler runs it only on steps every rank
already agreed overflowed (`locate_overflow=True`), and when its alarms sound (gradients still
non-finite at the floor). Knowing that a step overflowed is itself one host read of the agreed
flag per step (free after a plain step, whose decision reads it anyway; one synchronisation per
step after a fused step on an accelerator).

Where the ranks met in the scaler's collective with different calls or states (the ballot's
identity differs), [`name_mismatch`][] names each rank's, with one gather, in the same words on
every rank.

The other direction, [`find_underflowing_grads`][], counts per original parameter the elements
below fp16's normal range, by `shardscale._bins`' one definition of "underflow".
"""

from __future__ import annotations

import functools
import logging
import math
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from shardscale._bins import underflow_counts
from shardscale._config import timeout_option
from shardscale._errors import ShardScaleMismatchError, ShardScaleWarning
from shardscale._exchange import Exchange
from shardscale._grads import move, original_slices
from shardscale._policy import check_real

# The library's logger: INFO per skipped step (rate-limited), WARNING for located overflows.
logger = logging.getLogger("shardscale")

# The name of a located non-finite loss (a forward overflow), not a parameter's.
LOSS = "<loss>"

_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")
_DDP_PREFIX = "module."


@dataclass(frozen=True, slots=True)
class NonFiniteGrad:
    """Non-finite gradient elements of one parameter (or of the loss: name `"<loss>"`), as held
    by one rank."""

    rank: int
    """The global rank holding them."""
    name: str
    """The parameter's fully-qualified name in the original model (no wrapper prefixes)."""
    num_inf: int
    """How many of this rank's elements of the gradient are +-inf."""
    num_nan: int
    """How many are NaN."""

    def __str__(self) -> str:
        return f"rank {self.rank}: {self.name} ({self.num_inf} inf, {self.num_nan} NaN)"


def clean_name(name: str) -> str:
    """`name` without the wrapper modules' prefixes."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _unwrapped(module: nn.Module) -> nn.Module:
    """The user's model inside DDP / `torch.compile` wrappers (whose names add a prefix)."""
    while True:
        inner = getattr(module, "_orig_mod", None)
        if isinstance(module, nn.parallel.DistributedDataParallel):
            inner = module.module
        if not isinstance(inner, nn.Module):
            return module
        module = inner


def optimizer_named_params(optimizer: torch.optim.Optimizer) -> Iterator[tuple[str, torch.Tensor]]:
    """The optimizer's parameters with names: its `param_names` if it was built from
    `model.named_parameters()`, else their positions, `param_groups[g][i]`.

    Built from a DDP model, every name starts with DDP's `module.`: it is dropped then.
    """
    named: list[tuple[str, torch.Tensor]] = []
    for g, group in enumerate(optimizer.param_groups):
        params = group["params"]
        names = group.get("param_names") or [f"param_groups[{g}][{i}]" for i in range(len(params))]
        named += zip(names, params, strict=True)
    if named and all(name.startswith(_DDP_PREFIX) for name, _ in named):
        named = [(name[len(_DDP_PREFIX) :], param) for name, param in named]
    return iter(named)


def locate(
    named_params: Iterable[tuple[str, torch.Tensor]],
    exchange: Exchange,
    step: int | None,
    losses: Iterable[torch.Tensor] = (),
    required: bool = False,
) -> list[NonFiniteGrad]:
    """Count non-finite local gradient elements per original parameter (and in `losses`, as
    one `<loss>` record); gather over the group.

    Returns the same list on every rank: by rank, then in parameter order, the loss first.

    Raises:
        RuntimeError: `required`, and no rank held a gradient element to look at.
    """
    losses = list(losses)
    pieces = [(LOSS, torch.cat([loss.reshape(-1) for loss in losses]))] if losses else []
    pieces += _pieces(named_params)
    counts = _counts(pieces, lambda v: torch.stack((v.isinf().sum(), v.isnan().sum())))
    mine = [
        NonFiniteGrad(rank=_rank(), name=name, num_inf=infs, num_nan=nans)
        for (name, _), (infs, nans) in zip(pieces, counts, strict=True)
        if infs or nans
    ]
    return _gathered(exchange, pieces, mine, step, "their non-finite gradient records", required)


def locate_optimizers(
    optimizers: Iterable[torch.optim.Optimizer],
    exchange: Exchange,
    step: int | None,
    losses: Iterable[torch.Tensor] = (),
) -> list[NonFiniteGrad]:
    """[`locate()`][locate] over the optimizers' parameters, named as they name them."""
    named = [pair for optimizer in optimizers for pair in optimizer_named_params(optimizer)]
    return locate(named, exchange, step, losses)


Pieces = list[tuple[str, torch.Tensor]]  # (original name, local gradient elements)


def name_mismatch(exchange: Exchange, mine: dict[str, str], step: int) -> ShardScaleMismatchError:
    """The error for ranks whose ballots' identities differ (`shardscale._check`), naming each
    rank's `mine` (its call, its state), gathered from every rank: call it on every rank (each
    saw the mismatch in the same reduced tensor), and raise what it returns."""
    ranks = exchange.gather_objects(mine, step, "what each rank's ballot was")
    named = "; ".join(
        f"rank {rank}: {cast(dict[str, str], them)['call']}, "
        f"its state {cast(dict[str, str], them)['state']}"
        for rank, them in enumerate(ranks)
    )
    return ShardScaleMismatchError(  # the same words on every rank: no step of its own
        f"the {len(ranks)} ranks met in the scaler's collective with different calls or "
        f"different scaler states (its identity differs), so their decisions would part: "
        f"{named}. Every rank must make the same calls to the scaler "
        "in the same order, and load the same state (a checkpoint loaded on some ranks "
        "only, or a stale copy on one node, differs); nothing of this step was applied"
    )


def _pieces(named_params: Iterable[tuple[str, torch.Tensor]]) -> Pieces:
    """`(original name, local gradient elements)` of each original parameter holding some."""
    pieces = [
        (clean_name(piece), values)
        for name, param in named_params
        for piece, values in original_slices(name, param)
    ]
    return [(name, values) for name, values in pieces if values.numel() > 0]


def _counts(pieces: Pieces, measure: Callable[[torch.Tensor], torch.Tensor]) -> list[list[int]]:
    """`measure(values)` (a 1-D tensor of counts) of each piece: counted where it lives, one host
    transfer per device."""
    by_device: dict[torch.device, list[int]] = {}
    for i, (_, values) in enumerate(pieces):
        by_device.setdefault(values.device, []).append(i)
    counts: list[list[int]] = [[]] * len(pieces)
    with torch.no_grad():
        for indices in by_device.values():
            rows = torch.stack([measure(pieces[i][1]) for i in indices]).cpu().tolist()
            for i, row in zip(indices, rows, strict=True):
                counts[i] = [int(count) for count in row]
    return counts


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def find_nonfinite_grads(
    module: nn.Module,
    process_group: dist.ProcessGroup | None = None,
    *,
    timeout: timedelta | float | None = None,
) -> list[NonFiniteGrad]:
    """Which parameters of `module` hold inf/NaN gradient elements, on which rank.

    Works for plain modules, DDP, FSDP1 (flat parameters, `use_orig_params` either way: the
    flat shard is cut back into the original parameters), FSDP2/DTensor (each rank counts its
    local shard) and sparse gradients. Names are the original model's fully-qualified names,
    without `module.`, `_fsdp_wrapped_module.`, `_checkpoint_wrapped_module.`,
    `_orig_mod.` or `_flat_param`.

    A collective when the process group has more than one rank: call it on every rank of
    `process_group` (None: the default group); `timeout` bounds the wait for the other
    ranks (a `timedelta` or seconds; None: the group's own). Counts whatever the gradients
    hold now, scaled or not (scaling changes no element's finiteness).

    Returns:
        [`NonFiniteGrad`][] records (`rank`, `name`, `num_inf`, `num_nan`) for every
        (rank, parameter) with a non-finite element, identical on every rank, by rank then in
        parameter order. Empty when every gradient is finite.

    Raises:
        TypeError: `module` is not a module.
        RuntimeError: no parameter holds a gradient element on any rank (nothing was looked
            at: an empty list would read as "all finite"), on every rank together.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    exchange = Exchange(process_group, timeout_option("timeout", timeout))
    return locate(_unwrapped(module).named_parameters(), exchange, None, required=True)


@dataclass(frozen=True, slots=True)
class UnderflowingGrad:
    """Gradient elements of one parameter, as held by one rank, below fp16's normal range.

    Attributes:
        rank: the global rank holding them.
        name: the parameter's fully-qualified name in the original model (no wrapper prefixes).
        num_underflowing: how many of the counted elements were below 2^-14 (times `scale`).
        num_nonzero: how many of its elements were counted: the non-zero ones whose magnitude
            (times `scale`) lies in 2^-64 ... 2^64, where the scaler's underflow meter counts
            too (`shardscale._bins`: one definition of "underflow" for both).
    """

    rank: int
    name: str
    num_underflowing: int
    num_nonzero: int

    @property
    def fraction(self) -> float:
        """`num_underflowing / num_nonzero`."""
        return self.num_underflowing / self.num_nonzero


def find_underflowing_grads(
    module: nn.Module,
    scale: float = 1.0,
    process_group: dist.ProcessGroup | None = None,
    *,
    timeout: timedelta | float | None = None,
) -> list[UnderflowingGrad]:
    """Which parameters of `module` hold gradient elements below fp16's normal range (2^-14:
    subnormal in fp16, or flushed to zero), on which rank, and how many: the layers behind the
    scaler's `stats.underflow`.

    Counts the gradients as they are, times `scale`: between `scaler.scale(loss).backward()` and
    the scaler's `step()` (or `unscale_()`) they still carry the loss scale, so leave `scale` at
    1; after, pass `scaler.get_scale()`. Zeros are not counted: a zero is the same at every
    scale, and in an fp16 gradient it cannot be told from a flushed value. Nor are magnitudes
    outside 2^-64 ... 2^64 (times `scale`), which the meter's bins do not hold either: the
    fraction here is the meter's, per parameter.

    Works for every model [`find_nonfinite_grads()`][shardscale.find_nonfinite_grads] does, with
    the same names, and like it is a collective when the process group has more than one rank:
    call it on every rank of `process_group` (None: the default group); `timeout` bounds the
    wait for the others.

    Returns:
        [`UnderflowingGrad`][] records (`rank`, `name`, `num_underflowing`, `num_nonzero`,
        `fraction`) for every (rank, parameter) with an element below 2^-14, identical on every
        rank, by rank then in parameter order.

    Raises:
        TypeError, ValueError: `module` is not a module, or `scale` is not a finite number > 0.
        RuntimeError: no parameter holds a gradient element on any rank (nothing was counted),
            on every rank together.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    factor = check_real("scale", scale)
    if not (math.isfinite(factor) and factor > 0):
        raise ValueError(f"scale must be a finite number > 0, got {scale}")
    exchange = Exchange(process_group, timeout_option("timeout", timeout))

    pieces = _pieces(_unwrapped(module).named_parameters())
    mine = [
        UnderflowingGrad(rank=_rank(), name=name, num_underflowing=below, num_nonzero=nonzero)
        for (name, _), (below, nonzero) in zip(
            pieces, _counts(pieces, lambda values: underflow_counts(values, factor)), strict=True
        )
        if below
    ]
    return _gathered(exchange, pieces, mine, None, "their underflowing gradient records", True)


def _gathered(
    exchange: Exchange, pieces: Pieces, mine: list[Any], step: int | None, what: str, required: bool
) -> list[Any]:
    """Every rank's records, in rank order, gathered on the device of the tensors counted;
    `required`: where no rank held a gradient element, nothing was looked at, and every rank
    raises together (an empty list would read as "none found")."""
    near = [values.device for _, values in pieces]
    gathered = exchange.gather_objects((bool(pieces), mine), step, what, near)
    held = [cast(tuple[bool, list[Any]], rank) for rank in gathered]
    if required and not any(looked for looked, _ in held):
        raise RuntimeError(
            "no parameter holds a gradient element on any rank, so there was nothing to look "
            "at: call it after the backward (before zero_grad), on every rank"
        )
    return [record for _, records in held for record in records]


def log_located(step: int, located: list[NonFiniteGrad], forward: bool) -> None:
    """Log where an overflow step's non-finite values were (WARNING: a real anomaly)."""
    if forward:
        ranks = sorted({record.rank for record in located if record.name == LOSS})
        logger.warning(
            "step %d skipped: the loss itself was non-finite on rank(s) %s (a forward overflow: "
            "loss scaling cannot fix it, so the scale is held); non-finite at: %s",
            step,
            ranks,
            "; ".join(map(str, located)),
        )
        return
    logger.warning(
        "step %d overflowed; non-finite gradients at: %s",
        step,
        "; ".join(map(str, located)) or "(none: already cleared)",
    )


@dataclass(frozen=True, slots=True)
class UnderflowingActivation:
    """The gradient with respect to one module's output, in one backward, over every rank: how
    much of it sat below fp16's normal range, at the scale the backward ran with.

    Attributes:
        name: the module's fully-qualified name in the user's model (no wrapper prefixes).
        num_underflowing: of the counted elements, those below 2^-14: subnormal in fp16.
        num_nonzero: the counted elements: the non-zero ones whose magnitude lies in 2^-64 ...
            2^64 (`shardscale._bins`' one definition, the meter's).
        num_zeros: the exact zeros. In an fp16 gradient a zero may be a value flushed below
            2^-24 or a true zero (ReLU's mask, dropout, a padded token): nothing here tells them
            apart. In an fp32 one (a module autocast runs in fp32) a flush needs a value below
            1e-45: its zeros are true zeros.
        dtype: the gradient's dtype (`"float16"`, ...).
    """

    name: str
    num_underflowing: int
    num_nonzero: int
    num_zeros: int
    dtype: str

    @property
    def fraction(self) -> float | None:
        """`num_underflowing / num_nonzero`; None without a counted element (nothing measured:
        a gradient of zeros, or beyond the bins' range)."""
        return self.num_underflowing / self.num_nonzero if self.num_nonzero else None


class ActivationWatch:
    """The context of [`watch_activations()`][shardscale.watch_activations]: hooks while it is
    open, [`records`][records] once it has closed."""

    def __init__(self, model: nn.Module, exchange: Exchange) -> None:
        self._model, self._exchange = model, exchange
        self._handles: list[Any] = []
        self._open = False
        # (name, id(tensor)) hooked already, while that tensor lives (a wrapper's output is its
        # inner module's, same name): the entry goes with the tensor, so that a later pass's
        # tensor at the same address (CPython reuses ids) is hooked too
        self._hooked: dict[tuple[str, int], weakref.ref[torch.Tensor]] = {}
        # per module: its counts on the device, [below, counted, non-zero], its elements, dtype
        self._counts: dict[str, tuple[torch.Tensor, int, str]] = {}
        self._outputs = 0  # module outputs hooked while open (0 at closing: no forward ran)
        self.records: list[UnderflowingActivation] | None = None
        """Every module whose output's gradient the backward reached, the worst (the largest
        fraction below 2^-14) first; identical on every rank. None until the watch closes, and
        where it measured nothing (no backward reached a watched output: a warning says so)."""

    def __enter__(self) -> ActivationWatch:
        """Open (again): every reading starts from zero, the last one's records dropped."""
        self._hooked.clear()
        self._counts.clear()
        self._outputs, self.records = 0, None
        self._open = True
        for name, module in _unwrapped(self._model).named_modules():
            clean = clean_name(name + ".").removesuffix(".")  # a wrapper's inner module too
            if clean:  # not the model itself, nor a root wrapper's inner module
                self._handles.append(module.register_forward_hook(self._on_output(clean)))
        return self

    def _on_output(self, name: str) -> Callable[..., None]:
        """A forward hook: a gradient hook on each of the module's outputs that needs one."""

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            for tensor in _tensors_in(output):
                key = (name, id(tensor))
                if self._open and tensor.requires_grad and key not in self._hooked:
                    self._hooked[key] = weakref.ref(tensor, functools.partial(self._forget, key))
                    self._outputs += 1
                    tensor.register_hook(lambda grad: self._count(name, grad))  # type: ignore[no-untyped-call]

        return hook

    def _forget(self, key: tuple[str, int], _freed: object = None) -> None:
        """A hooked output was freed: its id may come back, for another tensor."""
        self._hooked.pop(key, None)

    def _count(self, name: str, grad: torch.Tensor) -> None:
        """Add `grad`'s counts to `name`'s, on its device: no host read during the backward."""
        if not self._open:  # a backward after the watch closed: not this one's
            return
        with torch.no_grad():
            counts = torch.cat((underflow_counts(grad, 1.0), torch.count_nonzero(grad).reshape(1)))
            known = self._counts.get(name)
            elements = grad.numel()
            if known is not None:
                counts, elements = counts + move(known[0], counts.device), elements + known[1]
        self._counts[name] = (counts, elements, str(grad.dtype).removeprefix("torch."))

    def __exit__(self, *exc: object) -> None:
        """Close: remove the hooks, read the counts (one host transfer per device), gather them
        from every rank (one gather) and make the records."""
        self._open = False
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if exc[0] is not None:
            return
        near = [counts.device for counts, _elements, _dtype in self._counts.values()]
        mine = (self._outputs, _read_counts(self._counts))
        gathered = cast(
            list[tuple[int, dict[str, list[Any]]]],
            self._exchange.gather_objects(mine, None, "their activation gradient counts", near),
        )
        if not any(outputs for outputs, _ in gathered):  # every rank alike: they gathered
            raise RuntimeError(_NO_FORWARD)
        totals: dict[str, list[Any]] = {}
        for _, ranks_counts in gathered:
            for name, (below, counted, nonzero, elements, dtype) in ranks_counts.items():
                total = totals.setdefault(name, [0, 0, 0, dtype])
                total[0], total[1] = total[0] + below, total[1] + counted
                total[2] += elements - nonzero
        if not totals:
            warnings.warn(_NO_BACKWARD, ShardScaleWarning, stacklevel=2)
            return
        records = [UnderflowingActivation(name, *total) for name, total in totals.items()]
        self.records = sorted(records, key=_worst_first)


_NO_FORWARD = (
    "watch_activations(): no forward ran inside the watch, on any rank, so no gradient could be "
    "watched: it hooks each module's forward, then the gradient of its output in the backward. "
    "Enter it before the forward of the iteration to watch (around forward and backward), not "
    "after it"
)
_NO_BACKWARD = (
    "watch_activations(): a forward ran inside the watch but no backward reached a watched "
    "module's output (no backward inside it, or no output required grad): nothing was "
    "measured, and records is None. Run the backward inside the watch too"
)


def _read_counts(counts: dict[str, tuple[torch.Tensor, int, str]]) -> dict[str, list[Any]]:
    """Each module's counts as host numbers, `[below, counted, non-zero, elements, dtype]`: one
    transfer per device."""
    by_device: dict[torch.device, list[str]] = {}
    for name, (values, _elements, _dtype) in counts.items():
        by_device.setdefault(values.device, []).append(name)
    read: dict[str, list[Any]] = {}
    for names in by_device.values():
        rows = torch.stack([counts[name][0] for name in names]).cpu().tolist()
        for name, row in zip(names, rows, strict=True):
            read[name] = [*map(int, row), counts[name][1], counts[name][2]]
    return read


def _tensors_in(output: Any) -> Iterator[torch.Tensor]:
    """The tensors in a module's output: itself, or those in (nested) tuples, lists and dicts."""
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (tuple, list)):
        for item in output:
            yield from _tensors_in(item)
    elif isinstance(output, dict):
        for item in output.values():
            yield from _tensors_in(item)


def _worst_first(record: UnderflowingActivation) -> tuple[float, int]:
    """The largest fraction below 2^-14 first; then the most elements there; the records
    without a fraction (nothing counted) last."""
    return (-(record.fraction if record.fraction is not None else -1.0), -record.num_underflowing)


def watch_activations(
    model: nn.Module,
    process_group: dist.ProcessGroup | None = None,
    *,
    timeout: timedelta | float | None = None,
) -> ActivationWatch:
    """Where in `model` fp16 loses gradient: the gradient with respect to each module's output,
    in the backward the context surrounds, measured against fp16's normal range.

    The parameters' gradients show it late: they are formed after the activations' gradients
    (fp16 under autocast) have already flushed to zero what fell below 2^-24 and rounded what
    fell below 2^-14, and those of norms, embeddings and gains are formed in fp32 besides. So
    this watches the activations' gradients themselves:

    ```python
    with shardscale.watch_activations(model) as watch:   # before the forward: it hooks it
        with torch.autocast("cuda", dtype=torch.float16):
            loss = loss_fn(model(inputs), targets)
        scaler.scale(loss).backward()
    for record in watch.records[:5]:                      # the worst first
        print(record.name, f"{record.fraction:.1%}", record.dtype)
    ```

    Enter it before the forward of the iteration to watch: it hooks every module's forward, and
    each output's gradient in the backward. The gradients are taken as they flow, at the scale
    the backward ran with (the loss scale is in them); each module's record counts the non-zero
    elements, those below 2^-14 (`fraction`), and the zeros, which in an fp16 gradient may be
    flushed values ([`UnderflowingActivation`][shardscale.UnderflowingActivation] says what can
    be told apart). Names are the user's model's, without DDP's, FSDP1's, activation
    checkpointing's or `torch.compile`'s prefixes, as
    [`find_nonfinite_grads()`][shardscale.find_nonfinite_grads] names parameters; a module
    called several times in the forward adds up.

    Cost: nothing outside the context. Inside, a forward hook per module call, and per output's
    gradient about six kernels (abs, a cast from fp16, log2, the range tests, the sums) and a
    temporary of its size, no host read; on closing, one host transfer per device and one
    gather (two collectives) of the records when the process group has more than one rank:
    call it on every rank of `process_group` (None: the default group); `timeout` bounds the
    wait for the others. Every rank then holds the same records, counted over every rank.

    Returns:
        An [`ActivationWatch`][shardscale.ActivationWatch]: its `records`, once closed.

    Raises:
        TypeError: `model` is not a module.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return ActivationWatch(model, Exchange(process_group, timeout_option("timeout", timeout)))
