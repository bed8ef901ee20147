"""CUDA-only behaviour: marked, and skipped on machines without a GPU (CI has none).

Covers what CPU runs cannot: CUDA gradients, fused and capturable optimizers on the device,
zero host synchronisations on the fused path (with and without ``clip_grad_norm_``), CUDA-graph
capture of step+update, CPU-offloaded gradients beside CUDA ones, fused AdamW over CPU parameters
with the scale on the GPU, FSDP2 over NCCL (world size 1, and with ``CPUOffloadPolicy``), stats
hooks on CUDA (from another current device where two GPUs exist), NCCL at world size 1, NCCL
agreement across two GPUs, a healthy NCCL run with ``sync_timeout`` (which only warns there), a
missing rank, ended by the process group's own timeout, and torch's scaler as the oracle on CUDA
(tests/test_torch_differential.py's scenarios with CUDA autocast and the fused and capturable
flavours, on one rank and on two sharing the GPU over gloo).

Written by reading torch's sources before any GPU was lent. On one H100 with torch 2.11
(2026-11-26, ``launch/rigs/gpu_check.sh``, docs/gpu.md) all that one GPU can run passed, after a fix
for CUDA-graph replays; the ``nccl`` ones (two GPUs) have never run. Where a test's confidence is
lower, its docstring says why.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardscale import ShardedGradScaler, count_collectives
from tests.drawn import derandomized
from tests.harness import RankFailure, run_ranks
from tests.setups import plant, step_and_report
from tests.test_torch_differential import SCENARIOS, on_cuda, rank_differential, run_scenario

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


def _rank_nccl_never_arrives(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 1 never calls step(); rank 0's all-reduce waits for it on the stream, the host at
    the step's read of the agreed flag."""
    import time

    model = _cuda_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler(sync_timeout=3.0)  # warns at the collective that it does not apply
    scaler.scale(model(torch.ones(2, 16, device="cuda")).sum()).backward()
    if rank == 1:
        time.sleep(120)
        return {}
    scaler.step(optimizer)
    return {"returned": True}


@pytest.mark.nccl
def test_nccl_missing_rank_is_ended_by_the_groups_own_timeout() -> None:
    """On NCCL the bound is the process group's timeout (here 5 s), enforced by NCCL's watchdog,
    which aborts the communicator and ends the waiting process (TORCH_NCCL_ASYNC_ERROR_HANDLING's
    default): no rank hangs, and the scaler's `sync_timeout` only warns that it does not apply
    (docs/reliability.md, "On NCCL")."""
    import time

    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 0 raised:\nexited with code"):
        run_ranks(_rank_nccl_never_arrives, 2, backend="nccl", group_timeout_s=5.0, timeout_s=100)
    assert time.monotonic() - start < 60


def _rank_nccl_sync_timeout_healthy(rank: int, world_size: int) -> dict[str, Any]:
    """A healthy run with a generous sync_timeout: same decisions, nothing times out."""
    import time

    model = _cuda_mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    scaler = ShardedGradScaler(init_scale=8.0, sync_timeout=300)
    skipped, seconds = [], []
    for step in range(4):
        optimizer.zero_grad()
        scaler.scale(model(torch.randn(2, 16, device="cuda")).sum()).backward()
        if step == 2 and rank == 1:
            plant(optimizer, math.inf)
        torch.cuda.synchronize()
        start = time.monotonic()
        scaler.step(optimizer)
        scaler.update()
        seconds.append(time.monotonic() - start)
        skipped.append(scaler.last_step_skipped)
    return {"skipped": skipped, "scale": scaler.get_scale(), "slowest_s": max(seconds[1:])}


@pytest.mark.nccl
def test_nccl_sync_timeout_healthy_run_agrees_and_never_times_out() -> None:
    results = run_ranks(_rank_nccl_sync_timeout_healthy, 2, backend="nccl")
    for result in results:
        assert result["skipped"] == [False, False, True, False]
        assert result["scale"] == 4.0  # backed off once; growth_interval 2000: never grows
        assert result["slowest_s"] < 5.0  # far below the 300 s bound: nothing waited it out


@pytest.mark.parametrize(
    ("options", "before_step"),
    [
        ({"fused": True}, None),
        ({"fused": True}, "clip"),
        ({"fused": True}, "unscale"),
        ({"fused": True, "capturable": True}, "clip"),
    ],
    ids=["fused", "fused-clip", "fused-unscale", "fused-capturable-clip"],
)
def test_cuda_fused_path_makes_no_host_sync(
    options: dict[str, Any], before_step: str | None
) -> None:
    """Step + update with fused AdamW, after `clip_grad_norm_` or `unscale_` or neither: the
    agreed flag, the fp64 device norm and the clip factor stay on the GPU;
    `set_sync_debug_mode("error")` raises on any synchronising call (`.item()`, a blocking copy
    to the host). The same cases as launch/rigs/gpu_check.sh's check, which runs without pytest."""
    model = _cuda_mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, **options)
    scaler = ShardedGradScaler()
    for step in range(3):
        optimizer.zero_grad()
        scaler.scale(model(torch.randn(4, 16, device="cuda")).pow(2).mean()).backward()
        if step == 2:  # after two warm-up steps: cached constants are made
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            if before_step == "clip":
                norm = scaler.clip_grad_norm_(model.parameters(), 1.0)
                assert norm.device.type == "cuda"
            elif before_step == "unscale":
                scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert not scaler.last_step_skipped


