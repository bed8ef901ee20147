"""Benchmark: the scaler's cost per step beside torch's two scalers and the floors.

Run on 2 ranks (gloo on CPU, NCCL on GPUs; picked automatically):

    torchrun --standalone --nproc-per-node 2 launch/rigs/bench.py            # the tables
    torchrun --standalone --nproc-per-node 2 launch/rigs/bench.py --phases   # phase by phase

Two FSDP2 workloads: (a) 20 M parameters in 8 tensors, (b) 2 M parameters in 400 tensors. The
optimizer is a no-op, so only the scaler is timed: ``step()`` + ``update()`` (and, in the clip
rows, ``clip_grad_norm_`` first) on the sharded gradients of one real backward (the scale is
held at 1.0 and the clip norm is never reached, so the gradients stay as they are). Two optimizer
kinds: a plain one (the scaler unscales in place) and a fused-style one
(``_step_supports_amp_scaling``: the scaler checks and hands over ``grad_scale``/``found_inf``).

Two gradient modes, the default loop's first: ``fresh`` (new gradient tensors every step, views
of the same reduce-scatter buffer, as FSDP2 makes after ``zero_grad()``, whose default is
``set_to_none=True``; made outside the timed region), then ``kept`` (the same gradient tensors
every step, as after ``zero_grad(set_to_none=False)``).

The floors, measured in the same run: the least any scaler that agrees across ranks must do.
step: one read+write pass over the local gradients plus one scalar all-reduce; clip: one read
pass (the norm), one read+write pass and one scalar all-reduce. Each is timed per tensor
(``_foreach_*``) and, where the gradients tile FSDP2's flat buffer, over the buffer; the step's
pass also by torch's check kernel (``_amp_foreach_non_finite_check_and_unscale_``, with a factor
of 1), which every scaler here runs on a step: it does the pass and more, yet over many small
tensors on the CPU it is the faster. The lowest is the floor. Reported per candidate: the median
time (the slowest rank's), its ratio to its floor, the collectives issued per step (counted by the
profiler) and, on CUDA, the kernels launched per step. Candidates are timed in interleaved
rounds, so drift on a shared machine falls on all of them alike. One more row per optimizer
kind, ours with ``underflow_every=1``, times a step of the underflow meter (by default one step
in 100): the meter's cost is its difference from ours, over 100.

``--phases`` times each phase of our step instead, to see where its cost above the floor goes
(CPU ranks on gloo, one thread each). On the 400-tensor workload, gradients kept and fresh,
through the public API only, as a user would time it: ``unscale_`` (the walk of the gradients and
the check kernel), ``step`` after it (the agreement: one all-reduce, then the decision; a
scaler's first ``unscale_`` agrees at once instead, and that step is not timed), ``update``
(counters and the policy), each timed within one real step that starts after a barrier, and
beside them what no scaler can avoid: torch's check kernel over the same gradients and a bare
all-reduce. ``unscale_`` less the kernel is the walk and the Python around it. Medians in ms, per
rank. Then, on rank 0 alone, the check kernel beside a bare multiply over both workloads'
shapes, per tensor and over one flat buffer, in fp32 and fp16: what the check itself costs
above the floor.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchShardedGradScaler
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile

from shardscale import ShardedGradScaler, count_collectives

# torch's fused check: multiply by inv_scale and raise found_inf in one pass, which all three
# scalers run on a step; called directly (the floors, --phases), it is the kernel's own cost.
check_and_unscale_ = torch._amp_foreach_non_finite_check_and_unscale_

WORKLOADS = {
    "a: 20M params / 8 tensors": (8, 2_500_000),
    "b: 2M params / 400 tensors": (400, 5_000),
}
MODES = ("fresh", "kept")  # the default loop first
METERED = "shardscale, a meter step (underflow_every=1)"
Run = Callable[[], None]


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

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        # an input, as every model has: torch 2.11's FSDP2 indexes its root's first argument on
        # CUDA (IndexError for a forward without one)
        return torch.stack([w.sum() for w in self.weights]).sum() * weight


def local_grads(model: nn.Module) -> list[torch.Tensor]:
    """This rank's local gradient tensors (FSDP2's shards), as the floors pass over them.

    ``_local_tensor`` is what ``DTensor.to_local()`` returns, without its dispatch overhead: the
    floor is the least a scaler must do, and the scaler reads the shards the same way.
    """
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return [g._local_tensor if isinstance(g, DTensor) else g for g in grads]


def _renew_grads(model: nn.Module) -> None:
    """New gradient tensors, views of the same buffer, as FSDP2 hands them over each step:
    new DTensors around new views, with the parameter's one sharding spec object
    (``FSDPParam.to_sharded_dtensor``)."""
    for param in model.parameters():
        grad = param.grad
        assert isinstance(grad, DTensor)
        local = grad._local_tensor
        param.grad = DTensor(local.view(local.shape), grad._spec, requires_grad=False)


def _time_once(prepare: Run | None, run: Run, device: torch.device) -> float:
    if prepare is not None:
        prepare()
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _slowest_median_ms(samples: list[float], device: torch.device) -> float:
    """The median over this rank's samples, maximised over ranks (the slowest rank gates); on
    ``device``, which the process group's backend serves (NCCL: a GPU)."""
    median = torch.tensor(statistics.median(samples) * 1e3, dtype=torch.float64, device=device)
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return float(median.item())


