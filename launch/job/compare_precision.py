"""Fidelity: fp32 against fp16 with shardscale and fp16 without loss scaling.

    python launch/job/compare_precision.py --plot runs/precision.png --json runs/precision.json

Trains the example job three times on the same seed and data: fp32, fp16 with
``shardscale.ShardedGradScaler``, and fp16 without scaling (the scaler's static guard, scale 1).
Reports each run's final training and held-out losses, skipped steps and the scaler's underflow
meter, read every step (``--underflow-every 1``): of the non-zero gradient elements, the fraction
below 2^-14 (fp16's smallest normal value) at the run's scale. In the fp32 run that is how much
of the gradient unscaled fp16 would leave subnormal or flush to zero; in the fp16 runs, how much
sits at the bottom of fp16's range (what already flushed to zero is not counted: a zero is the
same at every scale). As a table and a plot. Target: fp16 with shardscale within 1 % of fp32.

The loss is divided by ``--loss-divisor`` (default 4096), as when it is averaged over that many
times more tokens: a large global batch or gradient accumulation, where fp16 underflow bites.
AdamW's eps is divided alike, so fp32 training is unchanged (Adam is scale-invariant): only the
fp16 runs feel where their gradients now lie. Extra arguments go to ``launch/job/train.py``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import train

RUNS = {
    "fp32": ["--precision", "fp32"],
    "fp16 + shardscale": ["--precision", "fp16"],
    "fp16, no loss scaling": ["--precision", "fp16", "--no-loss-scaling"],
}


def _row(name: str, summary: dict[str, Any], baseline: dict[str, Any]) -> dict[str, Any]:
    history = summary["history"]
    late = history[-10:]
    return {
        "run": name,
        "final_loss": summary["final_loss"],
        "eval_loss": summary["eval_loss"],
        "vs_fp32": summary["eval_loss"] / baseline["eval_loss"] - 1.0,
        "skipped_steps": summary["skipped_steps"],
        "underflow": sum(h["underflow"] for h in late) / len(late),
        "final_scale": summary["final_scale"],
    }


def _plot(path: Path, summaries: dict[str, dict[str, Any]], divisor: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_axis, meter_axis) = plt.subplots(2, 1, sharex=True, figsize=(8, 6))
    styles = {"fp32": {"color": "black", "ls": "--", "lw": 1.5}}  # dashed: fp16 lies on it
    for name, summary in summaries.items():
        steps = [h["step"] for h in summary["history"]]
        style = styles.get(name, {"lw": 1})
        loss_axis.plot(steps, [h["loss"] for h in summary["history"]], label=name, **style)
        meter_axis.plot(steps, [h["underflow"] for h in summary["history"]], **style)
    loss_axis.set_ylabel("training loss")
    loss_axis.set_title(f"same seed and data; loss divided by {divisor:g}")
    loss_axis.legend()
    meter_axis.set_ylabel("non-zero gradient\nbelow 2^-14 (meter)")
    meter_axis.set_xlabel("step")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--loss-divisor", type=float, default=4096.0)
    parser.add_argument("--json", type=Path, help="write the table and histories here")
    parser.add_argument("--plot", type=Path, help="write a PNG of the three runs here")
    args, train_args = parser.parse_known_args()

    common = [
        "--steps",
        str(args.steps),
        "--parallel",
        "none",
        "--underflow-every",
        "1",
        "--loss-divisor",
        str(args.loss_divisor),
        "--log-every",
        str(args.steps),
        # No clipping: a clip threshold would not scale with the divisor, so fp32 training
        # would no longer be the same with and without it.
        "--clip-norm",
        "0",
        *train_args,
    ]
    summaries = {}
    for name, flags in RUNS.items():
        print(f"== {name}", flush=True)
        summaries[name] = train.main([*common, *flags])
    baseline = summaries["fp32"]
    rows = [_row(name, summary, baseline) for name, summary in summaries.items()]

    print(f"\n{args.steps} steps, loss divided by {args.loss_divisor:g}\n")
    columns = [
        "run",
        "final train loss",
        "held-out loss",
        "vs fp32",
        "skipped",
        "below 2^-14 (meter)",
        "final scale",
    ]
    print("| " + " | ".join(columns) + " |")
    print("|---" + "|---:" * (len(columns) - 1) + "|")
    for row in rows:
        print(
            f"| {row['run']} | {row['final_loss']:.4f} | {row['eval_loss']:.4f} | "
            f"{row['vs_fp32']:+.2%} | {row['skipped_steps']} | {row['underflow']:.1%} | "
            f"{row['final_scale']:g} |"
        )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rows": rows, "runs": summaries}, indent=2))
    if args.plot is not None:
        _plot(args.plot, summaries, args.loss_divisor)
    fp16 = rows[1]
    verdict = "met" if abs(fp16["vs_fp32"]) <= 0.01 else "NOT met"
    print(f"\ntarget (fp16 + shardscale within 1 % of fp32 held-out loss): {verdict}")


if __name__ == "__main__":
    main()