def _cpu_params_fused_adamw(scaler: Any, loss_device: str) -> tuple[list[Any], list[torch.Tensor]]:
    """Fused AdamW over CPU parameters (as with CPU offload) with the loss, hence the scale, on
    ``loss_device``; inf planted at steps 1 and 3. Parameters must never turn non-finite, and a
    skipped step must leave them as they were."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(64, 32)), nn.Parameter(torch.randn(32))]
    optimizer = torch.optim.AdamW(params, lr=0.05, fused=True)
    history: list[Any] = []
    for step in range(5):
        optimizer.zero_grad()
        loss_scale = float(scaler.scale(torch.ones((), device=loss_device)).item())
        for i, param in enumerate(params):
            seed = torch.Generator().manual_seed(10 * step + i)
            param.grad = torch.randn(param.shape, generator=seed) * loss_scale
        if step in (1, 3):
            plant(optimizer, math.inf)
        before = [p.detach().clone() for p in params]
        scaler.step(optimizer)
        scaler.update()
        assert all(bool(torch.isfinite(p).all()) for p in params), f"non-finite at step {step}"
        held = all(torch.equal(b, p) for b, p in zip(before, params, strict=True))
        history.append((scaler.get_scale(), held))
    return history, [p.detach().clone() for p in params]


def test_cuda_scale_fused_adamw_over_cpu_params_matches_torch_on_cpu() -> None:
    """The scale on the GPU, the parameters (and fused AdamW's CPU kernel) on the CPU: shardscale
    hands the optimizer its scale and flag already on the CPU (a blocking copy; audit W3), so
    the result is bit for bit torch's scaler run entirely on the CPU, where no copy races."""
    kwargs: dict[str, Any] = {"init_scale": 2.0**10, "growth_interval": 2}
    ours = _cpu_params_fused_adamw(ShardedGradScaler(**kwargs), "cuda")
    theirs = _cpu_params_fused_adamw(torch.amp.GradScaler("cpu", **kwargs), "cpu")
    assert [held for _, held in ours[0]] == [False, True, False, True, False]
    assert ours[0] == theirs[0]
    for a, b in zip(ours[1], theirs[1], strict=True):
        assert torch.equal(a, b)


def _fsdp2_train(model: nn.Module, scaler: Any, options: dict[str, Any]) -> dict[str, Any]:
    """Six steps, inf at steps 2 and 4, clipped; what the parent compares."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, **options)
    scales, finite, collectives = [], [], 0
    for step in range(6):
        optimizer.zero_grad()
        inputs = torch.randn(4, 16, generator=torch.Generator().manual_seed(step)).cuda()
        scaler.scale(model(inputs).float().pow(2).mean()).backward()
        if step in (2, 4):
            plant(optimizer, math.inf)
        if isinstance(scaler, ShardedGradScaler):
            scaler.clip_grad_norm_(model.parameters(), 1.0)
        else:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with count_collectives() as counts:
            scaler.step(optimizer)
            scaler.update()
        collectives += sum(counts.values())
        scales.append(scaler.get_scale())
        local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
        finite.append(all(bool(torch.isfinite(p).all()) for p in local))
    params = [
        (p.to_local() if hasattr(p, "to_local") else p).detach().float().cpu().reshape(-1)
        for p in model.parameters()
    ]
    return {"scales": scales, "finite": finite, "collectives": collectives, "params": params}


def _rank_fsdp2_nccl_world_of_one(
    rank: int, world_size: int, options: dict[str, Any], offload: bool
) -> dict[str, Any]:
    """FSDP2 on a one-rank NCCL mesh (optionally ``CPUOffloadPolicy``: parameters, gradients and
    the optimizer step on the CPU), against torch's ``GradScaler`` on the same model unsharded
    on the GPU. At world size 1 the shards are whole, so the parameters compare directly."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    mesh = init_device_mesh("cuda", (world_size,))
    policy = CPUOffloadPolicy() if offload else OffloadPolicy()
    model = _cuda_mlp()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, offload_policy=policy)
    fully_shard(model, mesh=mesh, offload_policy=policy)
    kwargs: dict[str, Any] = {"init_scale": 2.0**10, "growth_interval": 3}
    ours = _fsdp2_train(model, ShardedGradScaler(**kwargs), options)
    theirs = _fsdp2_train(_cuda_mlp(), torch.amp.GradScaler("cuda", **kwargs), options)
    gap = max(
        float((a - b).abs().max()) for a, b in zip(ours["params"], theirs["params"], strict=True)
    )
    grad_devices = sorted({p.grad.device.type for p in model.parameters() if p.grad is not None})
    return {
        "scales": [ours["scales"], theirs["scales"]],
        "finite": ours["finite"],
        "collectives": ours["collectives"],
        "gap": gap,
        "grad_devices": grad_devices,
    }