def _kernels(run: Run, device: torch.device) -> int | None:
    """CUDA kernels one call launches (None off CUDA)."""
    if device.type != "cuda":
        return None
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize(device)
    return sum(1 for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA)


def _scalers(device: torch.device) -> dict[str, Callable[[], Any]]:
    kwargs: dict[str, Any] = {"init_scale": 1.0, "growth_interval": 10**9}
    return {
        "shardscale.ShardedGradScaler": lambda: ShardedGradScaler(**kwargs),
        # every step a step of the underflow meter (by default one step in 100 is): its cost
        METERED: lambda: ShardedGradScaler(**kwargs, underflow_every=1),
        "torch.amp.GradScaler": lambda: torch.amp.GradScaler(device.type, **kwargs),
        "torch ShardedGradScaler": lambda: TorchShardedGradScaler(device.type, **kwargs),
    }


def _floors(model: nn.Module, device: torch.device) -> dict[tuple[str, str], Run]:
    """The step and clip floors, per tensor and over the flat buffer (where one is tiled); the
    step's pass also by torch's check kernel, which every scaler here runs."""
    flag = torch.zeros((), device=device)
    one = torch.ones((), device=device)

    def grads() -> list[torch.Tensor]:
        return local_grads(model)

    def buffers() -> list[torch.Tensor]:
        return list({id(g._base): g._base.view(-1) for g in grads()}.values())  # type: ignore[union-attr]

    floors: dict[tuple[str, str], Run] = {}
    for name, tensors in (("per tensor", grads), ("flat buffer", buffers)):

        def step(tensors: Callable[[], list[torch.Tensor]] = tensors) -> None:
            torch._foreach_mul_(tensors(), one)
            dist.all_reduce(flag)

        def clip(tensors: Callable[[], list[torch.Tensor]] = tensors) -> None:
            chosen = tensors()
            norm = torch.stack(torch._foreach_norm(chosen)).square().sum()
            torch._foreach_mul_(chosen, one)
            dist.all_reduce(norm)

        def check(tensors: Callable[[], list[torch.Tensor]] = tensors) -> None:
            check_and_unscale_(tensors(), flag, one)
            dist.all_reduce(flag)

        floors[(f"floor: one pass + all-reduce ({name})", "step")] = step
        floors[(f"floor: read pass + one pass + all-reduce ({name})", "clip")] = clip
        # the same pass by torch's check kernel: where it is the faster, it is the floor
        floors[(f"floor: one pass + all-reduce, by torch's check kernel ({name})", "step")] = check
    return floors


