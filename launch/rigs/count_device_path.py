"""Count what one steady-state step costs on an accelerator, without one: on the ``meta`` device.

On ``meta`` a scaler takes its accelerator (``device.type != "cpu"``) branches, and every aten op
is visible to a ``TorchDispatchMode``. This script counts, for shardscale's ``ShardedGradScaler``
and ``torch.amp.GradScaler`` side by side, the third step's:

* host reads (``.item()``/``.tolist()``/``bool()`` of a device tensor: each stalls the host),
* device->host copies (blocking or not),
* device kernels: every aten op that reads or writes device data, one per call (a ``_foreach``
  op counts once); views, metadata and allocations without a fill are not kernels.

The optimizers are stubs: the scalers only see whether an optimizer takes ``grad_scale`` and
``found_inf`` (``fused=True``) or not, and the optimizer's own kernels are not the scaler's.
torch's ``clip_grad_norm_(foreach=True)`` refuses ``meta`` by its device list only; the script
lifts that check so that the foreach ops of its CUDA path are counted.

Run: ``python launch/rigs/count_device_path.py`` (prints docs/benchmarks.md's table).
Uses only the public APIs of torch and shardscale; the test suite's own counter
(tests/devicepath.py) checks these numbers and docs/benchmarks.md. On ``meta`` a CPU build of
torch has no CUDA events or pinned memory, which ours uses after a fused step (a non-blocking
copy of the alarms' streaks, waited for an update later): ``_cuda_stand_ins`` records nothing
and lets that run, so its copy is counted as on a GPU.

``--device cuda`` (``launch/rigs/gpu_check.sh``) counts the same steps on a GPU with the same rule,
host reads and copies for real, and adds the CUDA kernels and memory operations that the
profiler saw launched: what the meta count stands in for.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.utils.clip_grad as clip_grad
from torch import nn
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from shardscale import ShardedGradScaler

META = torch.device("meta")
aten = torch.ops.aten
NOT_KERNELS = {
    "view", "_unsafe_view", "_reshape_alias", "as_strided", "reshape", "select", "slice",
    "detach", "alias", "t", "transpose", "expand", "squeeze", "unsqueeze", "unbind", "permute",
    "split", "split_with_sizes", "narrow", "empty", "empty_like", "empty_strided", "new_empty",
    "new_empty_strided", "lift_fresh", "_local_scalar_dense", "is_same_size",
    "_has_compatible_shallow_copy_type",
}  # fmt: skip


def _tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [t for item in tree for t in _tensors(item)]
    if isinstance(tree, dict):
        return _tensors(list(tree.values()))
    return []


class Count(TorchDispatchMode):
    """Host reads, device->host copies and kernels on ``device``; on ``meta``, where nothing can
    be read, reads answer 0 (a clean step) and copies land as zeros."""

    def __init__(self, device: torch.device = META) -> None:
        super().__init__()
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.reads = self.copies = self.kernels = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        meta = self.device == META
        on_device = [t.device.type == self.device.type for t in _tensors(args[:2])]
        if func is aten._local_scalar_dense.default and on_device[0]:
            self.reads += 1
            if meta:
                return 0.0 if args[0].dtype.is_floating_point else 0
        elif (
            func is aten._to_copy.default
            and on_device[0]
            and torch.device(kwargs.get("device") or self.device).type == "cpu"
        ):
            self.copies += 1
            if meta:
                return torch.zeros(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype)
        elif func is aten.copy_.default and on_device[1] and not on_device[0]:
            self.copies += 1
            if meta:
                return args[0].zero_()
        out = func(*args, **kwargs)
        if func.overloadpacket.__name__ not in NOT_KERNELS and any(
            t.device.type == self.device.type for t in _tensors([args, kwargs, out])
        ):
            self.kernels += 1
        return out


class Plain(torch.optim.Optimizer):
    """What a scaler sees of a for-loop/foreach optimizer."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__(params, {"lr": 0.1})

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        return None


