"""What a gradient is, whatever wraps it, and how a step walks many of them: the one place that
knows the gradient kinds.

Whatever the parallelism, the gradient an optimizer sees is one of:

* a plain tensor: single process, DDP, pipeline stages, FSDP1's `use_orig_params` views;
* an FSDP1 flat parameter's gradient: one flat shard holding slices of many original
  parameters (`original_slices` cuts it back);
* a DTensor (FSDP2, HSDP, tensor and expert parallel): we take its local shard and never rely on
  DTensor's own reductions, and read its layout from its public `device_mesh` and `placements`;
* a sparse tensor: we use its coalesced values.

Three questions are answered here and nowhere else: which elements this rank holds
(`local_grad`, `local_grads`), how many ranks hold the same elements (`replica_count`, for a
global norm that counts every element once), and which original parameter an element belongs to
(`original_slices`, for naming overflows).

The tensors returned alias the gradients: unscaling them in place unscales the gradients, with no
copy. The one exception is an uncoalesced sparse gradient, which is replaced by its coalesced form
(as torch's scalers do), because duplicate indices are summed only then, and that sum can overflow.

Every step walks hundreds of parameters, so a scaler keeps its walks ([`GradWalk`][]): while the
local gradient tensors are the very same objects as at the last step (FSDP2 and DDP keep them when
gradients are zeroed in place), the grouping is reused, and so are *flat buffers*: FSDP2's local
gradients of one `fully_shard` group are contiguous views into one reduce-scatter buffer, so where
the views tile a buffer exactly (no gap, no overlap: padding is never read as gradient) the
kernels take the buffer as one tensor. A cached layout is used only while every local gradient is
the same object it was built from, and holds them by weak reference only.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

GradGroups = dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]
"""Local gradient tensors keyed by (device, dtype): one fused kernel call per key."""
NormGroups = dict[tuple[torch.device, torch.dtype, int], list[torch.Tensor]]
"""Local gradients by (device, dtype, replica count): one norm and one weight per key."""

_HALF_DTYPES = (torch.float16, torch.bfloat16)
_GRAD = operator.attrgetter("grad")
_FLAT_PARAM = "_flat_param"
# One gradient (its index among the parameters), or the indices of gradients that together tile
# one buffer (taken as that buffer).
_Entry = int | tuple[int, ...]


def move(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`: itself if already there, else a copy, asynchronous only to an
    accelerator (the host must never read a CPU copy before it lands)."""
    return tensor.to(device, non_blocking=device.type != "cpu")


def local_grads(params: tuple[torch.Tensor, ...]) -> tuple[list[torch.Tensor | None], bool]:
    """Each parameter's local gradient (None: no gradient), and whether any was sparse.

    An uncoalesced sparse gradient is coalesced in place on its parameter first (half precision
    sums through fp32; see the module docstring); `local_grad` reads one without touching it.
    """
    # Reading .grad on a DTensor parameter goes through __torch_function__ (~0.25 us); with it
    # disabled, 0.1 us, as on a plain tensor. This runs per parameter per step.
    with torch._C.DisableTorchFunctionSubclass():
        grads: list[torch.Tensor | None] = list(map(_GRAD, params))
    sparse = False
    for i, grad in enumerate(grads):
        if grad is None:
            continue
        if isinstance(grad, DTensor):
            grad = grads[i] = grad._local_tensor  # what to_local() returns, without its overhead
        if grad.is_sparse:
            sparse = True
            if not grad.is_coalesced():
                half = grad.dtype in _HALF_DTYPES
                coalesced = (grad.float() if half else grad).coalesce().to(grad.dtype)
                params[i].grad = grad = coalesced
            grads[i] = grad._values()
    return grads, sparse


def local_grad(grad: torch.Tensor) -> torch.Tensor:
    """The gradient elements this rank holds, for reading (norms, locating overflows).

    A DTensor's local shard; a sparse gradient's coalesced values (coalesced into a copy if it
    is not yet: duplicates sum only then, and that sum is what may overflow); else `grad`.
    """
    if isinstance(grad, DTensor):
        grad = grad._local_tensor
    if grad.is_sparse:
        grad = (grad if grad.is_coalesced() else grad.coalesce())._values()
    return grad


def grads_device(params: Iterable[torch.Tensor]) -> torch.device:
    """Where the local gradients of `params` live: the first gradient's (local) device.

    Else the first parameter's (a rank that holds no gradient yet), else the CPU. A rank that
    computes no loss (a pipeline stage before the last) puts the scale state there.
    """
    first: torch.Tensor | None = None
    for param in params:
        if param.grad is not None:
            return local_grad(param.grad).device
        first = param if first is None else first
    if first is None:
        return torch.device("cpu")
    return (first._local_tensor if isinstance(first, DTensor) else first).device


