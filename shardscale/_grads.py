"""What a gradient is, whatever wraps it, and how a step walks many of them: the one place that
knows the gradient kinds.

Whatever the parallelism, the gradient an optimizer sees is one of:

* a plain tensor: single process, DDP, pipeline stages, FSDP1's `use_orig_params` views;
* an FSDP1 flat parameter's gradient: one flat shard holding slices of many original
  parameters (`original_slices` cuts it back);
* a DTensor (FSDP2, HSDP, tensor and expert parallel): we take its local shard and never rely on
  DTensor's own reductions, and read its layout from its public `device_mesh` and `placements`;
* a sparse tensor: we use its coalesced values.

Two questions are answered here and nowhere else: which elements this rank holds
(`local_grad`, `local_grads`), and which original parameter an element belongs to
(`original_slices`, for naming overflows). A third, how many ranks hold the same elements (for a
global norm that counts every element once), only a clip asks: `shardscale._clip` answers it.

The tensors returned alias the gradients: unscaling them in place unscales the gradients, with no
copy. The one exception is an uncoalesced sparse gradient, which is replaced by its coalesced form
(as torch's scalers do), because duplicate indices are summed only then, and that sum can overflow.

A step groups its gradients afresh ([`grad_groups`][]): by (device, dtype), one fused kernel
call per group, each gradient taken as it is (FSDP2's padding between shards is never read).
Nothing is kept by gradient identity: the default loop hands new gradient tensors every step. A
layout kept while the gradients stayed the same objects, with flat buffers where FSDP2's shards
tile their reduce-scatter buffer, was measured and removed: on the default loop it paid only for
`clip_grad_norm_` over hundreds of small tensors (docs/benchmarks.md).

The kernels a step runs over its groups (check-and-unscale, the multiply) are here too, in
[`Kernels`][], beside the groups they take: `shardscale._check` decides which gradients go
through which, and agrees with every rank on the flags they raise (a clip's norms are
`shardscale._clip`'s).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Iterator
from typing import Any, cast

import torch
from torch.distributed.tensor import DTensor

from shardscale._torch import (
    check_and_unscale_,
    flat_param_slices,
    foreach_mul_,
    group_by_device_and_dtype,
    is_flat_param,
    local_tensor,
    no_torch_function_subclass,
    sparse_values,
)

# Local gradient tensors keyed by (device, dtype): one fused kernel call per key.
GradGroups = dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]
# Local gradients by (device, dtype, replica count): one norm and one weight per key (a clip's:
# `shardscale._clip`).
NormGroups = dict[tuple[torch.device, torch.dtype, int], list[torch.Tensor]]

_HALF_DTYPES = (torch.float16, torch.bfloat16)
_GRAD = operator.attrgetter("grad")
_FLAT_PARAM = "_flat_param"


def move(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`: itself if already there, else a copy, asynchronous only to an
    accelerator (the host must never read a CPU copy before it lands)."""
    return tensor.to(device, non_blocking=device.type != "cpu")


def local_grads(params: tuple[torch.Tensor, ...]) -> tuple[list[torch.Tensor], list[int], bool]:
    """The local gradients of `params` that exist, their positions in `params`, and whether any
    exists (an empty shard's counts, as torch records an inf check for any gradient it holds).

    An uncoalesced sparse gradient is coalesced in place on its parameter first (half precision
    sums through fp32; see the module docstring); `local_grad` reads one without touching it.

    Raises:
        TypeError: a gradient is not floating point (it cannot hold an inf or a NaN).
    """
    # Reading .grad on a DTensor parameter goes through __torch_function__ (~0.25 us); with it
    # disabled, 0.1 us, as on a plain tensor. This runs per parameter per step.
    with no_torch_function_subclass():
        grads: list[torch.Tensor | None] = list(map(_GRAD, params))
    present, positions = [], []
    for position, grad in enumerate(grads):
        if grad is None:
            continue
        if isinstance(grad, DTensor):
            grad = local_tensor(grad)
        if not grad.is_floating_point():
            raise TypeError(
                f"gradients must be floating point to be checked for inf/NaN, got {grad.dtype}"
            )
        if grad.is_sparse:
            if not grad.is_coalesced():
                half = grad.dtype in _HALF_DTYPES
                coalesced = (grad.float() if half else grad).coalesce().to(grad.dtype)
                params[position].grad = grad = coalesced
            grad = sparse_values(grad)
        present.append(grad)
        positions.append(position)
    return present, positions, bool(present)


