"""Time each phase of the scaler's step, to see where its cost above the floor goes.

    torchrun --standalone --nproc-per-node 2 launch/bench/bench_phases.py

On the 400-tensor FSDP2 workload of ``bench.py``, gradients kept and fresh: the gradient walk,
the check kernel, the agreement (its all-reduce beside a bare one), the counters and policy, and
the whole step+update. Each phase is timed on its own after a barrier; medians in ms, per rank.
Then, on rank 0 alone, the check kernel beside a bare multiply over both workloads' shapes, per
tensor and over one flat buffer, in fp32 and fp16: what the check itself costs above the floor.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
from bench import NoOpOptimizer, Tensors, _renew_grads
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from shardscale import ShardedGradScaler
from shardscale._check import check_and_unscale_
from shardscale._walk import GradCache


def _median_ms(
    run: Callable[[], object], prepare: Callable[[], None] | None, iterations: int = 40
) -> float:
    times = []
    for i in range(iterations + 3):
        if prepare is not None:
            prepare()
        dist.barrier()
        start = time.perf_counter()
        run()
        if i >= 3:
            times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e3, 3)


def _kernel_ms(run: Callable[[], object], iterations: int = 30) -> float:
    times = []
    for i in range(iterations + 3):
        start = time.perf_counter()
        run()
        if i >= 3:
            times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e3, 3)


def kernels() -> None:
    """Median ms of the check-and-unscale kernel and of a bare multiply, one thread."""
    one, cpu = torch.ones(()), torch.device("cpu")
    for count, numel in ((8, 1_250_000), (400, 2_500)):
        for dtype in (torch.float32, torch.float16):
            grads = [torch.randn(numel).mul_(0.01).to(dtype) for _ in range(count)]
            flat = torch.cat(grads)
            per_tensor, whole = {(cpu, dtype): grads}, {(cpu, dtype): [flat]}
            timings = {
                "multiply, per tensor": _kernel_ms(partial(torch._foreach_mul_, grads, one)),
                "check, per tensor": _kernel_ms(partial(check_and_unscale_, per_tensor, one)),
                "multiply, flat": _kernel_ms(partial(flat.mul_, one)),
                "check, flat": _kernel_ms(partial(check_and_unscale_, whole, one)),
            }
            print(f"kernels {count} x {numel} {dtype}: {timings}", flush=True)


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cpu = torch.device("cpu")
    model = Tensors(400, 5_000, cpu)
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    model().backward()
    optimizer = NoOpOptimizer(model.parameters(), takes_scale=False)
    scaler = ShardedGradScaler(init_scale=1.0, growth_interval=10**9)
    scaler.scale(torch.ones(()))
    state = scaler._device_state
    assert state is not None
    params = list(model.parameters())
    one, zero = torch.ones(()), torch.zeros(())
    cache = GradCache()

    def step_update() -> None:
        scaler.step(optimizer)
        scaler.update()

    def agreement() -> None:
        ballot = scaler._agreement.ballot(cpu, holds_grads=True, has_scale=True)
        scaler._agreement.agree(ballot, {}, device=cpu, step=1)

    for mode, prepare in (("kept", None), ("fresh", lambda: _renew_grads(model))):
        phases = {
            "walk (cached)": lambda: cache.walk("k", params),
            "check kernel": lambda: check_and_unscale_(cache.walk("k", params).groups, one),
            "agreement": agreement,
            "bare all-reduce": lambda: dist.all_reduce(zero.clone()),
            "counters + policy": lambda: (
                state.count_step_(zero),
                scaler.policy.update_(
                    state.scale, state.growth_tracker, state.hysteresis_tracker, zero
                ),
            ),
            "step + update": step_update,
        }
        timings = {name: _median_ms(run, prepare) for name, run in phases.items()}
        print(f"rank {dist.get_rank()} gradients {mode}: {timings}", flush=True)
    dist.barrier()
    if dist.get_rank() == 0:
        kernels()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
