"""The device path, counted on a CPU: the scaler on ``meta``, a dispatch-mode counter, stubs.

On the ``meta`` device every ``device.type != "cpu"`` branch of the scaler runs (kernels run as
shape functions), so what a step costs on a GPU can be counted here, per step, exactly:

* **host reads**: ``aten._local_scalar_dense`` of a meta tensor (``.item()``, ``bool()``): each
  one stalls the host until the device queue has drained. Meta has no values, so the counter
  answers with ``value`` (default 0: a clean step).
* **device->host copies**: ``_to_copy`` / ``copy_`` from meta to the CPU, blocking (a stall,
  like a read: ``.cpu()``, and ``.tolist()``, which copies first) or ``non_blocking`` (into
  pinned memory, waited for by an event).
* **host->device copies**: ``_to_copy`` / ``copy_`` from the CPU to meta (never a stall).
* **device kernels**: every other aten op that reads or writes a meta tensor's data: pointwise
  maths, reductions, ``_foreach_*`` (ONE per call: on CUDA ``multi_tensor_apply`` launches one
  kernel per ~100 tensors, so "one" holds per call up to that size), ``cat``/``stack``,
  ``clone``, meta->meta ``_to_copy`` (a dtype cast) and ``copy_``, and fills
  (``zeros``/``ones``/``full``/``*_like``/``fill_``).
  NOT kernels: views and metadata (``view``, ``_unsafe_view``, ``as_strided``, ``reshape``,
  ``select``, ``slice``, ``detach``, ``alias``, ``t``, ``transpose``, ``expand``,
  ``squeeze``/``unsqueeze``, ``unbind``), allocations without a fill (``empty``,
  ``empty_like``, ``empty_strided``, ``new_empty``), and ops that touch no meta tensor
  (profiler markers, CPU maths).
* **event waits**: waits for a non-blocking copy to land (CUDA's ``Event.synchronize``: a host
  wait, on a copy queued one step earlier).

The scaler takes its CUDA branches (late reads through non-blocking copies, capture checks,
device contexts) under ``shardscale.testing.cuda_path()``, the package's own seam: ``measure``
runs every case under it. ``CudaStubs``/``install_cuda_stubs`` replace ``torch.cuda``'s events,
streams and device context with recorders, for the tests of the one class that calls them
(``shardscale._state.DevicePath``).

The optimizers are stubs, as in the audit (section 9.1): the scaler sees only whether an optimizer
takes ``grad_scale``/``found_inf`` itself. ``Plain`` stands for for-loop, foreach and
capturable non-fused optimizers (they look alike to the scaler); ``Fused`` for ``fused=True``.
Their own work is not counted (it is the optimizer's, not the scaler's).

Invariant: a ``Case`` is a pure description; ``measure`` runs it from a fresh scaler for
``steps`` steps and returns the counts of the last step's window only, so constants made once
(cached per device) never count.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from shardscale.testing import CudaPathLog, cuda_path

__all__ = [
    "CASES",
    "META",
    "Case",
    "Counts",
    "CudaStubs",
    "DeviceCounter",
    "Fused",
    "Plain",
    "install_cuda_stubs",
    "measure",
    "measure_torch",
    "meta_params",
]

aten = torch.ops.aten
META = torch.device("meta")
CPU = torch.device("cpu")

_NOT_KERNELS = frozenset(
    {
        "view",
        "_unsafe_view",
        "_reshape_alias",
        "as_strided",
        "reshape",
        "select",
        "slice",
        "detach",
        "alias",
        "t",
        "transpose",
        "expand",
        "squeeze",
        "unsqueeze",
        "unbind",
        "permute",
        "split",
        "split_with_sizes",
        "narrow",
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
        "lift_fresh",
        "_local_scalar_dense",
        "is_same_size",
        "_has_compatible_shallow_copy_type",
    }
)


@dataclass(frozen=True)
class Counts:
    """What one window cost, in the units of the module docstring."""

    host_reads: int = 0
    d2h_blocking: int = 0
    d2h_async: int = 0
    h2d: int = 0
    kernels: int = 0
    event_waits: int = 0

    def row(self) -> tuple[int, ...]:
        """The numbers in the docs tables' column order."""
        return (
            self.host_reads,
            self.d2h_blocking,
            self.d2h_async,
            self.h2d,
            self.kernels,
            self.event_waits,
        )


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            yield from _tensors(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _tensors(item)


class DeviceCounter(TorchDispatchMode):
    """Counts host reads, copies and kernels on ``meta`` (module docstring), answering reads
    and device->host copies with ``value``.

    Attributes:
        kernels: the op names counted as kernels, in order (for messages).
        log: host syncs in order, ``("read", None)``, ``("to_cpu", None)`` (``_to_copy``) and
            ``("copy", value)`` (``copy_``), for tests of what comes before them.
        landing: what a device->host copy lands as, where a read answers ``value`` (None:
            ``value`` too): a read of one flag and a copy of several counters may then differ.
        landed_at: what a copy of so many elements lands as at some of its positions instead
            (`(numel, flat index): value`), e.g. a mismatch count left at 0 under counters that
            all read the step number.
        path: the log of the ``cuda_path()`` seam the counted code runs under, whose waits
            for copies to land are this counter's ``event_waits``.
    """

    def __init__(
        self, value: float = 0.0, landing: float | None = None, path: CudaPathLog | None = None
    ) -> None:
        super().__init__()
        self.value = value
        # what a device->host copy lands as (None: `value`), e.g. quiet streaks under flags
        # that read "skipped"
        self.landing = landing
        self.landed_at: dict[tuple[int, int], float] = {}
        # the seam's log, whose waits this counts (None: no event waits are counted)
        self.path = path
        self.log: list[tuple[str, object]] = []
        self.reset()

    @property
    def event_waits(self) -> int:
        """Waits for a non-blocking copy to land in this window (the seam's)."""
        return 0 if self.path is None else self.path.waits - self._waits_before

    @property
    def reads(self) -> int:
        """Host reads so far (``host_reads``)."""
        return self.host_reads

    @property
    def copies(self) -> list[bool]:
        """Device-to-host copies so far, as ``non_blocking`` flags (False: it blocks)."""
        return self.d2h

    @property
    def syncs(self) -> int:
        """What stalls the host on a GPU: reads, and copies to the CPU that block."""
        return self.host_reads + sum(not non_blocking for non_blocking in self.d2h)

    def reset(self) -> None:
        """Start a new window."""
        self.host_reads = 0
        self.d2h: list[bool] = []
        self.h2d: list[bool] = []
        self.kernels: list[str] = []
        self._waits_before = 0 if self.path is None else self.path.waits

    def counts(self) -> Counts:
        return Counts(
            host_reads=self.host_reads,
            d2h_blocking=sum(not async_ for async_ in self.d2h),
            d2h_async=sum(self.d2h),
            h2d=len(self.h2d),
            kernels=len(self.kernels),
            event_waits=self.event_waits,
        )

    def _landed(self, host: torch.Tensor) -> torch.Tensor:
        for (numel, index), value in self.landed_at.items():
            if host.numel() == numel:
                host.view(-1)[index] = value
        return host

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if func is aten._local_scalar_dense.default and args[0].device == META:
            self.host_reads += 1
            self.log.append(("read", None))
            return self.value if args[0].dtype.is_floating_point else int(self.value)
        if func is aten._to_copy.default:
            source = args[0].device
            target = torch.device(kwargs.get("device") or source)
            non_blocking = bool(kwargs.get("non_blocking", False))
            if source == META and target.type == "cpu":
                self.d2h.append(non_blocking)
                self.log.append(("to_cpu", None))
                dtype = kwargs.get("dtype") or args[0].dtype
                landed = self.value if self.landing is None else self.landing
                return self._landed(torch.full(args[0].shape, landed, dtype=dtype))
            if source.type == "cpu" and target == META:
                self.h2d.append(non_blocking)
                return func(*args, **kwargs)
        if func is aten.copy_.default:
            destination, source = args[0].device, args[1].device
            non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            if source == META and destination.type == "cpu":
                self.d2h.append(non_blocking)
                landed = self.value if self.landing is None else self.landing
                self.log.append(("copy", landed))
                return self._landed(args[0].fill_(landed))
            if source.type == "cpu" and destination == META:
                self.h2d.append(non_blocking)
                return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if name not in _NOT_KERNELS and any(
            t.device == META for t in (*_tensors(args), *_tensors(kwargs), *_tensors(out))
        ):
            self.kernels.append(name)
        return out


# ---------------------------------------------------------------- stub optimizers


class Plain(torch.optim.Optimizer):
    """What the scaler sees of a for-loop, foreach or capturable non-fused optimizer."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__(params, {"lr": 0.1})
        self.steps_taken = 0

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.steps_taken += 1


class Fused(Plain):
    """What the scaler sees of a ``fused=True`` optimizer: it takes the scale and the flag."""

    _step_supports_amp_scaling = True

    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__(params)
        self.handed: list[tuple[torch.Tensor | None, torch.Tensor | None]] = []

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.handed.append((getattr(self, "grad_scale", None), getattr(self, "found_inf", None)))
        self.steps_taken += 1


def meta_params(
    count: int = 2, dtypes: tuple[torch.dtype, ...] = (torch.float32,), cpu: int = 0
) -> list[nn.Parameter]:
    """``count`` parameters on meta, cycling through ``dtypes``, plus ``cpu`` on the CPU."""
    params = [
        nn.Parameter(torch.ones(8, 4, dtype=dtypes[i % len(dtypes)], device=META))
        for i in range(count)
    ]
    params += [nn.Parameter(torch.ones(8, 4)) for _ in range(cpu)]
    return params


# ---------------------------------------------------------------- torch.cuda stubs


class _Stream:
    def __init__(self, device: torch.device) -> None:
        self.device = device


class CudaStubs:
    """Recorders for the parts of ``torch.cuda`` that ``shardscale._state.DevicePath`` uses.

    ``log`` records, in order, ``("record", stream's device)``, ``("synchronize", None)``,
    ``("device", d)`` and ``("device exit", d)`` (entering and leaving ``torch.cuda.device``).
    """

    def __init__(self) -> None:
        self.pinned = 0
        self.records: list[torch.device | None] = []
        self.log: list[tuple[str, object]] = []
        stubs = self

        class Event:
            def record(self, stream: _Stream | None = None) -> None:
                device = None if stream is None else stream.device
                stubs.records.append(device)
                stubs.log.append(("record", device))

            def synchronize(self) -> None:
                stubs.log.append(("synchronize", None))

            def query(self) -> bool:
                return True

        self.Event = Event

    def current_device(self) -> int:
        return 0

    def current_stream(self, device: torch.device | None = None) -> _Stream:
        return _Stream(torch.device("cuda", 0) if device is None else torch.device(device))

    @contextmanager
    def device(self, device: object) -> Iterator[None]:
        self.log.append(("device", device))
        yield
        self.log.append(("device exit", device))


def install_cuda_stubs(monkeypatch: pytest.MonkeyPatch) -> CudaStubs:
    """Replace ``torch.cuda``'s events, streams, current device and device context, and make
    ``torch.empty(..., pin_memory=True)`` work on a CPU-only torch (it cannot pin)."""
    stubs = CudaStubs()
    for name in ("Event", "current_device", "current_stream", "device"):
        monkeypatch.setattr(torch.cuda, name, getattr(stubs, name))
    empty = torch.empty

    def unpinned_empty(*args: Any, pin_memory: bool | None = None, **kwargs: Any) -> torch.Tensor:
        if pin_memory:
            stubs.pinned += 1
            return empty(*args, **kwargs)
        return empty(*args, pin_memory=pin_memory, **kwargs)

    monkeypatch.setattr(torch, "empty", unpinned_empty)
    return stubs


# ---------------------------------------------------------------- cases and step drivers


@dataclass(frozen=True)
class Case:
    """One row of the docs' device-path table: a flavour and an option, or a query.

    Attributes:
        flavour: ``"plain"`` or ``"fused"``.
        options: keyword arguments of ``ShardedGradScaler``.
        unscale_first: call ``unscale_`` before anything else.
        clip: call ``clip_grad_norm_(params, 1.0)`` before ``step``.
        cpu_grads: how many CPU-resident gradients beside the meta ones.
        hook: register a stats hook.
        query: after the step, count only this (``"get_scale"``, ``"last_step_skipped"``,
            ``"state_dict"``, ``"stats"``, ``"scale"``: the next ``scale(loss)``), not the step.
    """

    flavour: str
    options: dict[str, Any] = field(default_factory=dict)
    unscale_first: bool = False
    clip: bool = False
    cpu_grads: int = 0
    hook: bool = False
    query: str | None = None


def _cases() -> dict[str, Case]:
    cases: dict[str, Case] = {}
    for flavour in ("plain", "fused"):
        options: list[tuple[str, Case]] = [
            ("`step` + `update`", Case(flavour)),
            ("`clip_grad_norm_` + `step` + `update`", Case(flavour, clip=True)),
            ("`unscale_` + `step` + `update`", Case(flavour, unscale_first=True)),
            (
                "`unscale_` + `clip_grad_norm_` + `step` + `update`",
                Case(flavour, unscale_first=True, clip=True),
            ),
            ("`hysteresis=2`", Case(flavour, {"hysteresis": 2})),
            ("`dynamic=False`", Case(flavour, {"dynamic": False})),
            ("`locate_overflow=True`", Case(flavour, {"locate_overflow": True})),
            ("`max_consecutive_skips=5`", Case(flavour, {"max_consecutive_skips": 5})),
            ("a stats hook", Case(flavour, hook=True)),
            ("`verify_every=1` (world size 1)", Case(flavour, {"verify_every": 1})),
            ('`scale_policy="fit"`', Case(flavour, {"scale_policy": "fit"})),
            ("a meter step (`underflow_every=1`)", Case(flavour, {"underflow_every": 1})),
            ("one CPU-resident gradient", Case(flavour, cpu_grads=1)),
            (
                "one CPU-resident gradient + `clip_grad_norm_`",
                Case(flavour, cpu_grads=1, clip=True),
            ),
        ]
        for label, case in options:
            cases[f"{flavour}: {label}"] = case
    cases["after a plain step: `last_step_skipped`"] = Case("plain", query="last_step_skipped")
    cases["after a fused step: `last_step_skipped`"] = Case("fused", query="last_step_skipped")
    cases["`get_scale()`"] = Case("fused", query="get_scale")
    cases["`state_dict()`"] = Case("fused", query="state_dict")
    cases["`stats`"] = Case("fused", query="stats")
    cases["`scale(loss)`"] = Case("fused", query="scale")
    return cases


CASES: dict[str, Case] = _cases()
"""Every row of the docs' device-path table (docs/guides.md), by its label."""


def measure(
    case: Case,
    *,
    params: int = 2,
    dtypes: tuple[torch.dtype, ...] = (torch.float32,),
    steps: int = 3,
    value: float = 0.0,
    path: CudaPathLog | None = None,
) -> Counts:
    """Run ``case`` for ``steps`` steps from a fresh scaler; the counts of the last step.

    Under ``shardscale.testing.cuda_path()``, so that the scaler's CUDA branches run (the
    alarms' late read after every fused step, hooks): inside the caller's (``path``, to read
    what it recorded), else a seam of its own for the call.
    """
    if path is None:
        with cuda_path() as own:
            return measure(case, params=params, dtypes=dtypes, steps=steps, value=value, path=own)
    from shardscale import ShardedGradScaler

    grads = meta_params(params, dtypes, cpu=case.cpu_grads)
    optimizer = (Fused if case.flavour == "fused" else Plain)(grads)
    scaler = ShardedGradScaler(**case.options)
    if case.hook:
        scaler.register_stats_hook(lambda stats: None)
    counter = DeviceCounter(value, path=path)
    with counter:
        for _ in range(steps):
            loss = torch.ones((), device=META)
            counter.reset()
            scaler.scale(loss)
            scaled = counter.counts()
            for p in grads:
                p.grad = torch.ones_like(p)
            counter.reset()
            _iteration(scaler, optimizer, grads, case)
        if case.query == "scale":
            return scaled
        if case.query is not None:
            counter.reset()
            _query(scaler, case.query)
    return counter.counts()


def _iteration(scaler: Any, optimizer: Plain, grads: list[nn.Parameter], case: Case) -> None:
    if case.unscale_first:
        scaler.unscale_(optimizer)
    if case.clip:
        scaler.clip_grad_norm_(grads, 1.0)
    scaler.step(optimizer)
    scaler.update()


def _query(scaler: Any, query: str) -> None:
    queries: dict[str, Callable[[], object]] = {
        "get_scale": scaler.get_scale,
        "last_step_skipped": lambda: scaler.last_step_skipped,
        "state_dict": scaler.state_dict,
        "stats": lambda: scaler.stats,
    }
    queries[query]()


def measure_torch(
    flavour: str, *, clip: bool, params: int = 2, steps: int = 3
) -> tuple[Counts, Counts]:
    """torch.amp.GradScaler on meta, in torch's order, with torch's foreach
    ``clip_grad_norm_`` when ``clip``: the counts of ``scale(loss)`` and of
    ``unscale_`` + clip + ``step`` + ``update`` (``step`` + ``update`` without clip) of the
    last step, with the same classification as ``measure``."""
    grads = meta_params(params)
    optimizer = (Fused if flavour == "fused" else Plain)(grads)
    scaler = torch.amp.GradScaler("meta")
    counter = DeviceCounter()
    with counter, _foreach_on_meta():
        for _ in range(steps):
            loss = torch.ones((), device=META)
            counter.reset()
            scaler.scale(loss)
            scaled = counter.counts()
            for p in grads:
                p.grad = torch.ones_like(p)
            counter.reset()
            if clip:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(grads, 1.0, foreach=True)
            scaler.step(optimizer)
            scaler.update()
    return scaled, counter.counts()


@contextmanager
def _foreach_on_meta() -> Iterator[None]:
    """Let torch's ``clip_grad_norm_(foreach=True)`` run on meta: it refuses devices outside
    its foreach list, though the foreach ops it then dispatches (the CUDA path's) run on meta."""
    import torch.nn.utils.clip_grad as clip_grad

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(clip_grad, "_device_has_foreach_support", lambda device: True)
        yield
