"""The cached walk of a step's local gradients: grouped by (device, dtype), flat where exact.

Every step walks hundreds of parameters, so the walk is cached (`GradCache`): while the local
gradient tensors are the very same objects as last step (FSDP2 and DDP keep them when gradients
are zeroed in place; FSDP2 makes new ones after `zero_grad(set_to_none=True)`), the grouping is
reused, and so are *flat buffers*: FSDP2's local gradients of one `fully_shard` group are
contiguous views into one reduce-scatter buffer, so where the views tile a buffer exactly (no gap,
no overlap: padding is never read as gradient) the kernels take the buffer as one tensor.

Invariant: a walk hands the kernels every local gradient element exactly once, and a cached layout
is used only while every local gradient is the same object it was built from. What a gradient is
(its local view, its replica count) is `shardscale._grads`'s answer; this module only arranges.
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import cast

import torch
from torch.distributed.tensor import DTensor
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

from shardscale._grads import local_grads, replica_count

__all__ = ["GradCache", "GradGroups", "GradWalk", "NormKey"]

GradGroups = dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]
"""Local gradient tensors keyed by (device, dtype): one fused kernel call per key."""

# A layout entry: one gradient (its index among the parameters), or the indices of gradients that
# together tile one buffer (taken as that buffer).
_Entry = int | tuple[int, ...]
NormKey = tuple[torch.device, torch.dtype, int]
"""(device, dtype, replica count): one norm computation and one weight per key."""


def _flat_layout(local: list[torch.Tensor | None], indices: list[int]) -> list[_Entry]:
    """`indices`, with every set whose gradients exactly tile a buffer made one entry."""
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
    """Whether `views` (all of `base`) lie end to end over all of `base`, contiguous."""
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
        """What the check kernel takes: `flat_groups` once these gradients were seen
        twice (the tiling is verified once, then reused), else `groups`."""
        return self.flat_groups() if self._layout.flat is not None else self.groups

    def flat_groups(self) -> GradGroups:
        """`groups`, where gradients tiling a buffer are that buffer."""
        layout = self._layout
        if layout.flat is None:
            layout.flat = {
                key: _flat_layout(self.local, indices) for key, indices in layout.groups.items()
            }
        return {key: _resolve(self.local, entries) for key, entries in layout.flat.items()}

    def norm_groups(self, plain_replicas: int) -> tuple[dict[NormKey, list[torch.Tensor]], bool]:
        """The local gradients by (device, dtype, replica count), flat where possible, and
        whether any was a plain tensor (its replica count came from `plain_replicas`)."""
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
    but code that builds gradients with `DTensor.from_local` makes a new, equal one each time.
    """

    def __init__(self) -> None:
        self._memo: dict[int, tuple[weakref.ref[torch.Tensor], object, object, int, int, bool]] = {}

    def get(self, param: torch.Tensor, grad: torch.Tensor, plain_replicas: int) -> tuple[int, bool]:
        """`(replica_count(param, plain_replicas), whether the gradient is a plain tensor)`."""
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
    and a new gradient (`zero_grad(set_to_none=True)`, an FSDP2 backward after it, a reassigned
    `.grad`) is a new object, which is walked again. Only weak references are kept, so
    gradients freed by `zero_grad` are freed. Sparse gradients are never cached (coalescing
    replaces them).
    """

    def __init__(self) -> None:
        self._layouts: dict[Hashable, _Layout] = {}
        self._memo = _ReplicaMemo()

    def walk(self, key: Hashable, params: Iterable[torch.Tensor]) -> GradWalk:
        """This step's walk of `params`' local gradients, laid out as cached under `key`.

        Raises:
            TypeError: a gradient is not floating point.
        """
        params = tuple(params)
        local, sparse = local_grads(params)
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
