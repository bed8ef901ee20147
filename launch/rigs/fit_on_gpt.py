"""The fit judged on the GPT job: torch's scaler, the interval rule, the fit and fp32, seed by seed.

    torchrun --standalone --nproc-per-node 2 launch/rigs/fit_on_gpt.py \\
        --json runs/fit_on_gpt.json --plot docs/img/fit_on_gpt.png

The example job's GPT (launch/job: real text, FSDP2 over 2 gloo ranks, AdamW, fp16 autocast on
the CPU, gradients clipped to a global norm of 1) trains ``--steps`` steps under each policy, as
its users configure it, from the same initial weights and batches for a seed, and once in fp32:

* `torch.amp.GradScaler`: its defaults (2^16, double after 2,000 clean steps), with torch's
  `unscale_` + `clip_grad_norm_`;
* `shardscale.ShardedGradScaler()`: its default, the interval rule (torch's rule);
* `shardscale.ShardedGradScaler(scale_policy="fit")`: the scale that fits the gradients;
* fp32: no autocast, no scaler.

Per run: the skipped steps; the steps until the scale settles (from where on it stays within 2x
of its last value); the held-out loss at the end (the job's own evaluation), against the fp32
run's of the same seed; and on one more backward (a held-out batch, not stepped) at the scale
the policy ends at: the weight gradients' underflow, counted here as the meter defines it (of the
non-zero elements in 2^-64 ... 2^64, scaled, those below 2^-14: an independent count, every
rank's), and the three modules whose activation gradients lose the most to fp16's range
(`shardscale.watch_activations`); for the fit, its learned margin and the largest gradient of
its window at the end. One table, the mean and the spread over the seeds (the worst module seed
by seed); optionally a JSON file of every run and a plot of the scale against the step (the
first seed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import shardscale

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "job"))
import train
from lm_data import Batches, build_corpus

TORCH, INTERVAL, FIT, FP32 = (
    "torch.amp.GradScaler",
    "shardscale (interval)",
    'shardscale, scale_policy="fit"',
    "fp32",
)
POLICIES = (TORCH, INTERVAL, FIT, FP32)


def _job(policy: str, seed: int, device: torch.device) -> tuple[train.Job, Batches]:
    """`policy`'s run: the job's own model, wrapping, optimizer, data and seed; its scaler."""
    precision = "fp32" if policy == FP32 else "fp16"
    args = train.parse_args(["--precision", precision, "--seed", str(seed)])
    job = train.build_job(args, device)
    scaler: Any = None
    if policy == TORCH:
        scaler = torch.amp.GradScaler("cpu")
    elif policy in (INTERVAL, FIT):
        scale_policy = "fit" if policy == FIT else "interval"
        scaler = shardscale.ShardedGradScaler(scale_policy=scale_policy, underflow_every=0)
    fields = {name: getattr(job, name) for name in train.Job.__dataclass_fields__}
    batches = Batches(build_corpus(), args.seq_len, args.batch_size, args.seed)
    return train.Job(**{**fields, "scaler": scaler}), batches


def _step(job: train.Job, inputs: torch.Tensor, targets: torch.Tensor) -> float:
    """One step as each policy's users write it; returns the scale it ran at."""
    job.optimizer.zero_grad(set_to_none=True)
    scaler = job.scaler
    with job.autocast():
        loss = train.lm_loss(job.model(inputs), targets)
    if scaler is None:  # fp32
        loss.backward()
        torch.nn.utils.clip_grad_norm_(job.model.parameters(), 1.0)
        job.optimizer.step()
        return 1.0
    scale = scaler.get_scale()
    scaler.scale(loss).backward()
    if isinstance(scaler, shardscale.ShardedGradScaler):
        scaler.clip_grad_norm_(job.model.parameters(), 1.0)
    else:
        scaler.unscale_(job.optimizer)
        torch.nn.utils.clip_grad_norm_(job.model.parameters(), 1.0)
    scaler.step(job.optimizer)
    scaler.update()
    return float(scale)


def _steps_taken(optimizer: torch.optim.Optimizer) -> float:
    state = optimizer.state.get(optimizer.param_groups[0]["params"][0], {})
    return float(state.get("step", 0))


def _settled(scales: list[float]) -> int:
    """Steps until the scale stays within 2x of its last value."""
    last = scales[-1]
    for step in range(len(scales), 0, -1):
        if not last / 2 <= scales[step - 1] <= last * 2:
            return step
    return 0


def _weight_underflow(model: torch.nn.Module) -> float:
    """Of every rank's non-zero weight-gradient elements in 2^-64 ... 2^64 (as they are: scaled),
    the fraction below 2^-14."""
    counts = torch.zeros(2, dtype=torch.float64)
    for param in model.parameters():
        grad = param.grad
        if grad is None:
            continue
        local = grad.to_local() if isinstance(grad, torch.distributed.tensor.DTensor) else grad
        magnitudes = local.detach().abs().float()
        counted = (magnitudes >= 2.0**-64) & (magnitudes <= 2.0**64)
        counts += torch.stack([(counted & (magnitudes < 2.0**-14)).sum(), counted.sum()]).double()
    dist.all_reduce(counts)
    return float(counts[0] / counts[1]) if counts[1] else 0.0


