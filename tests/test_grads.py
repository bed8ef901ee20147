"""The gradient walk: grouped afresh at every step, holding no gradient, padding never read."""

from __future__ import annotations

import gc
import math
import weakref
from typing import Any

import pytest
import torch
from torch import nn

from shardscale import ShardedGradScaler
from shardscale._clip import NormWalk
from shardscale._grads import grad_groups
from tests.harness import run_ranks


def _params_with_grads(grads: list[torch.Tensor]) -> list[nn.Parameter]:
    params = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad
    return params


def test_grad_walk_groups_by_device_and_dtype_and_replica_count() -> None:
    grads = [torch.zeros(4), torch.zeros(2, dtype=torch.float16), torch.zeros(8)]
    params = _params_with_grads(grads)
    params.append(nn.Parameter(torch.zeros(3)))  # no gradient: left out
    groups, held = grad_groups(params)
    cpu = torch.device("cpu")
    assert list(map(id, groups[(cpu, torch.float32)])) == [id(grads[0]), id(grads[2])]  # aliases
    assert list(map(id, groups[(cpu, torch.float16)])) == [id(grads[1])]
    assert held
    norms, plain, _held = NormWalk().groups(params, 2)
    assert set(norms) == {(cpu, torch.float32, 2), (cpu, torch.float16, 2)}
    assert plain  # plain tensors: their count is the caller's
    # an empty shard's gradient is held (torch records an inf check for it); none is not
    assert grad_groups(_params_with_grads([torch.zeros(0)]))[1] is True
    assert grad_groups([nn.Parameter(torch.zeros(3))])[1] is False


