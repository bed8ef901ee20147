"""The gradient walk: cached while gradients stay the same, flat buffers only where exact."""

from __future__ import annotations

import gc
import math
import weakref
from typing import Any

import pytest
import torch
from torch import nn

from shardscale import ShardedGradScaler
from shardscale._grads import GradWalk, _flat_entries
from tests.harness import run_ranks


def _params_with_grads(grads: list[torch.Tensor]) -> list[nn.Parameter]:
    params = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad
    return params


def _tiled(*views: torch.Tensor) -> bool:
    """Whether the layout takes ``views`` as one buffer (one entry), not one by one."""
    entries = _flat_entries(list(views), list(range(len(views))))
    return entries == [tuple(range(len(views)))]


def test_flat_buffer_only_when_views_tile_it_exactly() -> None:
    base = torch.arange(10.0)
    assert _tiled(base[0:4], base[4:10])
    assert _tiled(base[4:10], base[0:4])  # any order
    assert not _tiled(base[0:4], base[5:10])  # a gap: padding, never read
    assert not _tiled(base[0:4], base[4:9])  # the tail not covered
    assert not _tiled(base[0:6], base[4:10])  # overlapping
    assert not _tiled(base.view(2, 5)[:, :2], base[6:10])  # not contiguous
    assert not _tiled(base[0:5], torch.arange(5.0))  # another storage


def _sizes(walk: GradWalk, params: list[nn.Parameter]) -> list[int]:
    groups, _plain, _holds = walk.groups("k", params)
    return [t.numel() for t in groups[(torch.device("cpu"), torch.float32)]]


def test_grad_walk_reuses_its_layout_while_the_gradients_are_the_same_objects() -> None:
    base = torch.zeros(12)
    params = _params_with_grads([base[0:4].view(2, 2), base[4:12]])
    walk = GradWalk()
    assert _sizes(walk, params) == [4, 8]  # first sighting: per tensor
    first = walk._layouts["k"]
    groups, _plain, _holds = walk.groups("k", params)
    assert walk._layouts["k"] is first
    (flat,) = groups[(torch.device("cpu"), torch.float32)]
    assert flat.data_ptr() == base.data_ptr()  # seen twice: the whole buffer
    assert flat.numel() == 12
    params[1].grad = base[4:12].clone()  # a new gradient object (set_to_none, reassignment)
    assert _sizes(walk, params) == [4, 8]
    assert walk._layouts["k"] is not first


def test_grad_walk_norm_groups_take_the_flat_buffer_at_once() -> None:
    base = torch.zeros(12)
    params = _params_with_grads([base[0:4], base[4:12]])
    groups, plain, holds = GradWalk().groups("clip", params, 1)
    assert [t.numel() for t in groups[(torch.device("cpu"), torch.float32, 1)]] == [12]
    assert plain
    assert holds


def test_grad_walk_keeps_no_gradient_alive() -> None:
    params = _params_with_grads([torch.ones(4), torch.ones(4)])
    walk = GradWalk()
    walk.groups("k", params)
    walk.groups("k", params)  # laid out flat too
    watched = weakref.ref(params[0].grad)  # type: ignore[arg-type]
    for param in params:
        param.grad = None  # zero_grad(set_to_none=True)
    gc.collect()
    assert watched() is None


def test_sparse_gradients_are_walked_every_time() -> None:
    embedding = nn.Embedding(10, 4, sparse=True)
    embedding(torch.tensor([1, 1, 2])).sum().backward()
    walk = GradWalk()
    walk.groups("k", embedding.parameters())
    assert embedding.weight.grad.is_coalesced()  # type: ignore[union-attr]
    assert "k" not in walk._layouts


