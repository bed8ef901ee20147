"""CUDA-only behaviour: marked, and skipped on machines without a GPU (CI has none).

Covers what CPU runs cannot: CUDA gradients, fused and capturable optimizers on the device,
zero host synchronisations on the fused path, CUDA-graph capture of step+update, CPU-offloaded
gradients beside CUDA ones, NCCL at world size 1, and NCCL agreement across two GPUs.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardscale import ShardedGradScaler, count_collectives
from tests.harness import run_ranks
from tests.setups import plant, step_and_report
from tests.test_reliability import _rank_one_rank_never_arrives

pytestmark = pytest.mark.gpu


def _cuda_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).cuda()


def _cuda_train(scaler: Any, options: dict[str, Any], steps: int = 8) -> tuple[list[float], Any]:
    model = _cuda_mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, **options)
    scales = []
    for step in range(steps):
        optimizer.zero_grad()
        inputs = torch.randn(4, 16, generator=torch.Generator().manual_seed(step)).cuda()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(inputs).float().pow(2).mean()
        scaler.scale(loss).backward()
        if step in (2, 5):
            plant(optimizer, math.inf)
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize(
    "options",
    [
        {"foreach": False},
        {"foreach": True},
        {"fused": True},
        {"capturable": True},
        {"fused": True, "capturable": True},
    ],
    ids=["for-loop", "foreach", "fused", "capturable", "fused-capturable"],
)
def test_cuda_matches_torch_bit_for_bit(options: dict[str, Any]) -> None:
    kwargs: dict[str, Any] = {"init_scale": 2.0**10, "growth_interval": 3}
    theirs = _cuda_train(torch.amp.GradScaler("cuda", **kwargs), options)
    ours = _cuda_train(ShardedGradScaler(**kwargs), options)
    assert ours[0] == theirs[0]
    for a, b in zip(ours[1], theirs[1], strict=True):
        assert torch.equal(a, b)


def test_cuda_fused_step_and_update_make_no_host_sync() -> None:
    model = _cuda_mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    scaler = ShardedGradScaler()
    for step in range(3):
        optimizer.zero_grad()
        scaler.scale(model(torch.randn(4, 16, device="cuda")).pow(2).mean()).backward()
        if step == 2:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            scaler.step(optimizer)
            scaler.update()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert not scaler.last_step_skipped


def test_cuda_graph_captures_fused_capturable_step_and_update() -> None:
    model = _cuda_mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True, capturable=True)
    scaler = ShardedGradScaler(init_scale=2.0**8, growth_interval=1000)
    static_input = torch.randn(4, 16, device="cuda")
    # warm up on a side stream, as torch's CUDA-graph recipe asks
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            optimizer.zero_grad(set_to_none=False)
            scaler.scale(model(static_input).pow(2).mean()).backward()
            scaler.step(optimizer)
            scaler.update()
    torch.cuda.current_stream().wait_stream(side)
    optimizer.zero_grad(set_to_none=False)
    scaler.scale(model(static_input).pow(2).mean()).backward()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        scaler.step(optimizer)
        scaler.update()
    before = [p.detach().clone() for p in model.parameters()]
    graph.replay()  # a clean step: parameters move
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    scale_before = scaler.get_scale()
    plant(optimizer, math.inf)  # the captured kernels read the same gradient tensors
    before = [p.detach().clone() for p in model.parameters()]
    graph.replay()  # an overflowing step: parameters hold, scale backs off
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    assert scaler.get_scale() == scale_before * 0.5


def test_cuda_and_cpu_gradients_one_flag_per_device_one_decision() -> None:
    """CPU-offloaded gradients beside CUDA ones: both devices checked, one skip decision."""
    on_gpu = nn.Parameter(torch.ones(4, device="cuda"))
    on_cpu = nn.Parameter(torch.ones(4))
    scaler = ShardedGradScaler(init_scale=4.0)
    scaler.scale(torch.tensor(1.0, device="cuda"))
    on_gpu.grad = torch.ones(4, device="cuda")
    on_cpu.grad = torch.tensor([1.0, math.nan, 1.0, 1.0])
    optimizer = torch.optim.SGD([on_gpu, on_cpu], lr=0.1)
    scaler.step(optimizer)
    scaler.update()
    assert scaler.last_step_skipped
    assert scaler.get_scale() == 2.0
    assert torch.equal(on_gpu.detach().cpu(), torch.ones(4))


def test_nccl_world_size_one_issues_no_collective() -> None:
    dist.init_process_group(
        "nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0)
    )
    try:
        scaler = ShardedGradScaler()
        model = _cuda_mlp()
        optimizer = torch.optim.AdamW(model.parameters(), fused=True)
        scaler.scale(model(torch.randn(2, 16, device="cuda")).sum()).backward()
        with count_collectives() as counts:
            scaler.step(optimizer)
            scaler.update()
        assert sum(counts.values()) == 0
    finally:
        dist.destroy_process_group()


def _rank_fsdp1_offload(rank: int, world_size: int) -> dict[str, Any]:
    """Two ranks share one GPU over gloo; FSDP1 offloads the flat parameters to the CPU."""
    from torch.distributed.fsdp import CPUOffload
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = FSDP(
        _cuda_mlp(), device_id=torch.device("cuda", 0), cpu_offload=CPUOffload(offload_params=True)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler(init_scale=8.0)
    scaler.scale(model(torch.randn(2, 16, device="cuda")).sum()).backward()
    devices = {p.grad.device.type for p in model.parameters() if p.grad is not None}
    if rank == 1:
        plant(optimizer, math.inf)
    scaler.step(optimizer)
    scaler.update()
    return {
        "devices": sorted(devices),
        "skipped": scaler.last_step_skipped,
        "scale": scaler.get_scale(),
    }


def test_fsdp1_cpu_offload_every_rank_skips() -> None:
    results = run_ranks(_rank_fsdp1_offload, 2)
    assert results == [{"devices": ["cpu"], "skipped": True, "scale": 4.0}] * 2


def _rank_nccl_agreement(rank: int, world_size: int) -> dict[str, Any]:
    model = _cuda_mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    scaler = ShardedGradScaler(init_scale=8.0)
    scaler.scale(model(torch.randn(2, 16, device="cuda")).sum()).backward()
    if rank == 1:
        plant(optimizer, math.inf)
    return step_and_report(scaler, optimizer)


@pytest.mark.nccl
def test_nccl_two_gpus_agree_at_one_collective() -> None:
    results = run_ranks(_rank_nccl_agreement, 2, backend="nccl")
    assert results == [{"skipped": True, "scale": 4.0, "collectives": 1}] * 2


@pytest.mark.nccl
def test_nccl_sync_timeout_missing_rank_raises() -> None:
    waiting, _ = run_ranks(
        _rank_one_rank_never_arrives, 2, "cuda", 3.0, backend="nccl", timeout_s=90
    )
    assert waiting["error"].startswith("step 1: waited 3 s for all 2 ranks")
    assert waiting["waited"] < 15
