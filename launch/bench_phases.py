"""Time each phase of the scaler's step, to see where its cost above the floor goes.

    torchrun --standalone --nproc-per-node 2 launch/bench_phases.py

On the 400-tensor FSDP2 workload of ``bench.py``: the gradient walk, the check kernel, the
agreement (its all-reduce beside a bare one), the counters and policy, and the whole
step+update. Each phase is timed on its own after a barrier; medians in ms, per rank.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from bench import NoOpOptimizer, Tensors
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from shardscale import ShardedGradScaler
from shardscale._check import check_and_unscale_
from shardscale._grads import collect_local_grads, optimizer_params


def _median_ms(run: Callable[[], object], iterations: int = 40) -> float:
    for _ in range(3):
        run()
    times = []
    for _ in range(iterations):
        dist.barrier()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e3, 3)


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cpu = torch.device("cpu")
    model = Tensors(400, 5_000, cpu)
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    model().backward()
    optimizer = NoOpOptimizer(model.parameters(), takes_scale=False)
    scaler = ShardedGradScaler(init_scale=1.0)
    scaler.scale(torch.ones(()))
    state = scaler._device_state
    assert state is not None
    groups = collect_local_grads(optimizer_params(optimizer))
    one, zero = torch.ones(()), torch.zeros(())
    flags = check_and_unscale_(groups, one)

    def walk() -> None:
        with torch.no_grad():
            collect_local_grads(optimizer_params(optimizer))

    def step_update() -> None:
        scaler.step(optimizer)
        scaler.update()

    phases = {
        "walk": walk,
        "check kernel": lambda: check_and_unscale_(groups, one),
        "agreement": lambda: scaler._agreement.agree([f.clone() for f in flags], True, cpu),
        "bare all-reduce": lambda: dist.all_reduce(zero.clone()),
        "counters + policy": lambda: (
            state.count_step_(zero),
            scaler.policy.update_(
                state.scale, state.growth_tracker, state.hysteresis_tracker, zero
            ),
        ),
        "step + update": step_update,
    }
    timings = {name: _median_ms(run) for name, run in phases.items()}
    print(f"rank {dist.get_rank()}: {timings}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
