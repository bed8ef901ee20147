"""Scale policies side by side: how fast each finds the scale that fits the gradients, how often
it skips a batch, and how much of the gradient underflows meanwhile.

    torchrun --standalone --nproc-per-node 2 launch/rigs/scale_policies.py \\
        --json runs/scale_policies.json --plot docs/img/scale_policies.png

A small MLP (fp16 autocast on the CPU, DDP over gloo, AdamW) learns a fixed teacher on the same
batches under each policy, and once in fp32. The policies, each as its users configure it:

* `torch.amp.GradScaler`: double after 2,000 clean steps, halve on an overflow;
* verl: torch's scaler with `growth_interval=400`, as verl hard-codes it;
* Megatron-LM: a window of 1,000 clean steps, hysteresis 2, floor 1, skipping forever there
  (`shardscale.ShardedGradScaler(growth_interval=1000, hysteresis=2, min_scale=1.0,
  max_overflows_at_floor=None)`, which is that policy);
* `shardscale.ShardedGradScaler()`: its default, torch's rule agreed across ranks;
* `shardscale.ShardedGradScaler(scale_policy="fit")`: the scale that fits the gradients.

The *working scale* is the largest power of two at which a backward of the current weights on
the next 8 steps' batches makes no inf or NaN gradient on any rank: probed by running the
backwards at 2^40, 2^39, ... until all are finite (outside training). Three runs per policy:

1. **steady, then shrink**: start at the working scale and train `--steady` steps (skipped steps
   in its first 1,000 steps, then per 1,000); then multiply the loss by 1e-3 (gradients 1,000x
   smaller; AdamW's moments and eps are rescaled alike, so fp32 training does not change) and
   train `--recover` steps: steps until the scale
   is within 2x of the working scale probed at the shrink, skips on the way, and the fraction of
   gradient elements that are non-zero in an fp32 backward and zero in the fp16 backward at the
   policy's scale (same weights, same batch; every 10th step of the recovery), and that are
   below fp16's normal range (2^-14) once scaled (the bottom of the range, where precision
   thins out before the flush), beside what ours read from their underflow meter on that step
   (`stats.underflow`: the step's own fp16 backward, every rank's non-zero elements; ours run
   with `underflow_every=1` here, the default being 100);
2. **cold start at 1**, and 3. **cold start at 2^32**: steps and skips until within 2x of the
   working scale of the starting weights (`--recover` steps at most);
4. **a loss summed over the batch**, times 2^20 (a summed token loss: gradients so large that
   fp16 overflows at scale 1), from the default 2^16 for `--summed` steps: skips, and steps
   taken of the last 100;
5. **a NaN at every scale** (one weight's gradient planted NaN after every backward: a bug, not an
   overflow), from 2^16 for up to `--nan` steps: where the run ends (an error, and at which step)
   or the scale it holds after skipping every step.

A policy that has not arrived when its run ends is reported as `>N`, with the doublings it still
needed (times its growth interval: the steps a blind rule would take). The final loss (the mean
of the last 100 steps of run 1, the shrink undone) is compared with the fp32 run's. One table,
optionally a JSON file and a plot of the scale (log2) against the step, the working scale marked.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shardscale import ShardedGradScaler, ShardScaleWarning

SHRINK = 1e-3
BATCH, WIDTH, DEPTH = 64, 128, 4
WARM_UP = 1000
"""Steps of the steady run before its skips are counted per 1,000 (their own column)."""
PROBE_BATCHES = 8
"""The working scale is probed on this many consecutive steps' batches (the largest scale at
which none of them overflows), so one lucky batch does not set it."""
SUMMED_GAIN = 2.0**20
"""Run 4's loss: the squared errors summed over the batch (64 rows, 128 outputs), times this."""
LOSS_GAIN = 32.0
"""The loss is the MSE times this, so that the working scale at the start is about 2^18 (the
issue's MLP): the shrink then brings the scaled gradients' small end near fp16's subnormals."""
Scaler = Any  # torch.amp.GradScaler or ShardedGradScaler
POLICIES: dict[str, tuple[Callable[[float], Scaler], int]] = {
    # name: (make it at an initial scale, its growth interval)
    "torch.amp.GradScaler": (lambda s: torch.amp.GradScaler("cpu", init_scale=s), 2000),
    "verl (growth_interval=400)": (
        lambda s: torch.amp.GradScaler("cpu", init_scale=s, growth_interval=400),
        400,
    ),
    "Megatron-LM (window 1000, hysteresis 2, floor 1)": (
        lambda s: ShardedGradScaler(
            init_scale=s,
            growth_interval=1000,
            hysteresis=2,
            min_scale=1.0,
            max_overflows_at_floor=None,
        ),
        1000,
    ),
    # ours read the underflow meter every step here (by default every 100th), so that its
    # reading stands beside this script's own fp32 count at every probe
    "shardscale (default)": (lambda s: ShardedGradScaler(init_scale=s, underflow_every=1), 2000),
    'shardscale, scale_policy="fit"': (
        lambda s: ShardedGradScaler(init_scale=s, scale_policy="fit", underflow_every=1),
        2000,
    ),
}


