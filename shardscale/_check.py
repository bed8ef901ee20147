"""The local check: one fused pass over each (device, dtype) group, one found_inf flag per device.

The kernel is torch's ``_amp_foreach_non_finite_check_and_unscale_``: it multiplies by
``inv_scale`` and raises the flag in the same pass. Measured on CPU (docs/benchmarks.md), it costs
the same as a bare ``_foreach_mul_`` and beats every read-only alternative we tried
(``isfinite().all()`` and ``_foreach_norm(inf)`` ~12x slower, ``aminmax`` 1.3-3x), so the
check-only path of fused optimizers uses it too, with ``inv_scale`` 1.
"""

from __future__ import annotations

import torch

from shardscale._devices import move
from shardscale._grads import GradGroups

__all__ = ["check_and_unscale_"]


def check_and_unscale_(groups: GradGroups, inv_scale: torch.Tensor | None) -> list[torch.Tensor]:
    """Multiply every gradient by ``inv_scale`` (if given) and flag the devices with inf/NaN.

    Args:
        groups: local gradient tensors by (device, dtype), from ``collect_local_grads``.
        inv_scale: float32 scalar tensor, or None to check without unscaling.

    Returns:
        One float32 scalar flag per device holding gradients: 1.0 where any element was
        non-finite, else 0.0. The flags are new tensors, the caller's to modify.
    """
    flags: dict[torch.device, torch.Tensor] = {}
    factors: dict[torch.device, torch.Tensor] = {}
    for (device, _dtype), grads in groups.items():
        if device not in flags:
            flags[device] = torch.zeros((), dtype=torch.float32, device=device)
            factors[device] = (
                torch.ones((), dtype=torch.float32, device=device)
                if inv_scale is None
                else move(inv_scale, device)
            )
        torch._amp_foreach_non_finite_check_and_unscale_(grads, flags[device], factors[device])
    return list(flags.values())