def _rank_fsdp2_train(rank: int, world_size: int, even: bool, set_to_none: bool) -> dict[str, Any]:
    """FSDP2 training with our scaler beside the same with torch.amp.GradScaler: no rank
    overflows, so both take the same steps and must end bit for bit alike."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    results = {}
    for name in ("ours", "torch"):
        torch.manual_seed(0)
        width = 16 if even else 15  # 15 rows over 2 ranks: FSDP2 pads the second shard
        model = nn.Sequential(nn.Linear(16, width), nn.Tanh(), nn.Linear(width, 4))
        fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        scaler: Any = (
            ShardedGradScaler(init_scale=2.0**12)
            if name == "ours"
            else torch.amp.GradScaler("cpu", init_scale=2.0**12)
        )
        for step in range(4):
            optimizer.zero_grad(set_to_none=set_to_none)
            inputs = torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * step + rank))
            scaler.scale(model(inputs).pow(2).mean()).backward()
            scaler.step(optimizer)
            scaler.update()
        results[name] = [p.to_local().detach().clone() for p in model.parameters()]
        if name == "ours":  # did the check take whole buffers?
            layouts = scaler._stepper._walk._layouts.values()
            flat = any(
                isinstance(entry, tuple)
                for layout in layouts
                for entries in layout.entries.values()
                for entry in entries
            )
    return {
        "identical": all(
            torch.equal(a, b) for a, b in zip(results["ours"], results["torch"], strict=True)
        ),
        "flat": flat,
    }


@pytest.mark.parametrize("even", [True, False])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_fsdp2_cached_and_flat_path_matches_torch_bit_for_bit(
    even: bool, set_to_none: bool
) -> None:
    results = run_ranks(_rank_fsdp2_train, 2, even, set_to_none)
    assert all(result["identical"] for result in results)
    # Whole buffers where the shards tile them and the gradients stay the same tensors. 15 rows
    # over 2 ranks: rank 0 holds 8 (no padding: its shards tile), rank 1 holds 7 + 1 padded.
    expected = [not set_to_none, even and not set_to_none]
    assert [result["flat"] for result in results] == expected


def _rank_padding_is_never_read(rank: int, world_size: int) -> dict[str, Any]:
    """An inf written into FSDP2's shard padding (not a gradient element) must not skip."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))  # odd sizes: padded shards
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler(init_scale=4.0)
    padded = 0
    for _step in range(2):
        optimizer.zero_grad(set_to_none=False)
        scaler.scale(model(torch.ones(2, 4)).sum()).backward()
        locals_ = [p.grad._local_tensor for p in model.parameters()]  # type: ignore[union-attr]
        base = locals_[0]._base
        assert base is not None
        covered = set()
        for view in locals_:
            start = (view.data_ptr() - base.data_ptr()) // view.element_size()
            covered.update(range(start, start + view.numel()))
        padding = sorted(set(range(base.numel())) - covered)
        padded = len(padding)
        if padding:
            base.view(-1)[padding[0]] = math.inf  # between the shards: no gradient's element
        scaler.step(optimizer)
        scaler.update()
    return {"padded": padded, "skipped": scaler.stats.skipped_steps}


def test_fsdp2_padding_is_never_read_as_gradient() -> None:
    results = run_ranks(_rank_padding_is_never_read, 2)
    assert any(r["padded"] > 0 for r in results)  # the layout did pad somewhere
    assert all(r["skipped"] == 0 for r in results)


@pytest.mark.parametrize("norm_type", [2.0, 1.0])
def test_clip_norm_of_large_scaled_fp32_gradients_does_not_overflow(norm_type: float) -> None:
    """At scale 2**24, gradients of 1e15 are 1.7e22 scaled: their squares overflow float32.
    The norm must still be the true one, and the step taken."""
    scale = 2.0**24
    model = nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-30)
    scaler = ShardedGradScaler(init_scale=scale)
    scaler.scale(model(torch.zeros(1, 64)).sum() * 0.0).backward()
    with torch.no_grad():
        for param in model.parameters():
            param.grad = torch.full_like(param, 1e15 * scale)  # type: ignore[assignment]
    expected = torch.linalg.vector_norm(
        torch.cat(
            [torch.full((p.numel(),), 1e15, dtype=torch.float64) for p in model.parameters()]
        ),
        norm_type,
    ).item()
    norm = scaler.clip_grad_norm_(model.parameters(), 1.0, norm_type).item()
    scaler.step(optimizer)
    scaler.update()
    assert math.isfinite(norm)
    assert norm == pytest.approx(expected, rel=1e-5)
    assert not scaler.last_step_skipped
    assert scaler.get_scale() == scale


def _rank_replica_counts_follow_the_gradients_layout(rank: int, world_size: int) -> list[int]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh("cpu", (world_size,))
    param = nn.Parameter(DTensor.from_local(torch.zeros(4), mesh, [Shard(0)]))
    walk = GradWalk()
    counts = []
    # a new, equal spec each time (DTensor.from_local); the placements change in the middle
    for placement in (Shard(0), Shard(0), Replicate(), Replicate(), Shard(0)):
        local = torch.ones(4 if isinstance(placement, Shard) else 4 * world_size)
        param.grad = DTensor.from_local(local, mesh, [placement])
        groups, plain, _holds = walk.groups("k", [param], world_size)
        assert not plain
        ((_device, _dtype, replicas),) = groups
        counts.append(replicas)
    return counts


def test_replica_counts_are_remembered_per_layout_and_follow_a_changed_one() -> None:
    for counts in run_ranks(_rank_replica_counts_follow_the_gradients_layout, 2):
        assert counts == [1, 1, 2, 2, 1]