class MLP(nn.Sequential):
    def __init__(self) -> None:
        layers: list[nn.Module] = []
        for _ in range(DEPTH - 1):
            layers += [nn.Linear(WIDTH, WIDTH), nn.GELU()]
        super().__init__(*layers, nn.Linear(WIDTH, WIDTH))


def batch(step: int, rank: int, teacher: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of `step` on `rank`: the same under every policy."""
    generator = torch.Generator().manual_seed(1_000_003 * step + rank)
    inputs = torch.randn(BATCH, WIDTH, generator=generator)
    with torch.no_grad():
        return inputs, teacher(inputs)


def loss_of(
    model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, fp16: bool, summed: bool = False
) -> Any:
    with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
        outputs = model(inputs).float()
    if summed:
        return nn.functional.mse_loss(outputs, targets, reduction="sum") * SUMMED_GAIN
    return nn.functional.mse_loss(outputs, targets) * LOSS_GAIN


def grads(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, fp16: bool, scale: float):
    """This rank's gradients of one backward (fp16 autocast at `scale`, or fp32), not training."""
    loss = loss_of(model, inputs, targets, fp16) * scale
    return torch.autograd.grad(loss, list(model.parameters()))


def working_scale(model: nn.Module, batches: list[Any], factor: float) -> float:
    """The largest power of two whose fp16 backward is finite on every rank and batch."""
    for exponent in range(40, -1, -1):
        finite = all(
            all(bool(g.isfinite().all()) for g in grads(model, x, y, True, factor * 2.0**exponent))
            for x, y in batches
        )
        flag = torch.tensor([0.0 if finite else 1.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() == 0.0:
            return 2.0**exponent
    return 1.0


def underflow(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, scale: float):
    """Of the gradient elements non-zero in an fp32 backward (every rank's), the fractions that
    are zero in the fp16 backward at `scale` (the loss's factor included), and that are below
    fp16's normal range (2^-14) once scaled: flushed, and at the bottom of the range."""
    g16 = grads(model, inputs, targets, True, scale)
    g32 = grads(model, inputs, targets, False, scale)
    counts = torch.zeros(3, dtype=torch.float64)
    for a, b in zip(g16, g32, strict=True):
        nonzero = b != 0
        flushed, subnormal = nonzero & (a == 0), nonzero & (b.abs() < 2.0**-14)
        counts += torch.tensor([float(flushed.sum()), float(subnormal.sum()), float(nonzero.sum())])
    dist.all_reduce(counts)
    return float(counts[0] / counts[2]), float(counts[1] / counts[2])


def train(
    make: Callable[[float], Scaler] | None,
    init_scale: float,
    steps: int,
    teacher: nn.Module,
    shrink_at: int | None = None,
) -> dict[str, Any]:
    """One run from the same initial weights; `make` None: fp32, no scaler."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = MLP()
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = make(init_scale) if make is not None else None
    scales, skipped, losses, flushed = [], [], [], []
    working_at_shrink = None
    for step in range(steps):
        shrunk = shrink_at is not None and step >= shrink_at
        factor = SHRINK if shrunk else 1.0
        if step == shrink_at:  # AdamW's state in the new units: fp32 training is unchanged
            optimizer.param_groups[0]["eps"] *= SHRINK
            for state in optimizer.state.values():
                state["exp_avg"].mul_(SHRINK)
                state["exp_avg_sq"].mul_(SHRINK**2)
        inputs, targets = batch(step, rank, teacher)
        if step == shrink_at and scaler is not None:
            probes = [batch(step + k, rank, teacher) for k in range(PROBE_BATCHES)]
            working_at_shrink = working_scale(model, probes, factor)
        scale = scaler.get_scale() if scaler is not None else 1.0
        probe = scaler is not None and shrunk and (step - shrink_at) % 10 == 0  # type: ignore[operator]
        if probe:
            flushed.append([step, *underflow(model, inputs, targets, factor * scale), None])
        optimizer.zero_grad()
        loss = loss_of(ddp, inputs, targets, scaler is not None)
        before = _steps_taken(optimizer)
        if scaler is None:
            (loss * factor).backward()
            optimizer.step()
        else:
            scaler.scale(loss * factor).backward()
            scaler.step(optimizer)
            scaler.update()
            stats = getattr(scaler, "stats", None)  # ours: the meter read this very step
            if probe and stats is not None and stats.underflow_step == stats.steps:
                flushed[-1][-1] = stats.underflow
        scales.append(scale)
        skipped.append(_steps_taken(optimizer) == before)
        losses.append(float(loss.detach()))
    return {
        "scales": scales,
        "skipped": skipped,
        "losses": losses,
        "flushed": flushed,
        "working_at_shrink": working_at_shrink,
    }


def train_range(make: Callable[[float], Scaler], steps: int, teacher: nn.Module, nan: bool) -> Any:
    """Run 4 (`nan` False: the summed loss) or 5 (a NaN planted in one weight's gradient after
    every backward), from 2^16, on the same batches: what each step did, and how it ended."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = MLP()
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = make(2.0**16)
    taken, error = [], None
    for step in range(steps):
        inputs, targets = batch(step, rank, teacher)
        optimizer.zero_grad()
        scaler.scale(loss_of(ddp, inputs, targets, True, summed=not nan)).backward()
        if nan:
            model[0].weight.grad[0, 0] = math.nan
        before = _steps_taken(optimizer)
        try:
            scaler.step(optimizer)
            scaler.update()
        except RuntimeError as caught:  # ours: ShardScaleNonFiniteError
            error = f"{type(caught).__name__} at step {step + 1}"
            break
        taken.append(_steps_taken(optimizer) > before)
    finite = all(bool(p.isfinite().all()) for p in model.parameters())
    return {
        "skips": taken.count(False),
        "last_100": sum(taken[-100:]),
        "steps": len(taken),
        "scale": scaler.get_scale(),
        "error": error,
        "weights_finite": finite,
    }


def _steps_taken(optimizer: torch.optim.Optimizer) -> float:
    state = optimizer.state.get(optimizer.param_groups[0]["params"][0], {})
    return float(state.get("step", 0))


def arrival(run: dict[str, Any], start: int, target: float, interval: int) -> dict[str, Any]:
    """Steps from `start` until the scale is within 2x of `target`, and skips on the way."""
    scales, skipped = run["scales"][start:], run["skipped"][start:]
    for offset, scale in enumerate(scales):
        if target / 2 <= scale <= target:
            return {"steps": offset, "skips": sum(skipped[:offset]), "arrived": True}
    last = scales[-1]
    doublings = max(0, math.ceil(math.log2(target / 2 / last))) if last < target / 2 else 0
    return {
        "steps": len(scales),
        "skips": sum(skipped),
        "arrived": False,
        "doublings_left": doublings,
        "blind_steps_left": doublings * interval,
    }


def _cell(arrived: dict[str, Any]) -> str:
    if arrived["arrived"]:
        return f"{arrived['steps']} ({arrived['skips']} skipped)"
    extra = (
        f", {arrived['doublings_left']} doublings = {arrived['blind_steps_left']:,} steps left"
        if arrived["doublings_left"]
        else ", still above"
    )
    return f">{arrived['steps']} ({arrived['skips']} skipped{extra})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steady", type=int, default=3000, help="steps before the shrink")
    parser.add_argument("--recover", type=int, default=1000, help="steps after it; cold runs")
    parser.add_argument("--summed", type=int, default=300, help="steps of the summed loss")
    parser.add_argument("--nan", type=int, default=200, help="steps at most with a NaN planted")
    parser.add_argument("--json", type=Path, help="write the rows and the runs here")
    parser.add_argument("--plot", type=Path, help="write the plot here (needs matplotlib)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    warnings.simplefilter("ignore", ShardScaleWarning)  # run 5's floor warning: in the table
    rank = dist.get_rank()
    torch.manual_seed(1234)
    teacher = MLP()
    for p in teacher.parameters():  # a teacher whose outputs are O(1)
        p.data.mul_(1.5)
    torch.manual_seed(0)
    start_weights = MLP()
    first = [batch(k, rank, teacher) for k in range(PROBE_BATCHES)]
    working0 = working_scale(start_weights, first, 1.0)
    total = args.steady + args.recover
    fp32 = train(None, 1.0, total, teacher, shrink_at=args.steady)
    fp32_loss = sum(fp32["losses"][-100:]) / len(fp32["losses"][-100:])
    rows, runs = [], {"fp32": fp32}
    for name, (make, interval) in POLICIES.items():
        main_run = train(make, working0, total, teacher, shrink_at=args.steady)
        cold1 = train(make, 1.0, args.recover, teacher)
        cold32 = train(make, 2.0**32, args.recover, teacher)
        summed = train_range(make, args.summed, teacher, nan=False)
        nan = train_range(make, args.nan, teacher, nan=True)
        runs[name] = {"main": main_run, "cold 1": cold1, "cold 2^32": cold32}
        warm = min(WARM_UP, args.steady // 2)
        first_skips = sum(main_run["skipped"][:warm])
        steady_skips = sum(main_run["skipped"][warm : args.steady]) * 1000 / (args.steady - warm)
        final = sum(main_run["losses"][-100:]) / len(main_run["losses"][-100:])
        flushed = [f for _, f, _, _ in main_run["flushed"]]
        subnormal = [f for _, _, f, _ in main_run["flushed"]]
        metered = [(f, m) for _, _, f, m in main_run["flushed"] if m is not None]
        rows.append(
            {
                "policy": name,
                "first_skips": first_skips,
                "steady_skips_per_1000": steady_skips,
                "shrink": arrival(main_run, args.steady, main_run["working_at_shrink"], interval),
                "flushed_mean": sum(flushed) / max(1, len(flushed)),
                "subnormal_mean": sum(subnormal) / max(1, len(subnormal)),
                # the meter's reading (fp16 backward) beside the fp32 count, at the same probes
                "meter_mean": sum(m for _, m in metered) / len(metered) if metered else None,
                "meter_max_gap": max((abs(m - f) for f, m in metered), default=None),
                "cold_1": arrival(cold1, 0, working0, interval),
                "cold_2_32": arrival(cold32, 0, working0, interval),
                "summed": summed,
                "nan": nan,
                "final_loss": final,
                "vs_fp32": final / fp32_loss - 1.0,
            }
        )
    if rank == 0:
        _report(rows, working0, runs, args, fp32_loss)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip gloo's teardown, which can hang on some machines after a clean run


def _report(
    rows: list[dict[str, Any]], working0: float, runs: dict[str, Any], args: Any, fp32_loss: float
) -> None:
    world = dist.get_world_size()
    print(
        f"{world} gloo ranks, torch {torch.__version__}; MLP {DEPTH} x {WIDTH}, batch {BATCH} per "
        f"rank; working scale at the start 2^{int(math.log2(working0))}; steady {args.steady} "
        f"steps, then the loss x {SHRINK:g}, {args.recover} steps; cold starts {args.recover} steps"
    )
    print(
        f"\n| policy | skips, first {min(WARM_UP, args.steady // 2)} steps | skips per 1,000 after "
        "| after the 1,000x shrink: steps to within 2x "
        "| zero in fp16, non-zero in fp32 | subnormal in fp16 | the meter (its largest gap) "
        "| from 1 | from 2^32 | final loss vs fp32 |"
    )
    print("|---|---:|---:|---|---:|---:|---:|---|---|---:|")
    for row in rows:
        meter = "-"
        if row["meter_mean"] is not None:
            meter = f"{row['meter_mean']:.2%} ({row['meter_max_gap']:.3%})"
        print(
            f"| {row['policy']} | {row['first_skips']} | {row['steady_skips_per_1000']:.2f} "
            f"| {_cell(row['shrink'])} "
            f"| {row['flushed_mean']:.2%} | {row['subnormal_mean']:.2%} | {meter} "
            f"| {_cell(row['cold_1'])} | {_cell(row['cold_2_32'])} "
            f"| {row['vs_fp32']:+.2%} |"
        )
    print(f"\nfp32 final loss {fp32_loss:.5f}")
    print(
        f"\n| policy | summed loss from 2^16: skipped of {args.summed} | steps taken of the "
        f"last 100 | its scale then | a NaN at every scale, from 2^16 (at most {args.nan} steps) |"
    )
    print("|---|---:|---:|---:|---|")
    for row in rows:
        summed, nan = row["summed"], row["nan"]
        ended = nan["error"] or f"skipped {nan['skips']} of {nan['steps']}, scale {nan['scale']:g}"
        ended += "" if nan["weights_finite"] else ", weights NaN"
        print(
            f"| {row['policy']} | {summed['skips']} | {summed['last_100']} "
            f"| 2^{math.log2(summed['scale']):g} | {ended} |"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rows": rows, "working_scale": working0}, indent=1))
    if args.plot:
        _plot(runs, working0, args)


def _plot(runs: dict[str, Any], working0: float, args: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(15, 4.2), sharey=True)
    panels = (
        ("main", "steady, then the loss x 1e-3"),
        ("cold 1", "cold start at 1"),
        ("cold 2^32", "cold start at 2^32"),
    )
    for axis, (key, title) in zip(axes, panels, strict=True):
        for name in POLICIES:
            run = runs[name][key]
            axis.plot([math.log2(s) for s in run["scales"]], label=name, linewidth=1.2)
        axis.axhline(math.log2(working0), color="grey", linestyle=":", linewidth=1)
        if key == "main":
            shrink = runs[next(iter(POLICIES))]["main"]["working_at_shrink"]
            axis.axvline(args.steady, color="grey", linewidth=0.8)
            axis.hlines(
                math.log2(shrink),
                args.steady,
                args.steady + args.recover,
                color="black",
                linestyle=":",
            )
        axis.set_title(title)
        axis.set_xlabel("step")
    axes[0].set_ylabel("log2 scale (dotted: the working scale)")
    axes[0].legend(fontsize=8)
    figure.tight_layout()
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(args.plot, dpi=90)


if __name__ == "__main__":
    main()
