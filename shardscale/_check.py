"""The local check: one fused pass over each (device, dtype) group, one found_inf flag per device.

The kernel is torch's `_amp_foreach_non_finite_check_and_unscale_`: it multiplies by
`inv_scale` and raises the flag in the same pass. Measured on CPU (docs/benchmarks.md), it costs
about a bare `_foreach_mul_` in fp16 and up to ~1.5x one in fp32, and beats every read-only
alternative we tried (`isfinite().all()` and `_foreach_norm(inf)` ~12x slower, `aminmax`
1.3-3x), so the check-only path of fused optimizers uses it too, with `inv_scale` 1.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from shardscale._devices import move
from shardscale._walk import GradGroups

__all__ = ["Flags", "check_and_unscale_", "combined", "inverse", "multiply_", "ones"]

Flags = dict[torch.device, torch.Tensor]
"""One float32 scalar per device holding gradients: 1.0 where any element was non-finite."""


def check_and_unscale_(
    groups: GradGroups, inv_scale: torch.Tensor | None, flags: Flags | None = None
) -> Flags:
    """Multiply every gradient by `inv_scale` (if given) and flag the devices with inf/NaN.

    Args:
        groups: local gradient tensors by (device, dtype), from a `GradWalk`.
        inv_scale: float32 scalar tensor, or None to check without unscaling.
        flags: flags to raise (the kernel only ever sets them to 1.0), so that several calls
            (gradients to unscale, gradients only to check) end with one flag per device. New
            zero flags when None.

    Returns:
        `flags`, with an entry for every device in `groups`; new tensors are the caller's.
    """
    flags = {} if flags is None else flags
    for (device, _dtype), grads in groups.items():
        if device not in flags:
            flags[device] = torch.zeros((), dtype=torch.float32, device=device)
        factor = ones(device) if inv_scale is None else move(inv_scale, device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, flags[device], factor)
    return flags


def multiply_(groups: GradGroups, factor: torch.Tensor) -> None:
    """Multiply every gradient in `groups` by the float32 scalar `factor`, in place.

    With the check kernel, not `_foreach_mul_`: on CUDA `_foreach_mul_` takes its per-tensor
    slow path when the factor's dtype differs from the gradients' (a float32 factor on fp16 or
    bf16 gradients: one launch per tensor), while the check kernel takes a float32 factor for
    every gradient dtype in one launch, and multiplies in the same precision (float32 for
    fp16/bf16, as `mul_` does). Its flag is a scratch one nobody reads.
    """
    factors: dict[torch.device, torch.Tensor] = {}
    for (device, _dtype), grads in groups.items():
        if device not in factors:  # one copy per device (blocking to the CPU)
            factors[device] = move(factor, device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, _scratch(device), factors[device])


def inverse(scale: torch.Tensor) -> torch.Tensor:
    """1/scale in float32, taken in float64 as torch's scalers do (bit for bit with them).

    One kernel: the division runs in float64 (the one operand is float64) and is rounded once
    to float32 as it is stored, exactly `scale.double().reciprocal().float()`.
    """
    out = torch.empty((), dtype=torch.float32, device=scale.device)
    return torch.div(_one64(scale.device), scale, out=out)


@functools.cache
def ones(device: torch.device) -> torch.Tensor:
    """A float32 one on `device`, made once per device: for a kernel that wants a factor but
    has nothing to multiply by (the check-only pass, a clip of unscaled gradients, the clip
    factor's ceiling). Never modify it."""
    return torch.ones((), dtype=torch.float32, device=device)


@functools.cache
def _one64(device: torch.device) -> torch.Tensor:
    """A float64 one on `device`, made once (`inverse` divides it)."""
    return torch.ones((), dtype=torch.float64, device=device)


@functools.cache
def _scratch(device: torch.device) -> torch.Tensor:
    """A float32 flag on `device` that `multiply_`'s kernel may raise and nobody reads."""
    return torch.zeros((), dtype=torch.float32, device=device)


def combined(found_infs: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """The largest of agreed flags: itself when they are one tensor (the usual case).

    The one place flags are combined (several optimizers, iterations, leaves of a container).
    """
    distinct = list({id(f): f for f in found_infs if f is not None}.values())
    if len(distinct) == 1:
        return distinct[0]
    return torch.stack([move(f, distinct[0].device) for f in distinct]).amax()