class Fused(Plain):
    """What a scaler sees of a ``fused=True`` optimizer."""

    _step_supports_amp_scaling = True


class _Event:
    def record(self, stream: object = None) -> None:
        return None

    def synchronize(self) -> None:
        return None


@contextlib.contextmanager
def _cuda_stand_ins() -> Iterator[None]:
    """On a CPU build: CUDA events and streams that do nothing, and ``pin_memory`` ignored."""
    empty = torch.empty
    saved = {name: getattr(torch.cuda, name) for name in ("Event", "current_stream", "device")}
    torch.cuda.Event = _Event  # type: ignore[misc, assignment]
    torch.cuda.current_stream = lambda device=None: None  # type: ignore[assignment]
    torch.cuda.device = lambda device: contextlib.nullcontext()  # type: ignore[assignment, misc]
    torch.empty = lambda *args, pin_memory=False, **kwargs: empty(*args, **kwargs)  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.empty = empty  # type: ignore[assignment]
        for name, value in saved.items():
            setattr(torch.cuda, name, value)


def count(
    scaler_name: str, flavour: str, clip: bool, steps: int = 3, device: torch.device = META
) -> tuple[int, ...]:
    """(host reads, device->host copies, kernels) of the last of ``steps`` steps; on a CUDA
    device, with the CUDA kernels and memory operations the profiler saw launched."""
    params = [nn.Parameter(torch.ones(8, 4, device=device)) for _ in range(2)]
    optimizer = (Fused if flavour == "fused" else Plain)(params)
    ours = scaler_name == "shardscale"
    scaler = ShardedGradScaler() if ours else torch.amp.GradScaler(device.type)
    counter = Count(device)
    cuda = device.type == "cuda"
    profiler = profile(activities=[ProfilerActivity.CUDA]) if cuda else None
    original = clip_grad._device_has_foreach_support  # type: ignore[attr-defined]
    clip_grad._device_has_foreach_support = lambda device: True  # type: ignore[attr-defined]
    stand_ins = _cuda_stand_ins() if device == META else contextlib.nullcontext()
    try:
        with counter, stand_ins:
            for step in range(steps):
                scaler.scale(torch.ones((), device=device))
                for p in params:
                    p.grad = torch.ones_like(p)
                counter.reset()
                if profiler is not None and step == steps - 1:
                    torch.cuda.synchronize()
                    profiler.start()
                if clip and ours:
                    scaler.clip_grad_norm_(params, 1.0)  # type: ignore[attr-defined]
                elif clip:
                    scaler.unscale_(optimizer)
                    torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
                scaler.step(optimizer)
                scaler.update()
    finally:
        clip_grad._device_has_foreach_support = original  # type: ignore[attr-defined]
    if profiler is None:
        return counter.reads, counter.copies, counter.kernels
    torch.cuda.synchronize()
    profiler.stop()
    launched = [e for e in profiler.events() if e.device_type == DeviceType.CUDA]
    return counter.reads, counter.copies, counter.kernels, len(launched)


def rows(device: torch.device = META) -> list[tuple[Any, ...]]:
    """The table's rows: (scaler, pattern, host reads, device->host copies, kernels[, CUDA
    launches])."""
    table = []
    for flavour in ("plain", "fused"):
        for clip in (False, True):
            pattern = f"{flavour}, " + ("with clipping" if clip else "`step` + `update`")
            for scaler in ("shardscale", "torch.amp.GradScaler"):
                table.append((scaler, pattern, *count(scaler, flavour, clip, device=device)))
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="meta", help="meta (the default) or cuda")
    device = torch.device(parser.parse_args().device)
    header = "| scaler | pattern | host reads | device→host copies | kernels |"
    if device.type == "cuda":
        header += " CUDA kernels + memory ops launched |"
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    for row in rows(device):
        print("| " + " | ".join(str(cell) for cell in row) + " |")


if __name__ == "__main__":
    main()