def bench_workload(
    count: int,
    numel: int,
    mode: str,
    device: torch.device,
    rounds: int,
    per_round: int,
    warmup: int,
) -> list[dict[str, Any]]:
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    model = Tensors(count, numel, device)
    fully_shard(model, mesh=mesh)
    model(torch.ones((), device=device)).backward()
    prepare = (lambda: _renew_grads(model)) if mode == "fresh" else None

    candidates: dict[tuple[str, str], Run] = dict(_floors(model, device))
    for takes_scale in (False, True):
        optimizer = NoOpOptimizer(model.parameters(), takes_scale=takes_scale)
        for name, make in _scalers(device).items():
            scaler = make()
            scaler.scale(torch.ones((), device=device))

            def step_update(scaler: Any = scaler, optimizer: Any = optimizer) -> None:
                scaler.step(optimizer)
                scaler.update()

            candidates[(name, "fused-style" if takes_scale else "plain")] = step_update
    # Clipping, to a norm never reached: ours in the flag's collective; torch's scalers
    # unscale_, then torch's clip_grad_norm_ over the DTensor parameters.
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

    collectives, kernels = {}, {}
    for key, run in candidates.items():
        for _ in range(warmup):
            _time_once(prepare, run, device)
        if prepare is not None:
            prepare()
        with count_collectives() as counts:
            run()
        collectives[key] = sum(counts.values())
        if prepare is not None:
            prepare()
        kernels[key] = _kernels(run, device)
    # Interleaved rounds: drift on a shared machine falls on every candidate alike.
    samples: dict[tuple[str, str], list[float]] = {key: [] for key in candidates}
    for _ in range(rounds):
        for key, run in candidates.items():
            samples[key].extend(_time_once(prepare, run, device) for _ in range(per_round))
    medians = {key: _slowest_median_ms(times, device) for key, times in samples.items()}
    floor_ms = {
        kind: min(ms for (name, k), ms in medians.items() if k == kind and name.startswith("floor"))
        for kind in ("step", "clip")
    }
    rows = []
    for (name, kind), ms in medians.items():
        of = "clip" if kind in ("clip", "plain + clip") else "step"
        rows.append(
            {
                "scaler": name,
                "optimizer": "-" if kind in ("step", "clip") else kind,
                "median_ms": ms,
                "x_floor": ms / floor_ms[of],
                "floor": of,
                "collectives": collectives[(name, kind)],
                "cuda_kernels": kernels[(name, kind)],
            }
        )
    return rows


# ------------------------------------------------------------------ --phases


def _median_ms(run: Callable[[], object], prepare: Run | None, iterations: int = 40) -> float:
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


def check_kernel_beside_multiply() -> None:
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
    prepare: Run | None,
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


def phases() -> None:
    """``--phases``: our step phase by phase beside the check kernel and a bare all-reduce, on
    CPU ranks (gloo, one thread each); then the kernel beside a bare multiply, on rank 0."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = Tensors(400, 5_000, torch.device("cpu"))
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
        check_kernel_beside_multiply()
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------ the tables


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20, help="interleaved rounds")
    parser.add_argument(
        "--per-round", type=int, default=5, help="timed steps per candidate per round"
    )
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps before measuring")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--json", help="also write the results to this JSON file (rank 0)")
    parser.add_argument(
        "--phases",
        action="store_true",
        help="time our step phase by phase instead of the tables (CPU ranks, gloo)",
    )
    return parser.parse_args()


def _init_group() -> torch.device:
    """NCCL and this rank's GPU where CUDA is there, else gloo on the CPU."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["WORLD_SIZE"])))
        dist.init_process_group("gloo")
    return device


def _print_tables(results: dict[str, Any], cuda: bool) -> None:
    print(
        f"world_size={results['world_size']} backend={results['backend']} "
        f"device={results['device']} torch={results['torch']} "
        f"threads/rank={results['threads_per_rank']}"
    )
    for label, rows in results["workloads"].items():
        print(f"\n### {label}\n")
        print(
            "| scaler | optimizer | median ms | x floor | collectives/step"
            + (" | CUDA kernels/step |" if cuda else " |")
        )
        print("|---|---|---:|---:|---:|" + ("---:|" if cuda else ""))
        for row in rows:
            print(
                f"| {row['scaler']} | {row['optimizer']} | {row['median_ms']:.3f} | "
                f"{row['x_floor']:.2f} ({row['floor']}) | {row['collectives']} |"
                + (f" {row['cuda_kernels']} |" if cuda else "")
            )


def main() -> None:
    args = _parse_args()
    if args.phases:
        phases()
        return
    device = _init_group()
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
        for mode in args.modes:
            results["workloads"][f"{label}, gradients {mode}"] = bench_workload(
                count, numel, mode, device, args.rounds, args.per_round, args.warmup
            )
    if dist.get_rank() == 0:
        _print_tables(results, cuda=device.type == "cuda")
        if args.json:
            with open(args.json, "w") as file:
                json.dump(results, file, indent=2)
    dist.barrier()  # no rank leaves while another still needs the group
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