def _tiles(buffer: torch.Tensor, sizes: list[int], gap: int = 0) -> list[torch.Tensor]:
    """Views of `buffer` of `sizes`, back to back (`gap` elements left between them)."""
    views, start = [], 0
    for size in sizes:
        views.append(buffer[start : start + size].view(size // 2, 2))
        start += size + gap
    return views


def test_clip_groups_take_gradients_tiling_one_buffer_as_one_view() -> None:
    """FSDP2's shards of one reduce-scatter buffer, back to back, on the CPU: the clip's group
    is one view of exactly their elements; anything else is kept tensor by tensor."""
    cpu = torch.device("cpu")
    buffer = torch.arange(40, dtype=torch.float32)
    views = _tiles(buffer[2:], [4, 6, 8])  # not from the buffer's start
    (flat,) = NormWalk().groups(_params_with_grads(views), 1)[0][(cpu, torch.float32, 1)]
    assert flat.data_ptr() == views[0].data_ptr()
    assert torch.equal(flat, buffer[2:20])
    assert grad_groups(_params_with_grads(views))[0][(cpu, torch.float32)] == views
    not_tiled = {
        "a gap (FSDP2's padding)": _tiles(buffer, [4, 6], gap=2),
        "out of order": _tiles(buffer, [4, 6])[::-1],
        "not contiguous": [buffer[:4].view(2, 2), buffer[4:8].view(2, 2).t()],
        "separate tensors": [torch.zeros(4), torch.zeros(4)],
        "other buffers": [buffer[:4], torch.zeros(8)[4:8]],
        "the meta device": _tiles(torch.zeros(40, device="meta"), [4, 6]),
    }
    for why, grads in not_tiled.items():
        groups = NormWalk().groups(_params_with_grads(grads), 1)[0]
        assert list(map(id, next(iter(groups.values())))) == list(map(id, grads)), why


@pytest.mark.parametrize("overflow", [False, True])
def test_clip_of_tiled_gradients_matches_torch_and_reads_only_their_elements(
    overflow: bool,
) -> None:
    """Gradients tiling one buffer clip as torch clips them; an inf in a tile skips the step,
    an inf in the buffer past the last tile is never read."""
    results = {}
    for name in ("ours", "torch"):
        buffer = torch.arange(1.0, 25.0)
        buffer[18:] = math.inf  # past the tiles: no gradient's element
        views = _tiles(buffer, [4, 6, 8])
        if overflow:
            views[1][0, 0] = math.inf
        params = _params_with_grads(views)
        if name == "ours":
            scaler = ShardedGradScaler(init_scale=4.0)
            scaler.scale(torch.ones(()))
            norm = scaler.clip_grad_norm_(params, 10.0)
            scaler.step(torch.optim.SGD(params, lr=1.0))
            scaler.update()
            assert scaler.stats.skipped_steps == int(overflow)
        else:
            torch._foreach_mul_(views, 0.25)  # unscaled, as ours
            norm = torch.nn.utils.clip_grad_norm_(params, 10.0)
        results[name] = (float(norm), [view.clone() for view in views])
    (ours, our_grads), (torchs, torch_grads) = results.values()
    assert math.isinf(ours) if overflow else ours == pytest.approx(torchs)
    if not overflow:
        torch.testing.assert_close(our_grads, torch_grads)
        clipped = torch.cat([view.flatten() for view in our_grads]).norm()
        assert float(clipped) == pytest.approx(10.0)  # the norm was above it: clipped to it


def test_grad_walk_keeps_no_gradient_alive() -> None:
    params = _params_with_grads([torch.ones(4), torch.ones(4)])
    grad_groups(params)
    NormWalk().groups(params, 1)
    watched = weakref.ref(params[0].grad)  # type: ignore[arg-type]
    for param in params:
        param.grad = None  # zero_grad(set_to_none=True)
    gc.collect()
    assert watched() is None


def test_sparse_gradients_are_coalesced_in_place() -> None:
    embedding = nn.Embedding(10, 4, sparse=True)
    embedding(torch.tensor([1, 1, 2])).sum().backward()
    groups, _held = grad_groups(embedding.parameters())
    assert embedding.weight.grad.is_coalesced()  # type: ignore[union-attr]
    ((values,),) = groups.values()
    assert values.shape == (2, 4)  # rows 1 (twice, summed) and 2


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
    return {
        "identical": all(
            torch.equal(a, b) for a, b in zip(results["ours"], results["torch"], strict=True)
        )
    }


@pytest.mark.parametrize("even", [True, False])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_fsdp2_matches_torch_bit_for_bit(even: bool, set_to_none: bool) -> None:
    """New gradients every step or the same ones, shards padded or not."""
    results = run_ranks(_rank_fsdp2_train, 2, even, set_to_none)
    assert all(result["identical"] for result in results)


def _rank_padding_is_never_read(rank: int, world_size: int) -> dict[str, Any]:
    """An inf written into FSDP2's shard padding (not a gradient element) must not skip, nor
    make the clip's norm infinite."""
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
        scaler.clip_grad_norm_(model.parameters(), 1e9)  # nor is it read by the clip's norm
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
    walk = NormWalk()
    counts = []
    # a new, equal spec each time (DTensor.from_local); the placements change in the middle
    for placement in (Shard(0), Shard(0), Replicate(), Replicate(), Shard(0)):
        local = torch.ones(4 if isinstance(placement, Shard) else 4 * world_size)
        param.grad = DTensor.from_local(local, mesh, [placement])
        groups, plain, _held = walk.groups([param], world_size)
        assert not plain
        ((_device, _dtype, replicas),) = groups
        counts.append(replicas)
    return counts


def test_replica_counts_are_remembered_per_layout_and_follow_a_changed_one() -> None:
    for counts in run_ranks(_rank_replica_counts_follow_the_gradients_layout, 2):
        assert counts == [1, 1, 2, 2, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_check_only_of_large_cpu_gradients_flags_exactly_what_the_kernel_flags(
    dtype: torch.dtype,
) -> None:
    """A check without unscaling (fused optimizers) reads large CPU tensors by their sums: a sum
    that overflows over finite elements is no overflow, an inf or NaN anywhere is, and nothing
    is written."""
    from shardscale._grads import Kernels

    cpu, n = torch.device("cpu"), 1 << 16
    top = torch.finfo(dtype).max
    cases: list[tuple[list[tuple[int, int, float]], float]] = [
        ([], 0.0),  # float32 and bfloat16: every sum overflows, every element is finite
        ([(1, 777, math.inf)], 1.0),
        ([(1, 777, -math.inf)], 1.0),
        ([(0, n - 1, math.nan)], 1.0),
        ([(0, 3, math.inf), (1, 5, -math.inf)], 1.0),  # sums of opposite signs
    ]
    for planted, expected in cases:
        grads = [torch.full((n,), top, dtype=dtype), torch.full((n,), -top, dtype=dtype)]
        for tensor, index, value in planted:
            grads[tensor][index] = value
        before = [g.clone() for g in grads]
        flags = Kernels().check_({(cpu, dtype): grads}, None, {})
        assert flags[cpu].item() == expected, planted
        for grad, old in zip(grads, before, strict=True):
            torch.testing.assert_close(grad, old, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("overflow", [False, True])
def test_fused_optimizer_over_large_cpu_gradients_steps_as_torchs_scaler(overflow: bool) -> None:
    """A fused CPU AdamW over a large gradient (checked by its sum) steps, or skips on an inf,
    exactly as under torch's GradScaler."""
    weights = torch.randn(1 << 17)
    runs = []
    for make in (
        lambda: ShardedGradScaler(init_scale=2.0**10),
        lambda: torch.amp.GradScaler("cpu", init_scale=2.0**10),
    ):
        param = nn.Parameter(weights.clone())
        optimizer = torch.optim.AdamW([param], lr=0.1, fused=True)
        scaler = make()
        scaler.scale((param * param).sum()).backward()
        if overflow:
            grad = param.grad
            assert grad is not None
            grad[4321] = math.inf
        scaler.step(optimizer)
        scaler.update()
        runs.append((param.detach().clone(), scaler.get_scale()))
    (ours, our_scale), (theirs, their_scale) = runs
    assert torch.equal(ours, theirs)
    assert our_scale == their_scale
    assert torch.equal(ours, weights) == overflow  # skipped, or stepped
