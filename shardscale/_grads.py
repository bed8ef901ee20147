"""What a gradient is, whatever wraps it: the one place that knows the gradient kinds.

Whatever the parallelism, the gradient an optimizer sees is one of:

* a plain tensor: single process, DDP, pipeline stages, FSDP1's ``use_orig_params`` views;
* an FSDP1 flat parameter's gradient: one flat shard holding slices of many original
  parameters (:func:`original_slices` cuts it back);
* a DTensor (FSDP2, HSDP, tensor and expert parallel): we take its local shard and never rely on
  DTensor's own reductions, and read its layout from its public ``device_mesh`` and
  ``placements``;
* a sparse tensor: we use its coalesced values.

Three questions are answered here and nowhere else: which elements this rank holds
(:func:`local_grad`, :func:`collect_local_grads`), how many ranks hold the same elements
(:func:`replica_count`, for a global norm that counts every element once), and which original
parameter an element belongs to (:func:`original_slices`, for naming overflows).

The tensors returned alias the gradients: unscaling them in place unscales the gradients, with no
copy. The one exception is an uncoalesced sparse gradient, which is replaced by its coalesced form
(as torch's scalers do), because duplicate indices are summed only then, and that sum can overflow.

Every step walks hundreds of parameters, so the walk is cached (:class:`GradCache`): while the
local gradient tensors are the very same objects as last step (FSDP2 and DDP keep them when
gradients are zeroed in place; FSDP2 makes new ones after ``zero_grad(set_to_none=True)``), the
grouping is reused, and so are *flat buffers*: FSDP2's local gradients of one ``fully_shard``
group are contiguous views into one reduce-scatter buffer, so where the views tile a buffer exactly
(no gap, no overlap: padding is never read as gradient) the kernels take the buffer as one tensor.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import cast

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

__all__ = [
    "GradCache",
    "GradGroups",
    "GradWalk",
    "NormKey",
    "collect_local_grads",
    "grads_device",
    "holds_elements",
    "local_grad",
    "original_slices",
    "replica_count",
]

GradGroups = dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]
"""Local gradient tensors keyed by (device, dtype): one fused kernel call per key."""

_HALF_DTYPES = (torch.float16, torch.bfloat16)
_FLAT_PARAM = "_flat_param"


def _coalesced_(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Coalesce a sparse gradient in place on ``param``; half precision sums through fp32."""
    if grad.is_coalesced():
        return grad
    if grad.dtype in _HALF_DTYPES:
        coalesced = grad.float().coalesce().to(grad.dtype)
    else:
        coalesced = grad.coalesce()
    param.grad = coalesced
    return coalesced


def _locals(params: tuple[torch.Tensor, ...]) -> tuple[list[torch.Tensor | None], bool]:
    """Each parameter's local gradient (None: no gradient), and whether any was sparse."""
    # Reading .grad on a DTensor parameter goes through __torch_function__ (~0.25 us); with it
    # disabled, 0.1 us, as on a plain tensor. This runs per parameter per step.
    with torch._C.DisableTorchFunctionSubclass():
        grads = [param.grad for param in params]
    local: list[torch.Tensor | None] = []
    sparse = False
    for param, grad in zip(params, grads, strict=True):
        if grad is not None:
            if isinstance(grad, DTensor):
                grad = grad._local_tensor  # what to_local() returns, without its overhead
            if grad.is_sparse:
                sparse = True
                grad = _coalesced_(param, grad)._values()
        local.append(grad)
    return local, sparse


def collect_local_grads(params: Iterable[torch.Tensor]) -> GradGroups:
    """Group this rank's local gradient tensors of ``params`` by (device, dtype).

    Empty shards stay in their group (the kernel passes over them); whether this rank holds any
    gradient element at all is :func:`holds_elements`'s question. Uncoalesced sparse gradients
    are coalesced in place first (see the module docstring). Uncached: see :class:`GradCache`.

    Raises:
        TypeError: a gradient is not floating point (it could not hold an inf or a NaN).
    """
    return GradCache().walk(None, params).groups


# A layout entry: one gradient (its index among the parameters), or the indices of gradients that
# together tile one buffer (taken as that buffer).
_Entry = int | tuple[int, ...]
NormKey = tuple[torch.device, torch.dtype, int]
"""(device, dtype, replica count): one norm computation and one weight per key."""


