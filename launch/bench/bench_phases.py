"""Time each phase of the scaler's step, to see where its cost above the floor goes.

    torchrun --standalone --nproc-per-node 2 launch/bench/bench_phases.py

On the 400-tensor FSDP2 workload of ``bench.py``, gradients kept and fresh, through the public
API only, as a user would time it: ``unscale_`` (the walk of the gradients and the check kernel),
``step`` after it (the agreement: one all-reduce, then the decision; a scaler's first
``unscale_`` agrees at once instead, and that step is not timed), ``update`` (counters and
the policy), each timed within one real step that starts after a barrier, and beside them what no
scaler can avoid: torch's check kernel over the same gradients and a bare all-reduce. ``unscale_``
less the kernel is the walk and the Python around it. Medians in ms, per rank. Then, on rank 0
alone, the check kernel beside a bare multiply over both workloads' shapes, per tensor and over
one flat buffer, in fp32 and fp16: what the check itself costs above the floor.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
from bench import NoOpOptimizer, Tensors, _renew_grads, check_and_unscale_, local_grads
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from shardscale import ShardedGradScaler


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
    one, flag = torch.ones(()), torch.zeros(())
    for count, numel in ((8, 1_250_000), (400, 2_500)):
        for dtype in (torch.float32, torch.float16):
            grads = [torch.randn(numel).mul_(0.01).to(dtype) for _ in range(count)]
            flat = torch.cat(grads)
            timings = {
                "multiply, per tensor": _kernel_ms(partial(torch._foreach_mul_, grads, one)),
                "check, per tensor": _kernel_ms(partial(check_and_unscale_, grads, flag, one)),
                "multiply, flat": _kernel_ms(partial(flat.mul_, one)),
                "check, flat": _kernel_ms(partial(check_and_unscale_, [flat], flag, one)),
            }
            print(f"kernels {count} x {numel} {dtype}: {timings}", flush=True)


def step_phases(
    scaler: ShardedGradScaler,
    optimizer: torch.optim.Optimizer,
    prepare: Callable[[], None] | None,
    iterations: int = 40,
) -> dict[str, float]:
    """Median ms of ``unscale_``, ``step`` and ``update``, each timed within one real step."""
    times: dict[str, list[float]] = {"unscale_": [], "step": [], "update": []}
    for i in range(iterations + 3):
        if prepare is not None:
            prepare()
        dist.barrier()
        t0 = time.perf_counter()
        scaler.unscale_(optimizer)
        t1 = time.perf_counter()
        scaler.step(optimizer)
        t2 = time.perf_counter()
        scaler.update()
        t3 = time.perf_counter()
        if i >= 3:
            for name, spent in zip(times, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                times[name].append(spent)
    return {name: round(statistics.median(ts) * 1e3, 3) for name, ts in times.items()}


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cpu = torch.device("cpu")
    model = Tensors(400, 5_000, cpu)
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    model(torch.ones(())).backward()
    optimizer = NoOpOptimizer(model.parameters(), takes_scale=False)
    scaler = ShardedGradScaler(init_scale=1.0, growth_interval=10**9)
    scaler.scale(torch.ones(()))
    one, flag, zero = torch.ones(()), torch.zeros(()), torch.zeros(())

    def step_update() -> None:
        scaler.step(optimizer)
        scaler.update()

    for mode, prepare in (("kept", None), ("fresh", lambda: _renew_grads(model))):
        timings = step_phases(scaler, optimizer, prepare)
        timings |= {
            "check kernel (per tensor, gather incl.)": _median_ms(
                lambda: check_and_unscale_(local_grads(model), flag, one), prepare
            ),
            "bare all-reduce": _median_ms(lambda: dist.all_reduce(zero.clone()), prepare),
            "step + update": _median_ms(step_update, prepare),
        }
        print(f"rank {dist.get_rank()} gradients {mode}: {timings}", flush=True)
    dist.barrier()
    if dist.get_rank() == 0:
        kernels()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
