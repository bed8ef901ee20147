"""The check: the few kernels a step runs over the gradients, whatever their layout.

Unscaling and checking are one fused pass per (device, dtype) group, torch's
`_amp_foreach_non_finite_check_and_unscale_`: it multiplies by `inv_scale` and raises a flag in
the same pass. Measured on CPU (docs/benchmarks.md), it costs about a bare `_foreach_mul_` in fp16
and up to ~1.5x one in fp32 (it tests element by element there). The check-only pass of fused
optimizers uses it too, with a factor of 1, except over large CPU tensors (64Ki elements and
more), which it reads by their sums: a float sum is finite only where every element is, and
the sums take about two thirds of the kernel's time there (`isfinite().all()` and
`_foreach_norm(inf)` take ~12x a multiply, `aminmax` 1.3-3x). A non-finite sum (an overflow,
or finite elements summing past float32's range) is checked again by the kernel, so the flag is
exact. Per tensor, a sum costs a few us more than the kernel's share: small tensors stay with
the kernel.

Clipping to a global norm takes two passes, whatever the layout:

1. read: the per-tensor norms of the still-scaled gradients, unscaled and reduced to this rank's
   share `sum |g|^p / r`, `r` being how many ranks hold those same elements (so the sum over the
   group counts every element once; the inf-norm needs no weights, its reduction is a max).
   A non-finite element makes its tensor's norm non-finite, so this pass is also the overflow
   check (for p <= 2 and the inf-norm; a larger p takes one extra check pass). Scaled fp32
   gradients can be large enough that their squares overflow float32, so a finite gradient
   must never be taken for an overflow: on the CPU, where some norm comes out non-finite, the
   norms are taken again in float64 (deciding that is a host read, free there; float64 norms
   cost 8x there; a group tiling one buffer is one tensor there, `GradWalk.groups`), on an
   accelerator every norm accumulates in float64 (a memory-bound pass either way).
2. read+write: multiply by `inv_scale * min(1, max_norm / (total + 1e-6))`, after the agreement.

The small constants the kernels need (a float32 one, a float64 one, a scratch flag, `max_norm`)
are made once per device and kept by the scaler's [`Kernels`][], never shared between scalers.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch

from shardscale._grads import GradGroups, NormGroups, move
from shardscale._torch import check_and_unscale_, foreach_mul_, foreach_norm

Groups = GradGroups | NormGroups
# One float32 scalar per device holding gradients: 1.0 where any element was non-finite.
Flags = dict[torch.device, torch.Tensor]

_CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s
_DTYPE = operator.itemgetter(1)


def check_clip_args(max_norm: float, norm_type: float) -> tuple[float, float]:
    """Validate `max_norm` (finite, > 0) and `norm_type` (> 0, or inf)."""
    for name, value in (("max_norm", max_norm), ("norm_type", norm_type)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a number, got {type(value).__name__}: {value!r}")
    if not (math.isfinite(max_norm) and max_norm > 0):
        raise ValueError(f"max_norm must be a finite number > 0, got {max_norm}")
    if not (norm_type > 0 and not math.isnan(norm_type)):
        raise ValueError(f"norm_type must be > 0 (or math.inf), got {norm_type}")
    return float(max_norm), float(norm_type)


def exact_norm_check(groups: NormGroups, norm_type: float) -> bool:
    """Whether a non-finite norm means a non-finite element, and nothing else.

    True for `p <= 2` and the inf-norm over gradients of at most float32 range: their float64
    sums cannot overflow. Otherwise the caller checks the elements in an extra pass.
    """
    small_p = norm_type <= 2.0 or math.isinf(norm_type)
    return small_p and torch.float64 not in map(_DTYPE, groups)


class Kernels:
    """A scaler's kernels over its gradient groups, and the constants they take."""

    def __init__(self) -> None:
        self._ones: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self._scratch: Flags = {}
        self._max_norm: dict[torch.device, tuple[float, torch.Tensor]] = {}

    def one(self, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A one on `device`, made once: for a kernel that wants a factor but has nothing to
        multiply by (the check-only pass, a clip of unscaled gradients). Never modify it."""
        one = self._ones.get((device, dtype))
        if one is None:
            one = self._ones[(device, dtype)] = torch.ones((), dtype=dtype, device=device)
        return one

    def inverse(self, scale: torch.Tensor) -> torch.Tensor:
        """1/scale in float32, taken in float64 as torch's scalers do (bit for bit with them).

        One kernel: the division runs in float64 (the one operand is float64) and is rounded once
        to float32 as it is stored, exactly `scale.double().reciprocal().float()`.
        """
        out = torch.empty((), dtype=torch.float32, device=scale.device)
        return torch.div(self.one(scale.device, torch.float64), scale, out=out)

    def check_(self, groups: Groups, inv_scale: torch.Tensor | None, flags: Flags) -> Flags:
        """Multiply every gradient by `inv_scale` (if given) and flag the devices with inf/NaN.

        `flags` are raised (the kernel only ever sets them to 1.0), so that several calls end
        with one flag per device; a device without one gets a new zero flag. `inv_scale` is
        copied once per device (a blocking copy to the CPU).
        """
        factors: dict[torch.device, torch.Tensor] = {}
        for key, grads in groups.items():
            device = key[0]  # (device, dtype), or (device, dtype, replica count)
            if device not in flags:
                flags[device] = torch.zeros((), dtype=torch.float32, device=device)
            if device not in factors:
                factors[device] = self.one(device) if inv_scale is None else move(inv_scale, device)
            if inv_scale is None and device.type == "cpu" and grads[0].numel() >= 1 << 16:
                # A check only, of large CPU tensors: read, not rewrite. A sum is finite only
                # where every element is; one that is not is checked again, exactly.
                if not math.isfinite(sum(g.sum(dtype=torch.float32).item() for g in grads)):
                    check_and_unscale_(grads, flags[device], factors[device])
            else:
                check_and_unscale_(grads, flags[device], factors[device])
        return flags

    def multiply_(self, groups: Groups, factor: torch.Tensor) -> None:
        """Multiply every gradient in `groups` by the float32 scalar `factor`, in place.

        On an accelerator with the check kernel, not `_foreach_mul_`: on CUDA `_foreach_mul_`
        takes its per-tensor slow path when the factor's dtype differs from the gradients' (a
        float32 factor on fp16 or bf16 gradients: one launch per tensor), while the check kernel
        takes a float32 factor for every gradient dtype in one launch, and multiplies in the
        same precision (float32 for fp16/bf16, as `mul_` does). Its flags are scratch ones
        nobody reads.

        On the CPU with `_foreach_mul_`: there the check kernel tests element by element, up to
        1.45x the time of the vectorised multiply in fp32 (docs/benchmarks.md), and `mul_` takes
        a 0-dim CPU factor in float32 for fp16/bf16 too, never rounding it to their dtype.
        """
        on_accelerators: dict[Any, list[torch.Tensor]] = {}
        on_cpu = None  # the factor, copied to the CPU once
        for key, grads in groups.items():
            if key[0].type != "cpu":
                on_accelerators[key] = grads
                continue
            on_cpu = move(factor, key[0]) if on_cpu is None else on_cpu
            foreach_mul_(grads, on_cpu)
        if on_accelerators:
            self.check_(on_accelerators, factor, self._scratch)

    def local_norms_(
        self,
        groups: NormGroups,
        norm_type: float,
        inv_scale: torch.Tensor,
        flags: Flags,
        out: torch.Tensor,
    ) -> None:
        """Pass 1 (read only): this rank's share of the unscaled global norm, into `out` (the
        ballot's float32 slot), and the check.

        The per-tensor norms of every group with the same replica count are moved to `out`'s
        device (a non-blocking copy from the CPU: CPU-offloaded gradients cost no device-to-host
        copy here), stacked in one kernel, then unscaled and checked in one more (the check
        kernel, which raises `flags[device]` where a norm is non-finite: pass the ballot's flags
        where [`exact_norm_check()`][exact_norm_check] holds), then reduced in one, straight into
        `out` (more for p other than 1, 2 and inf, or several replica counts). So the kernels per
        step grow with the number of groups, never with the number of tensors.

        The share is `sum |g * inv_scale|_p^p / r` (the max for the inf-norm), zero without
        gradient elements, non-finite where a norm was.
        """
        device = out.device
        if device not in flags:
            flags[device] = torch.zeros((), dtype=torch.float32, device=device)
        pieces: dict[int, list[torch.Tensor]] = {}
        for (_device, _dtype, replicas), grads in groups.items():
            pieces.setdefault(replicas, []).append(move(_norms(grads, norm_type), device))
        reduce = torch.amax if math.isinf(norm_type) else torch.sum
        share: torch.Tensor | None = None
        for replicas, parts in pieces.items():
            size = sum(map(torch.Tensor.numel, parts))
            norms = torch.cat(parts, out=torch.empty(size, dtype=torch.float32, device=device))
            check_and_unscale_([norms], flags[device], move(inv_scale, device))
            direct = len(pieces) == 1 and (replicas == 1 or math.isinf(norm_type))
            if norm_type == 2.0:  # the common case in one kernel: a dot product
                part = torch.dot(norms, norms, out=out) if direct else torch.dot(norms, norms)
            elif norm_type == 1.0 or math.isinf(norm_type):
                part = reduce(norms, 0, out=out) if direct else reduce(norms, 0)
            else:
                part = norms.pow(norm_type).sum()
            if replicas != 1 and not math.isinf(norm_type):  # a max: replicas need no weight
                part = part / replicas
            if share is not None:
                part = torch.maximum(share, part) if math.isinf(norm_type) else share + part
            share = part
        if share is None:
            out.zero_()
        elif share is not out:
            out.copy_(share)

    def clip_(
        self,
        groups: NormGroups,
        max_norm: float,
        total_norm: torch.Tensor,
        inv_scale: torch.Tensor | None,
        found_inf: torch.Tensor,
    ) -> None:
        """Pass 2: multiply every gradient by `inv_scale * min(1, max_norm / (total + 1e-6))`.

        On the device, without a host synchronisation, in five scalar kernels and one per group.
        On an overflow (`found_inf` 1.0: the step will be skipped) it only unscales, where torch
        would turn the gradients to NaN, so that what overflowed can still be seen. A norm that
        is non-finite without an overflow (p-th powers beyond float32's range, p > 2) clips to
        zero, as torch does.
        """
        device = total_norm.device
        known = self._max_norm.get(device)
        if known is None or known[0] != max_norm:
            full = torch.full((), max_norm, dtype=torch.float32, device=device)
            known = self._max_norm[device] = (max_norm, full)
        coef = torch.div(known[1], total_norm + _CLIP_EPS)
        # fmin/fmax ignore a NaN (a NaN norm: an overflow), so an overflow gives exactly 1.
        factor = torch.fmax(torch.fmin(coef, self.one(device)), found_inf)
        if inv_scale is not None:
            factor = factor * move(inv_scale, device)
        self.multiply_(groups, factor)


def _norms(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """Per-tensor p-norms, taken in float64 where their p-th powers need it, never overflowing
    for finite elements (module docstring).

    On an accelerator one 1-D float64 tensor: one `_foreach_norm`, stacked in one kernel (a
    launch per ~128 norms on CUDA; concatenated into float32 with the other groups' instead, each
    norm took a launch of its own, as the first GPU run counted: 428 for 400 tensors). On the CPU
    one 1-D float32 tensor.
    """
    if math.isinf(norm_type):  # an empty shard's inf-norm raises; its every p-norm is 0
        device, grads = grads[0].device, [grad for grad in grads if grad.numel()]
        if not grads:  # this rank still joins the collective, with a share of 0
            return torch.zeros(1, dtype=torch.float32, device=device)
    if grads[0].device.type != "cpu":
        return torch.stack(foreach_norm(grads, norm_type, dtype=torch.float64))
    norms = torch.stack(foreach_norm(grads, norm_type, dtype=torch.float32))
    if math.isinf(norm_type) or bool(norms.isfinite().all()):  # a host read: free on the CPU
        return norms
    # a norm (not its p-th power) of finite elements fits float32
    return torch.stack(foreach_norm(grads, norm_type, dtype=torch.float64)).float()
