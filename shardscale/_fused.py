"""Handing fused optimizers the scale and the agreed flag, on their parameters' device.

torch's fused (and capturable, amp-aware) optimizers read `grad_scale` and `found_inf` themselves:
they unscale inside their own kernel and skip on the device when `found_inf` is 1.0, so the
step costs no host synchronisation. The scaler sets both attributes for the duration of the
step only, and places them where each optimizer's kernel reads them.

Invariant: a fused optimizer never reads a scale or a flag that has not landed (no
non-blocking copy to the CPU), and never a flag other than the group's agreed one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shardscale._devices import move
from shardscale._iteration import OptimizerRecord, Stage
from shardscale._optimizers import Steppable, optimizer_params, takes_scale

__all__ = ["step_on_device"]


def step_on_device(
    item: Steppable,
    records: list[OptimizerRecord],
    found_inf: torch.Tensor,
    scale: torch.Tensor,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    settle: Callable[[], None],
) -> Any:
    """Step `item`, handing every fused optimizer in it the scale and the agreed flag.

    A fused optimizer whose gradients are still scaled gets `grad_scale` (times its own, if the
    user set one); one already unscaled (`unscale_`, `clip_grad_norm_`) gets only its own. It
    then skips on the device if `found_inf` is 1.0.

    Each gets both tensors on its own parameters' device (see `_params_device`). torch's fused
    Adam/AdamW/Adagrad move them there with `non_blocking=True`, which from a GPU to the CPU
    returns before the copy lands, and their CPU kernel reads the values at once (a stale scale,
    a missed skip: inf in CPU-offloaded master weights). So the copy to the CPU is made here,
    blocking: one device-to-host copy per step and CPU device, the price of a CPU kernel that
    needs a device value. Where the tensors are already on the parameters' device: no copy.
    `settle` (the agreement's) runs before a copy to the CPU, which reads the agreed flag and
    must not wait unbounded for a collective still in flight.
    """
    handed = []
    moved: dict[tuple[torch.device, int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
    for leaf, record in zip(item.leaves, records, strict=True):
        if not takes_scale(leaf):
            continue
        user_grad_scale = getattr(leaf, "grad_scale", None)
        if record.stage is Stage.READY:  # still scaled
            grad_scale = scale if user_grad_scale is None else scale * user_grad_scale
        else:
            grad_scale = user_grad_scale
        device = _params_device(leaf)
        if device is not None:
            key = (device, id(grad_scale), id(found_inf))
            if key not in moved:
                if device.type == "cpu" and found_inf.device.type != "cpu":
                    settle()
                moved[key] = _to_device(grad_scale, found_inf, device)
            grad_scale, leaf_found_inf = moved[key]
        else:
            leaf_found_inf = found_inf
        leaf.grad_scale = grad_scale  # type: ignore[attr-defined]
        leaf.found_inf = leaf_found_inf  # type: ignore[attr-defined]
        handed.append(leaf)
    try:
        return item.target.step(*args, **kwargs)
    finally:
        for leaf in handed:
            del leaf.grad_scale  # type: ignore[attr-defined]
            del leaf.found_inf  # type: ignore[attr-defined]


def _params_device(optimizer: torch.optim.Optimizer) -> torch.device | None:
    """The one device `optimizer`'s parameters live on; None if they span several (or none).

    Over several devices torch's fused optimizers group the parameters per device and move
    `grad_scale`/`found_inf` to each themselves: the tensors are then handed where the scale
    is, and a CPU group among them keeps torch's own (racy) non-blocking copy. Keep the
    parameters of a fused optimizer on one device.
    """
    devices = {p.device for p in optimizer_params(optimizer)}
    return devices.pop() if len(devices) == 1 else None


def _to_device(
    grad_scale: torch.Tensor | None, found_inf: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """`grad_scale` and `found_inf` on `device`: themselves when there, else ONE copy.

    Both travel as one stacked tensor (one blocking copy to the CPU, not two), unstacked as views.
    """
    tensors = [t for t in (grad_scale, found_inf) if t is not None]
    if all(t.device == device for t in tensors):
        return grad_scale, found_inf
    if grad_scale is None or grad_scale.dtype != found_inf.dtype or grad_scale.shape != ():
        return (None if grad_scale is None else move(grad_scale, device)), move(found_inf, device)
    both = move(torch.stack((grad_scale, found_inf.reshape(()))), device)
    return both[0], both[1].reshape(found_inf.shape)