def _flat_layout(local: list[torch.Tensor | None], indices: list[int]) -> list[_Entry]:
    """``indices``, with every set whose gradients exactly tile a buffer made one entry."""
    by_base: dict[int, tuple[torch.Tensor, list[int]]] = {}
    entries: list[_Entry] = []
    for i in indices:
        base = cast(torch.Tensor, local[i])._base
        if base is None:
            entries.append(i)
        elif (seen := by_base.get(id(base))) is not None:
            seen[1].append(i)
        else:
            by_base[id(base)] = (base, [i])
    for base, members in by_base.values():
        tiled = len(members) > 1 and _tiles(base, [cast(torch.Tensor, local[i]) for i in members])
        entries.extend([tuple(members)] if tiled else members)
    return entries


def _tiles(base: torch.Tensor, views: list[torch.Tensor]) -> bool:
    """Whether ``views`` (all of ``base``) lie end to end over all of ``base``, contiguous."""
    if not base.is_contiguous():
        return False
    spans = []
    for view in views:
        if not view.is_contiguous():
            return False
        spans.append((view.data_ptr(), view.numel()))
    spans.sort()
    itemsize = base.element_size()
    position = base.data_ptr()
    for start, numel in spans:
        if start != position:
            return False
        position += numel * itemsize
    return position == base.data_ptr() + base.numel() * itemsize


def _resolve(local: list[torch.Tensor | None], entries: list[_Entry]) -> list[torch.Tensor]:
    return [
        cast(torch.Tensor, local[e]) if isinstance(e, int) else _base_of(local[e[0]])
        for e in entries
    ]


def _base_of(view: torch.Tensor | None) -> torch.Tensor:
    return cast(torch.Tensor, cast(torch.Tensor, view)._base).view(-1)


@dataclass(eq=False)
class _Layout:
    """What a walk found, by position, holding no gradient alive (weak references only)."""

    params: list[weakref.ref[torch.Tensor]]
    local: list[weakref.ref[torch.Tensor] | None]
    groups: dict[tuple[torch.device, torch.dtype], list[int]]
    holds: bool
    flat: dict[tuple[torch.device, torch.dtype], list[_Entry]] | None = None
    norms: dict[int, tuple[dict[NormKey, list[_Entry]], bool]] = field(default_factory=dict)

    def matches(self, params: tuple[torch.Tensor, ...], local: list[torch.Tensor | None]) -> bool:
        return (
            len(self.local) == len(local)
            and all(
                ref() is grad if ref is not None else grad is None
                for ref, grad in zip(self.local, local, strict=True)
            )
            and all(ref() is param for ref, param in zip(self.params, params, strict=True))
        )


@dataclass(eq=False)
class GradWalk:
    """This step's local gradients of some parameters: grouped, and flat where possible."""

    params: tuple[torch.Tensor, ...]
    local: list[torch.Tensor | None]
    """Each parameter's local gradient tensor (None: no gradient)."""
    _layout: _Layout
    _memo: _ReplicaMemo

    @property
    def holds(self) -> bool:
        """Whether any gradient has an element (empty shards do not count)."""
        return self._layout.holds

    @property
    def groups(self) -> GradGroups:
        """By (device, dtype), one tensor per gradient."""
        return {
            key: [cast(torch.Tensor, self.local[i]) for i in indices]
            for key, indices in self._layout.groups.items()
        }

    def kernel_groups(self) -> GradGroups:
        """What the check kernel takes: :meth:`flat_groups` once these gradients were seen
        twice (the tiling is verified once, then reused), else :attr:`groups`."""
        return self.flat_groups() if self._layout.flat is not None else self.groups

    def flat_groups(self) -> GradGroups:
        """:attr:`groups`, where gradients tiling a buffer are that buffer."""
        layout = self._layout
        if layout.flat is None:
            layout.flat = {
                key: _flat_layout(self.local, indices) for key, indices in layout.groups.items()
            }
        return {key: _resolve(self.local, entries) for key, entries in layout.flat.items()}

    def norm_groups(self, plain_replicas: int) -> tuple[dict[NormKey, list[torch.Tensor]], bool]:
        """The local gradients by (device, dtype, replica count), flat where possible, and
        whether any was a plain tensor (its replica count came from ``plain_replicas``)."""
        layout = self._layout
        if plain_replicas not in layout.norms:
            by_key: dict[NormKey, list[int]] = {}
            plain = False
            with torch._C.DisableTorchFunctionSubclass():
                for i, (param, local) in enumerate(zip(self.params, self.local, strict=True)):
                    if local is None:
                        continue
                    grad = cast(torch.Tensor, param.grad)
                    replicas, is_plain = self._memo.get(param, grad, plain_replicas)
                    plain = plain or is_plain
                    by_key.setdefault((local.device, local.dtype, replicas), []).append(i)
            layout.norms[plain_replicas] = (
                {key: _flat_layout(self.local, indices) for key, indices in by_key.items()},
                plain,
            )
        entries, plain = layout.norms[plain_replicas]
        return {key: _resolve(self.local, e) for key, e in entries.items()}, plain