def _probe(job: train.Job, batches: Batches, scale: float) -> dict[str, Any]:
    """One more backward, of a held-out batch at `scale`, not stepped."""
    inputs, targets = (t.to(job.device) for t in batches.held_out_batches(1)[0])
    job.optimizer.zero_grad(set_to_none=True)
    with shardscale.watch_activations(job.model) as watch:
        with job.autocast():
            loss = train.lm_loss(job.model(inputs), targets)
        (loss * scale).backward()
    worst = [(r.name, r.fraction, r.dtype) for r in watch.records[:3]]
    underflow = _weight_underflow(job.model)
    job.optimizer.zero_grad(set_to_none=True)
    return {"underflow": underflow, "worst_activations": worst}


def run(policy: str, seed: int, steps: int, device: torch.device) -> dict[str, Any]:
    """One run of `policy` from `seed`: its record."""
    job, batches = _job(policy, seed, device)
    scales, skipped = [], []
    for step in range(steps):
        batch = batches.train_batch(step, job.data_rank, job.data_ranks)
        inputs, targets = (t.to(device) for t in batch)
        before = _steps_taken(job.optimizer)
        scales.append(_step(job, inputs, targets))
        skipped.append(_steps_taken(job.optimizer) == before)
    final_scale = job.scaler.get_scale() if job.scaler is not None else 1.0
    held_out = train._evaluate(job.model, None, batches, 8, device, job.autocast)
    return {
        "policy": policy,
        "seed": seed,
        "skips": sum(skipped),
        "settled": _settled(scales) if job.scaler is not None else 0,
        "final_scale": final_scale,
        "held_out_loss": held_out,
        "scales": scales,
        **_probe(job, batches, final_scale),
        **_fit_state(job.scaler),
    }


def _fit_state(scaler: Any) -> dict[str, Any]:
    """The fit's learned margin (in powers of two) and the largest gradient of its window, at
    the end: why it holds the scale it holds."""
    if not isinstance(scaler, shardscale.ShardedGradScaler):
        return {}
    state = scaler.state_dict()
    if state.get("scale_policy") != "fit":
        return {}
    window = [float(peak) for peak in state["_fit_window"]]
    return {"fit_margin": int(state["_fit_margin"]), "fit_window_peak": max(window)}


def _cell(values: list[float], form: str) -> str:
    """The mean over the seeds, and the spread (max - min) where there are several."""
    mean = statistics.fmean(values)
    return form.format(mean) + (
        f" ({form.format(max(values) - min(values))})" if len(values) > 1 else ""
    )


def table(records: list[dict[str, Any]], steps: int, seeds: int) -> str:
    """The markdown table: per policy, the mean (and spread) over the seeds."""
    fp32 = {r["seed"]: r["held_out_loss"] for r in records if r["policy"] == FP32}
    lines = [
        f"| policy (GPT job, {steps} steps, {seeds} seeds) | skipped steps | steps to a settled "
        "scale | final scale | held-out loss vs fp32 | weight gradients below 2^-14 | the worst "
        "activation gradient, seed by seed (its fraction below 2^-14) |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for policy in POLICIES:
        mine = [r for r in records if r["policy"] == policy]
        gaps = [r["held_out_loss"] / fp32[r["seed"]] - 1.0 for r in mine]
        scales = sorted({f"2^{math.log2(r['final_scale']):g}" for r in mine})
        by_seed = sorted(mine, key=lambda record: record["seed"])
        worst = "; ".join("{} {:.2%}".format(*r["worst_activations"][0][:2]) for r in by_seed)
        lines.append(
            f"| {policy} | {_cell([r['skips'] for r in mine], '{:.1f}')} "
            f"| {_cell([r['settled'] for r in mine], '{:.0f}')} | {', '.join(scales)} "
            f"| {_cell(gaps, '{:+.2%}')} | {_cell([r['underflow'] for r in mine], '{:.2%}')} "
            f"| {worst} |"
        )
    return "\n".join(lines)


def _plot(records: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 4))
    first = min(r["seed"] for r in records)
    for record in records:
        if record["seed"] == first and record["policy"] != FP32:
            axis.plot([math.log2(s) for s in record["scales"]], label=record["policy"])
    axis.set_xlabel("step")
    axis.set_ylabel("log2 scale")
    axis.set_title(f"the GPT job, seed {first}: the scale each policy holds")
    axis.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=90)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write every run here")
    parser.add_argument("--plot", type=Path, help="write the plot here (needs matplotlib)")
    args = parser.parse_args()
    device = train._init_distributed()
    records = [
        run(policy, seed, args.steps, device) for seed in range(args.seeds) for policy in POLICIES
    ]
    if dist.get_rank() == 0:
        print(f"torch {torch.__version__}, {dist.get_world_size()} gloo ranks, the job's defaults")
        print(table(records, args.steps, args.seeds))
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(records, indent=1))
        if args.plot:
            _plot(records, args.plot)
    sys.stdout.flush()
    os._exit(0)  # skip gloo's teardown, which can hang on some machines after a clean run


if __name__ == "__main__":
    main()