def _dtensor_replicas(grad: DTensor) -> int:
    """The product of the mesh sizes of `grad`'s `Replicate` dimensions."""
    replicas = 1
    for dim, placement in enumerate(grad.placements):
        if placement.is_partial():
            raise ValueError(
                "a gradient's placements must be Shard or Replicate to take its norm, got "
                f"{tuple(grad.placements)}: a Partial gradient is a sum still to be reduced "
                "(redistribute it first)"
            )
        if placement.is_replicate():  # not `not is_shard()`: FSDP2 x TP's _StridedShard is no
            replicas *= grad.device_mesh.size(
                dim
            )  # Shard (is_shard() False), yet shards all the same
    return replicas


def replica_count(param: torch.Tensor, plain_replicas: int) -> int:
    """How many ranks hold the same local gradient elements as this rank does for `param`.

    * DTensor: read from its own `device_mesh` and `placements`: the product of the mesh
      sizes of its `Replicate` dimensions (HSDP's replicate dimension, a TP `Replicate`).
      Ranks outside its mesh hold other parameters (another pipeline stage, other experts)
      or other shards, so disjoint stages and expert shards add up.
    * Plain tensor: `plain_replicas`, the ranks the caller says replicate it (DDP: the whole
      group; a pipeline stage: its data-parallel group; pure pipeline: 1).
    * FSDP1 flat parameter: `plain_replicas` ranks hold it, in as many shards as it has.
    * A parameter FSDP1 flattened (`use_orig_params=True`): taken as fully sharded, 1.
    """
    grad = param.grad
    if isinstance(grad, DTensor):
        return _dtensor_replicas(grad)
    if getattr(param, "_is_flat_param", False):
        unsharded: int = param._padded_unsharded_size.numel()  # type: ignore[attr-defined]
        sharded: int = max(param._sharded_size.numel(), 1)  # type: ignore[attr-defined]
        return max(plain_replicas // max(unsharded // sharded, 1), 1)
    if getattr(param, "_fsdp_flattened", False):
        return 1
    return plain_replicas


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
    if not getattr(param, "_is_flat_param", False):
        yield name, local
        return
    prefix = name[: -len(_FLAT_PARAM)] if name.endswith(_FLAT_PARAM) else f"{name}."
    flat = local.reshape(-1)
    for fqn, info in zip(param._fqns, param._shard_param_infos, strict=True):  # type: ignore[attr-defined]
        if info.in_shard:
            start = info.offset_in_shard
            yield prefix + fqn, flat[start : start + info.numel_in_shard]


def plain_replicas(replica_group: object, world_size: int) -> int:
    """The number of ranks `clip_grad_norm_`'s `replica_group` names (see its docs)."""
    if replica_group is None:
        return world_size
    if isinstance(replica_group, DeviceMesh):
        if replica_group.ndim != 1:
            raise ValueError(
                f"replica_group must be a 1-D DeviceMesh, got one of shape "
                f"{tuple(replica_group.shape)}: slice it by the data-parallel dimension"
            )
        return replica_group.size()
    if isinstance(replica_group, dist.ProcessGroup):
        return dist.get_world_size(replica_group)
    if isinstance(replica_group, bool) or not isinstance(replica_group, int):
        raise TypeError(
            "replica_group must be a ProcessGroup, a 1-D DeviceMesh, an int or None, got "
            f"{type(replica_group).__name__}"
        )
    if not 1 <= replica_group <= world_size:
        raise ValueError(
            f"replica_group must be in [1, {world_size}] (the scaler's group size), got "
            f"{replica_group}"
        )
    return replica_group


@dataclass(eq=False, slots=True)
class _Layout:
    """What a walk found, by position, holding no gradient alive (weak references only)."""

    params: list[weakref.ref[torch.Tensor]]
    grads: list[weakref.ref[torch.Tensor] | None]
    entries: dict[Hashable, list[_Entry]]
    """Per group key, the gradients' indices (flat entries once the layout was seen twice)."""
    holds: bool
    plain: bool
    flat: bool = False


class GradWalk:
    """A scaler's walks of its local gradients, each laid out once and reused (module docstring).

    Reusing is safe because the check is on the identity of every local gradient tensor, each
    step: the same objects hold whatever values they now hold (the kernels read them afresh),
    and a new gradient (`zero_grad(set_to_none=True)`, an FSDP2 backward after it, a reassigned
    `.grad`) is a new object, which is walked again. Sparse gradients are never cached
    (coalescing replaces them).
    """

    def __init__(self) -> None:
        self._layouts: dict[Hashable, _Layout] = {}
        self._replicas: dict[int, tuple[object, int]] = {}  # per parameter: (spec, count)

    def groups(
        self, key: Hashable, params: Iterable[torch.Tensor], plain: int | None = None
    ) -> tuple[dict[Any, list[torch.Tensor]], bool, bool]:
        """`params`' local gradients by (device, dtype) ([`GradGroups`][]), or with `plain`
        (how many ranks hold the same plain gradients) by (device, dtype, replica count)
        ([`NormGroups`][]); flat where they tile a buffer. Also: whether any was a plain tensor
        (its count came from `plain`), and whether any holds an element (an empty shard does
        not). `key` names the walk whose layout is kept.

        Raises:
            TypeError: a gradient is not floating point.
        """
        params = tuple(params)
        local, sparse = local_grads(params)
        layout = self._layouts.get(key)
        matches = layout is not None and len(layout.grads) == len(local)
        if layout is not None and matches:
            for param_ref, grad_ref, param, grad in zip(
                layout.params, layout.grads, params, local, strict=True
            ):
                if param_ref() is not param or (grad_ref() if grad_ref else None) is not grad:
                    matches = False
                    break
        if layout is None or not matches:
            layout = self._layout(params, local, plain)
            if sparse:
                self._layouts.pop(key, None)
            else:
                self._layouts[key] = layout
        elif not layout.flat:  # seen twice: worth laying out flat, once
            for group, indices in layout.entries.items():
                layout.entries[group] = _flat_entries(local, indices)
            layout.flat = True
        groups: dict[Hashable, list[torch.Tensor]] = {}
        for group, entries in layout.entries.items():
            tensors = groups[group] = []
            for entry in entries:
                grad = _buffer(local, entry) if isinstance(entry, tuple) else local[entry]
                tensors.append(cast(torch.Tensor, grad))
        return groups, layout.plain, layout.holds

    def _layout(
        self, params: tuple[torch.Tensor, ...], local: list[torch.Tensor | None], plain: int | None
    ) -> _Layout:
        present, holds = [], False
        for i, grad in enumerate(local):
            if grad is not None:
                present.append(i)
                holds = holds or grad.numel() > 0
        entries: dict[Hashable, list[_Entry]] = {}
        if present:  # (a rank that ran no backward has none; the grouping rejects no input)
            grouped = _group_tensors_by_device_and_dtype(
                [list(map(local.__getitem__, present))], with_indices=True
            )
            for (device, dtype), (_tensors, positions) in grouped.items():
                if not dtype.is_floating_point:
                    raise TypeError(
                        f"gradients must be floating point to be checked for inf/NaN, got {dtype}"
                    )
                entries[(device, dtype)] = list(map(present.__getitem__, positions))
        any_plain = False
        if plain is not None:  # split the groups by replica count
            by_count: dict[Hashable, list[_Entry]] = {}
            with torch._C.DisableTorchFunctionSubclass():
                for (device, dtype), indices in cast(dict[Any, list[_Entry]], entries).items():
                    for i in cast(list[int], indices):
                        count, is_plain = self._replica_count(params[i], plain)
                        any_plain = any_plain or is_plain
                        by_count.setdefault((device, dtype, count), []).append(i)
            # Flat at once: a norm costs ~8 us per tensor on a CPU, more than finding the tiling.
            entries = by_count
            for key, indices in by_count.items():
                entries[key] = _flat_entries(local, indices)
        return _Layout(
            params=list(map(weakref.ref, params)),
            grads=[None if g is None else weakref.ref(g) for g in local],
            entries=entries,
            holds=holds,
            plain=any_plain,
            flat=plain is not None,
        )

    def _replica_count(self, param: torch.Tensor, plain: int) -> tuple[int, bool]:
        """`replica_count(param, plain)`, and whether `param`'s gradient is a plain tensor (its
        replicas named by the caller, not read from a DTensor or an FSDP1 flat parameter)."""
        grad = param.grad
        if type(grad) is not DTensor and not isinstance(grad, DTensor):
            flat = getattr(param, "_is_flat_param", False) or getattr(
                param, "_fsdp_flattened", False
            )
            return replica_count(param, plain), not flat
        # By the gradient's sharding spec, per parameter: FSDP2 hands each step's gradient with
        # the parameter's one spec object (3x cheaper than reading the mesh and placements).
        known = self._replicas.get(id(param))
        if known is None or known[0] is not grad._spec:
            known = self._replicas[id(param)] = (grad._spec, _dtensor_replicas(grad))
        return known[1], False


def _buffer(local: list[torch.Tensor | None], entry: tuple[int, ...]) -> torch.Tensor:
    return cast(torch.Tensor, cast(torch.Tensor, local[entry[0]])._base).view(-1)


def _flat_entries(local: list[torch.Tensor | None], indices: list[_Entry]) -> list[_Entry]:
    """`indices`, with every set whose gradients exactly tile one buffer made one entry."""
    by_base: dict[int, tuple[torch.Tensor, list[int]]] = {}
    entries: list[_Entry] = []
    for i in cast(list[int], indices):
        base = cast(torch.Tensor, local[i])._base
        if base is None:
            entries.append(i)
        else:
            by_base.setdefault(id(base), (base, []))[1].append(i)
    for base, members in by_base.values():
        views = [cast(torch.Tensor, local[i]) for i in members]
        entries.extend([tuple(members)] if len(members) > 1 and _tiles(base, views) else members)
    return entries


def _tiles(base: torch.Tensor, views: list[torch.Tensor]) -> bool:
    """Whether `views` (all of `base`) lie end to end over all of `base`, contiguous."""
    if not (base.is_contiguous() and all(view.is_contiguous() for view in views)):
        return False
    itemsize = base.element_size()
    position = base.data_ptr()
    for start, numel in sorted((view.data_ptr(), view.numel()) for view in views):
        if start != position:
            return False
        position += numel * itemsize
    return position == base.data_ptr() + base.numel() * itemsize