class _ReplicaMemo:
    """Each parameter's replica count, kept while the parameter and its gradient's layout stay.

    A layout is fixed for a job; computing it from meshes and placements for hundreds of
    parameters each step is not free. The layout is recognised by its mesh (the same object)
    and placements (equal): FSDP2 hands out each step's gradients with the same spec object,
    but code that builds gradients with ``DTensor.from_local`` makes a new, equal one each time.
    """

    def __init__(self) -> None:
        self._memo: dict[int, tuple[weakref.ref[torch.Tensor], object, object, int, int, bool]] = {}

    def get(self, param: torch.Tensor, grad: torch.Tensor, plain_replicas: int) -> tuple[int, bool]:
        """``(replica_count(param, plain_replicas), whether the gradient is a plain tensor)``."""
        mesh, placements = (
            (grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else (None, None)
        )
        hit = self._memo.get(id(param))
        if (
            hit is not None
            and hit[0]() is param
            and hit[1] is mesh
            and hit[2] == placements
            and hit[3] == plain_replicas
        ):
            return hit[4], hit[5]
        replicas = replica_count(param, plain_replicas)
        plain = mesh is None and not (
            getattr(param, "_is_flat_param", False) or getattr(param, "_fsdp_flattened", False)
        )
        self._memo[id(param)] = (
            weakref.ref(param),
            mesh,
            placements,
            plain_replicas,
            replicas,
            plain,
        )
        return replicas, plain


class GradCache:
    """Walks of the local gradients, whose layout is reused while the gradients are the same.

    Reusing is safe because the check is on the identity of every local gradient tensor, each
    step: the same objects hold whatever values they now hold (the kernels read them afresh),
    and a new gradient (``zero_grad(set_to_none=True)``, an FSDP2 backward after it, a reassigned
    ``.grad``) is a new object, which is walked again. Only weak references are kept, so
    gradients freed by ``zero_grad`` are freed. Sparse gradients are never cached (coalescing
    replaces them).
    """

    def __init__(self) -> None:
        self._layouts: dict[Hashable, _Layout] = {}
        self._memo = _ReplicaMemo()

    def walk(self, key: Hashable, params: Iterable[torch.Tensor]) -> GradWalk:
        """This step's walk of ``params``' local gradients, laid out as cached under ``key``.

        Raises:
            TypeError: a gradient is not floating point.
        """
        params = tuple(params)
        local, sparse = _locals(params)
        layout = self._layouts.get(key)
        if layout is not None and layout.matches(params, local):
            walk = GradWalk(params, local, layout, self._memo)
            if layout.flat is None:  # seen twice: worth laying out flat, once
                walk.flat_groups()
            return walk
        groups = _group_indices(local)
        layout = _Layout(
            params=[weakref.ref(p) for p in params],
            local=[None if g is None else weakref.ref(g) for g in local],
            groups=groups,
            holds=any(
                cast(torch.Tensor, local[i]).numel() > 0 for ix in groups.values() for i in ix
            ),
        )
        if sparse:
            self._layouts.pop(key, None)
        else:
            self._layouts[key] = layout
        return GradWalk(params, local, layout, self._memo)


def _group_indices(
    local: list[torch.Tensor | None],
) -> dict[tuple[torch.device, torch.dtype], list[int]]:
    """Indices of the present gradients by (device, dtype), in one C++ pass."""
    present = [i for i, grad in enumerate(local) if grad is not None]
    if not present:  # a rank that ran no backward; the grouping helper rejects empty input
        return {}
    grouped = _group_tensors_by_device_and_dtype([[local[i] for i in present]], with_indices=True)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for (device, dtype), (_tensor_lists, positions) in grouped.items():
        if not dtype.is_floating_point:
            raise TypeError(
                f"gradients must be floating point to be checked for inf/NaN, got {dtype}"
            )
        groups[(device, dtype)] = [present[j] for j in positions]
    return groups


def local_grad(grad: torch.Tensor) -> torch.Tensor:
    """The gradient elements this rank holds, for reading (norms, locating overflows).

    A DTensor's local shard; a sparse gradient's coalesced values (coalesced into a copy if it
    is not yet: duplicates sum only then, and that sum is what may overflow); else ``grad``.
    :func:`collect_local_grads` walks the same way, coalescing in place.
    """
    if isinstance(grad, DTensor):
        grad = grad._local_tensor
    if grad.is_sparse:
        grad = (grad if grad.is_coalesced() else grad.coalesce())._values()
    return grad


def holds_elements(groups: GradGroups) -> bool:
    """Whether any gradient in ``groups`` has an element (empty shards do not count)."""
    return any(grad.numel() > 0 for grads in groups.values() for grad in grads)


def grads_device(params: Iterable[torch.Tensor]) -> torch.device:
    """Where the local gradients of ``params`` live: the first gradient's (local) device.

    Else the first parameter's (a rank that holds no gradient yet), else the CPU. A rank that
    computes no loss (a pipeline stage before the last) puts the scale state there.
    """
    first_param: torch.Tensor | None = None
    for param in params:
        if param.grad is not None:
            return local_grad(param.grad).device
        if first_param is None:
            first_param = param
    if first_param is not None:
        local = first_param._local_tensor if isinstance(first_param, DTensor) else first_param
        return local.device
    return torch.device("cpu")


@functools.lru_cache(maxsize=256)
def _dtensor_replicas(mesh: DeviceMesh, placements: tuple[Placement, ...]) -> int:
    """Cached per sharding layout: a model has few, and its parameters repeat them."""
    replicas = 1
    for dim, placement in enumerate(placements):
        if placement.is_partial():
            raise ValueError(
                "a gradient's placements must be Shard or Replicate to take its norm, got "
                f"{placements}: a Partial gradient is a sum still to be reduced (redistribute it "
                "first)"
            )
        if placement.is_replicate():  # not `not is_shard()`: FSDP2 x TP's _StridedShard is no
            replicas *= mesh.size(dim)  # Shard (is_shard() is False), yet shards all the same
    return replicas


def replica_count(param: torch.Tensor, plain_replicas: int) -> int:
    """How many ranks hold the same local gradient elements as this rank does for ``param``.

    * DTensor: read from its own ``device_mesh`` and ``placements``: the product of the mesh
      sizes of its ``Replicate`` dimensions (HSDP's replicate dimension, a TP ``Replicate``).
      Ranks outside its mesh hold other parameters (another pipeline stage, other experts)
      or other shards, so disjoint stages and expert shards add up.
    * Plain tensor: ``plain_replicas``, the ranks the caller says replicate it (DDP: the whole
      group; a pipeline stage: its data-parallel group; pure pipeline: 1).
    * FSDP1 flat parameter: ``plain_replicas`` ranks hold it, in as many shards as it has.
    * A parameter FSDP1 flattened (``use_orig_params=True``): taken as fully sharded, 1.
    """
    grad = param.grad
    if isinstance(grad, DTensor):
        return _dtensor_replicas(grad.device_mesh, tuple(grad.placements))
    if getattr(param, "_is_flat_param", False):
        unsharded: int = param._padded_unsharded_size.numel()  # type: ignore[attr-defined]
        sharded: int = max(param._sharded_size.numel(), 1)  # type: ignore[attr-defined]
        return max(plain_replicas // max(unsharded // sharded, 1), 1)
    if getattr(param, "_fsdp_flattened", False):
        return 1
    return plain_replicas


def original_slices(name: str, param: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, local gradient elements)`` per original parameter held in ``param``'s gradient.

    One pair for most parameters; an FSDP1 flat parameter yields the slice of each original
    parameter that lies in this rank's shard, cut by the offsets FSDP records, named
    ``<module prefix>.<original name>``. Nothing when ``param`` has no gradient.
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