def local_grad(grad: torch.Tensor) -> torch.Tensor:
    """The gradient elements this rank holds, for reading (norms, locating overflows).

    A DTensor's local shard; a sparse gradient's coalesced values (coalesced into a copy if it
    is not yet: duplicates sum only then, and that sum is what may overflow); else `grad`.
    """
    if isinstance(grad, DTensor):
        grad = local_tensor(grad)
    if grad.is_sparse:
        grad = sparse_values(grad if grad.is_coalesced() else grad.coalesce())
    return grad


def original_slices(name: str, param: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """`(name, local gradient elements)` per original parameter held in `param`'s gradient.

    One pair for most parameters; an FSDP1 flat parameter yields the slice of each original
    parameter that lies in this rank's shard, cut by the offsets FSDP records, named
    `<module prefix>.<original name>`. Nothing when `param` has no gradient.
    """
    grad = param.grad
    if grad is None:
        return
    local = local_grad(grad)
    if not is_flat_param(param):
        yield name, local
        return
    prefix = name[: -len(_FLAT_PARAM)] if name.endswith(_FLAT_PARAM) else f"{name}."
    flat = local.reshape(-1)
    for fqn, start, numel in flat_param_slices(param):
        yield prefix + fqn, flat[start : start + numel]


def grad_groups(params: Iterable[torch.Tensor]) -> tuple[GradGroups, bool]:
    """`params`' local gradients by (device, dtype): one fused kernel call per group; and
    whether any exists. Grouped afresh at every call (module docstring).

    Raises:
        TypeError: a gradient is not floating point.
    """
    grads, _positions, held = local_grads(tuple(params))
    groups: GradGroups = {}
    if grads:
        for key, (tensor_lists, _indices) in group_by_device_and_dtype([cast(Any, grads)]).items():
            groups[key] = cast(list[torch.Tensor], tensor_lists[0])
    return groups, held


# ------------------------------------------------------------------ the kernels over the groups

Groups = GradGroups | NormGroups
# One float32 scalar per device holding gradients: 1.0 where any element was non-finite.
Flags = dict[torch.device, torch.Tensor]


class Kernels:
    """A scaler's kernels over its gradient groups, and the constants they take.

    Unscaling and checking are one fused pass per (device, dtype) group, torch's
    `_amp_foreach_non_finite_check_and_unscale_`: it multiplies by `inv_scale` and raises a flag in
    the same pass. Measured on CPU (docs/benchmarks.md), it costs about a bare `_foreach_mul_` in
    fp16 and up to ~1.5x one in fp32 (it tests element by element there). The check-only pass of
    fused optimizers uses it too, with a factor of 1, except over large CPU tensors (64Ki elements
    and more), which it reads by their sums: a float sum is finite only where every element is, and
    the sums take about two thirds of the kernel's time there (`isfinite().all()` and
    `_foreach_norm(inf)` take ~12x a multiply, `aminmax` 1.3-3x). A non-finite sum (an overflow, or
    finite elements summing past float32's range) is checked again by the kernel, so the flag is
    exact. Per tensor, a sum costs a few us more than the kernel's share: small tensors stay with
    the kernel.

    The small constants the kernels need (a float32 one, a float64 one, a scratch flag) are made
    once per device and kept here, one `Kernels` per scaler, never shared between scalers.
    """

    def __init__(self) -> None:
        self._ones: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self._scratch: Flags = {}

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
