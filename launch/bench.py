"""Benchmark: the scaler's cost per step beside torch's two scalers and the floor.

Run on 2 ranks (gloo on CPU, NCCL on GPUs; picked automatically):

    torchrun --standalone --nproc-per-node 2 launch/bench.py

Two FSDP2 workloads: (a) 20 M parameters in 8 tensors, (b) 2 M parameters in 400 tensors. The
optimizer is a no-op, so only the scaler is timed: ``step()`` + ``update()`` after one real
backward whose sharded gradients are reused (the scale is held at 1.0 so unscaling leaves them
unchanged). Two optimizer kinds: a plain one (the scaler unscales in place) and a fused-style
one (``_step_supports_amp_scaling``: the scaler checks and hands over ``grad_scale``/``found_inf``).

The floor, measured in the same run: one ``_foreach_mul_`` pass over the local gradients plus one
scalar all-reduce, the least any scaler that agrees across ranks must do. Reported per scaler: the
median time of step+update (the slowest rank's), its ratio to the floor, and the collectives
issued per step (counted by the profiler). Candidates are timed in interleaved rounds, so drift
on a shared machine falls on all of them alike.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchShardedGradScaler
from torch.distributed.tensor import DTensor

from shardscale import ShardedGradScaler, count_collectives

WORKLOADS = {
    "a: 20M params / 8 tensors": (8, 2_500_000),
    "b: 2M params / 400 tensors": (400, 5_000),
}


class NoOpOptimizer(torch.optim.Optimizer):
    """Steps nothing, so the scaler's own work is all that is timed."""

    def __init__(self, params: Any, takes_scale: bool) -> None:
        super().__init__(params, {})
        # True: behave like a fused optimizer, which takes grad_scale/found_inf itself.
        self._step_supports_amp_scaling = takes_scale

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        return None


class Tensors(nn.Module):
    """``count`` parameters of ``numel`` elements each, in one FSDP2 group."""

    def __init__(self, count: int, numel: int, device: torch.device) -> None:
        super().__init__()
        self.weights = nn.ParameterList(
            nn.Parameter(torch.randn(numel // 100, 100, device=device) * 0.01) for _ in range(count)
        )

    def forward(self) -> torch.Tensor:
        return torch.stack([w.sum() for w in self.weights]).sum()


def _local_grads(model: nn.Module) -> list[torch.Tensor]:
    grads = []
    for param in model.parameters():
        assert param.grad is not None
        grad = param.grad
        grads.append(grad.to_local() if isinstance(grad, DTensor) else grad)
    return grads


def _time_once(run: Callable[[], None], device: torch.device) -> float:
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _slowest_median_ms(samples: list[float]) -> float:
    """The median over this rank's samples, maximised over ranks (the slowest rank gates)."""
    median = torch.tensor(statistics.median(samples) * 1e3, dtype=torch.float64)
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return float(median.item())


def _scalers(device: torch.device) -> dict[str, Callable[[], Any]]:
    kwargs: dict[str, Any] = {"init_scale": 1.0, "growth_interval": 10**9}
    return {
        "shardscale.ShardedGradScaler": lambda: ShardedGradScaler(**kwargs),
        "torch.amp.GradScaler": lambda: torch.amp.GradScaler(device.type, **kwargs),
        "torch ShardedGradScaler": lambda: TorchShardedGradScaler(device.type, **kwargs),
    }


def bench_workload(
    count: int, numel: int, device: torch.device, rounds: int, per_round: int, warmup: int
) -> list[dict[str, Any]]:
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    model = Tensors(count, numel, device)
    fully_shard(model, mesh=mesh)
    model().backward()
    grads = _local_grads(model)
    one = torch.ones((), device=device)
    flag = torch.zeros((), device=device)

    def floor() -> None:
        torch._foreach_mul_(grads, one)
        dist.all_reduce(flag)

    candidates: dict[tuple[str, str], Callable[[], None]] = {
        ("floor (one _foreach pass + scalar all-reduce)", "-"): floor
    }
    for takes_scale in (False, True):
        optimizer = NoOpOptimizer(model.parameters(), takes_scale=takes_scale)
        for name, make in _scalers(device).items():
            scaler = make()
            scaler.scale(torch.ones((), device=device))

            def step_update(scaler: Any = scaler, optimizer: Any = optimizer) -> None:
                scaler.step(optimizer)
                scaler.update()

            candidates[(name, "fused-style" if takes_scale else "plain")] = step_update
    # With gradient clipping (to a norm never reached, so the gradients stay as they are):
    # ours in the flag's collective; torch's scalers unscale_, then torch's clip_grad_norm_.
    optimizer = NoOpOptimizer(model.parameters(), takes_scale=False)
    for name, make in _scalers(device).items():
        scaler = make()
        scaler.scale(torch.ones((), device=device))

        def clip_step_update(scaler: Any = scaler, optimizer: Any = optimizer) -> None:
            if isinstance(scaler, ShardedGradScaler):
                scaler.clip_grad_norm_(model.parameters(), 1e30)
            else:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1e30)
            scaler.step(optimizer)
            scaler.update()

        candidates[(name, "plain + clip")] = clip_step_update

    collectives = {}
    for key, run in candidates.items():
        for _ in range(warmup):
            run()
        with count_collectives() as counts:
            run()
        collectives[key] = sum(counts.values())
    # Interleaved rounds: drift on a shared machine falls on every candidate alike.
    samples: dict[tuple[str, str], list[float]] = {key: [] for key in candidates}
    for _ in range(rounds):
        for key, run in candidates.items():
            samples[key].extend(_time_once(run, device) for _ in range(per_round))
    medians = {key: _slowest_median_ms(times) for key, times in samples.items()}
    floor_ms = medians[next(iter(candidates))]
    return [
        {
            "scaler": name,
            "optimizer": optimizer_kind,
            "median_ms": ms,
            "x_floor": ms / floor_ms,
            "collectives": collectives[(name, optimizer_kind)],
        }
        for (name, optimizer_kind), ms in medians.items()
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20, help="interleaved rounds")
    parser.add_argument(
        "--per-round", type=int, default=5, help="timed steps per candidate per round"
    )
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps before measuring")
    parser.add_argument("--json", help="also write the results to this JSON file (rank 0)")
    args = parser.parse_args()

    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["WORLD_SIZE"])))
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    results: dict[str, Any] = {
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads_per_rank": torch.get_num_threads(),
        "workloads": {},
    }
    for label, (count, numel) in WORKLOADS.items():
        results["workloads"][label] = bench_workload(
            count, numel, device, args.rounds, args.per_round, args.warmup
        )
    if dist.get_rank() == 0:
        print(
            f"world_size={results['world_size']} backend={results['backend']} "
            f"device={results['device']} torch={results['torch']} "
            f"threads/rank={results['threads_per_rank']}"
        )
        for label, rows in results["workloads"].items():
            print(f"\n### {label}\n")
            print("| scaler | optimizer | median ms per step | x floor | collectives/step |")
            print("|---|---|---:|---:|---:|")
            for row in rows:
                print(
                    f"| {row['scaler']} | {row['optimizer']} | {row['median_ms']:.3f} | "
                    f"{row['x_floor']:.2f} | {row['collectives']} |"
                )
        if args.json:
            with open(args.json, "w") as file:
                json.dump(results, file, indent=2)
    dist.barrier()  # no rank leaves while another still needs the group
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
