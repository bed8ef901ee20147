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

Run: ``python launch/bench/count_device_path.py`` (prints docs/benchmarks.md's table).
Uses only the public APIs of torch and shardscale; the test suite's own counter
(tests/devicepath.py) checks these numbers and docs/benchmarks.md.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.utils.clip_grad as clip_grad
from torch import nn
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
    """Host reads, device->host copies and kernels on ``meta``; reads answer 0 (a clean step)."""

    def __init__(self) -> None:
        super().__init__()
        self.reset()

    def reset(self) -> None:
        self.reads = self.copies = self.kernels = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is aten._local_scalar_dense.default and args[0].device == META:
            self.reads += 1
            return 0.0 if args[0].dtype.is_floating_point else 0
        if (
            func is aten._to_copy.default
            and args[0].device == META
            and torch.device(kwargs.get("device") or META).type == "cpu"
        ):
            self.copies += 1
            return torch.zeros(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype)
        if func is aten.copy_.default and args[1].device == META and args[0].device != META:
            self.copies += 1
            return args[0].zero_()
        out = func(*args, **kwargs)
        if func.overloadpacket.__name__ not in NOT_KERNELS and any(
            t.device == META for t in _tensors([args, kwargs, out])
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


def count(scaler_name: str, flavour: str, clip: bool, steps: int = 3) -> tuple[int, int, int]:
    """(host reads, device->host copies, kernels) of the last of ``steps`` steps."""
    params = [nn.Parameter(torch.ones(8, 4, device=META)) for _ in range(2)]
    optimizer = (Fused if flavour == "fused" else Plain)(params)
    ours = scaler_name == "shardscale"
    scaler = ShardedGradScaler() if ours else torch.amp.GradScaler("meta")
    counter = Count()
    original = clip_grad._device_has_foreach_support  # type: ignore[attr-defined]
    clip_grad._device_has_foreach_support = lambda device: True  # type: ignore[attr-defined]
    try:
        with counter:
            for _ in range(steps):
                scaler.scale(torch.ones((), device=META))
                for p in params:
                    p.grad = torch.ones_like(p)
                counter.reset()
                if clip and ours:
                    scaler.clip_grad_norm_(params, 1.0)  # type: ignore[attr-defined]
                elif clip:
                    scaler.unscale_(optimizer)
                    torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
                scaler.step(optimizer)
                scaler.update()
    finally:
        clip_grad._device_has_foreach_support = original  # type: ignore[attr-defined]
    return counter.reads, counter.copies, counter.kernels


def rows() -> list[tuple[str, str, int, int, int]]:
    """The table's rows: (scaler, pattern, host reads, device->host copies, kernels)."""
    table = []
    for flavour in ("plain", "fused"):
        for clip in (False, True):
            pattern = f"{flavour}, " + ("with clipping" if clip else "`step` + `update`")
            for scaler in ("shardscale", "torch.amp.GradScaler"):
                table.append((scaler, pattern, *count(scaler, flavour, clip)))
    return table


def main() -> None:
    print("| scaler | pattern | host reads | device→host copies | kernels |")
    print("|---|---|---|---|---|")
    for row in rows():
        print("| " + " | ".join(str(cell) for cell in row) + " |")


if __name__ == "__main__":
    main()