@pytest.mark.parametrize("offload", [False, True], ids=["on-gpu", "cpu-offload"])
@pytest.mark.parametrize("options", [{"foreach": True}, {"fused": True}], ids=["foreach", "fused"])
def test_fsdp2_nccl_world_of_one_matches_torch(options: dict[str, Any], offload: bool) -> None:
    """FSDP2 over NCCL, the production layout, at world size 1 (one GPU suffices): DTensor
    gradients, the fp64 device norm of ``clip_grad_norm_``, no collective of the scaler's own.
    With ``CPUOffloadPolicy`` and fused AdamW, the optimizer's CPU kernel gets the scale and the
    flag on the CPU (W3): the parameters never turn non-finite. Medium confidence for
    offload + fused: it relies on DTensor accepting the 0-dim CPU ``grad_scale``/``found_inf``
    beside CPU DTensor parameters in ``_fused_adamw_``. The parameters are compared within a
    tolerance: the clip norm is taken in fp64 here and in fp32 by torch, and offloaded steps run
    the CPU kernels."""
    if not dist.is_nccl_available():
        pytest.skip("needs NCCL")
    (result,) = run_ranks(_rank_fsdp2_nccl_world_of_one, 1, options, offload, backend="nccl")
    ours, theirs = result["scales"]
    assert ours == theirs == [1024.0, 1024.0, 512.0, 512.0, 256.0, 256.0]
    assert all(result["finite"])
    assert result["collectives"] == 0  # world size 1: nothing to agree with
    assert result["grad_devices"] == (["cpu"] if offload else ["cuda"])
    assert result["gap"] < 1e-4


def test_cuda_stats_hook_one_update_late_from_another_current_device() -> None:
    """The stats copy and its event go on the stream of the state's own GPU (audit M2): with two
    GPUs the loss lives on the last while the current device stays cuda:0, as on the async
    scaler's optimizer thread or in a script that never calls ``torch.cuda.set_device``; with
    one, both are cuda:0. Every hook gets its step's true numbers, one ``update()`` late."""
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    with torch.cuda.device(0):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
        scaler = ShardedGradScaler(init_scale=2.0**10, growth_interval=2, max_consecutive_skips=3)
        delivered: list[Any] = []
        scaler.register_stats_hook(delivered.append)
        for step in range(5):
            optimizer.zero_grad()
            scaler.scale(model(torch.randn(4, 16, device=device)).pow(2).mean()).backward()
            if step == 1:
                plant(optimizer, math.inf)
            scaler.step(optimizer)
            scaler.update()
            assert [stats.steps for stats in delivered] == list(range(1, step + 1))
            assert torch.cuda.current_device() == 0
        assert scaler.stats.steps == 5  # delivers the last step too
    assert [stats.steps for stats in delivered] == [1, 2, 3, 4, 5]
    assert [stats.last_step_skipped for stats in delivered] == [False, True, False, False, False]
    assert [stats.scale for stats in delivered] == [1024.0, 512.0, 512.0, 1024.0, 1024.0]
    assert [stats.consecutive_skips for stats in delivered] == [0, 1, 0, 0, 0]


# torch is the oracle on the device too: tests/test_torch_differential.py's scenarios with CUDA
# tensors and CUDA autocast, its fused and capturable flavours; counts sized for gpu_check.sh's
# one command (60 scenarios take 2.5 s on a CPU core; not yet run on a GPU).
GPU_DIFF_EXAMPLES = 60
GPU_DIFF_RANK_EXAMPLES = 12


def test_differential_against_torch_amp_grad_scaler_on_cuda() -> None:
    """Every call equal to `torch.amp.GradScaler("cuda")` bit for bit, or a documented row."""
    for scenario in derandomized(SCENARIOS, GPU_DIFF_EXAMPLES):
        run_scenario(on_cuda(scenario))


def test_differential_on_two_ranks_sharing_the_gpu_over_gloo() -> None:
    """Two ranks, one GPU, gloo carrying CUDA tensors: each rank equals torch at world size 1
    the same way (the 2-rank form of the CPU's test)."""
    scenarios = [
        on_cuda({**scenario, "ops": [op for op in scenario["ops"] if op[0] != "pickle"]})
        for scenario in derandomized(SCENARIOS, GPU_DIFF_RANK_EXAMPLES)
    ]
    rank0, rank1 = run_ranks(rank_differential, 2, scenarios, timeout_s=120 + 3 * len(scenarios))
    for scenario, mine, theirs in zip(scenarios, rank0, rank1, strict=True):
        assert isinstance(mine, list), mine
        assert mine == theirs, scenario
