"""accelerate in fp16 with shardscale's scaler: skips reported with a fused AdamW, state resumed.

    torchrun --standalone --nproc-per-node 2 launch/demos/accelerate_fp16.py --state-dir /tmp/acc

``use_shardscale(accelerator)`` before ``prepare()`` (``shardscale.integrations.accelerate``):
accelerate then calls shardscale's scaler for ``backward``, ``clip_grad_norm_``'s unscale,
``optimizer.step()`` and ``save_state``/``load_state``; a fused AdamW's skipped steps are reported
(``step_was_skipped``) and the prepared LR scheduler holds on them. On CPU ranks accelerate runs
DDP (``MULTI_CPU``), in real fp16 autocast here. An inf is written into rank 1's gradient after
DDP's reduction at ``--inject-inf-at``; every rank prints one JSON line per step.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch
from _common import leave, plant
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from torch import nn

from shardscale.integrations.accelerate import use_shardscale


def build() -> tuple[Accelerator, Any, Any, Any]:
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision="fp16")
    use_shardscale(accelerator, init_scale=2.0**10, growth_interval=2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    return accelerator, model, optimizer, scheduler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--inject-inf-at", type=int, default=3)
    parser.add_argument("--inject-rank", type=int, default=1)
    parser.add_argument("--state-dir", type=Path, required=True)
    args = parser.parse_args()

    accelerator, model, optimizer, scheduler = build()
    seen: dict[str, str] = {}  # accelerate casts the model's outputs back to fp32: look inside
    first = accelerator.unwrap_model(model)[0]
    first.register_forward_hook(lambda module, inputs, output: seen.update(dtype=str(output.dtype)))
    for step in range(1, args.steps + 1):
        optimizer.zero_grad()
        inputs = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
        with accelerator.autocast():
            output = model(inputs.to(accelerator.device))
        accelerator.backward(output.float().pow(2).mean())  # scaler.scale(loss).backward()
        if step == args.inject_inf_at and accelerator.process_index == args.inject_rank:
            plant(model.parameters())  # an inf in this rank's gradient alone
        norm = accelerator.clip_grad_norm_(model.parameters(), 1e6)  # after unscale_
        optimizer.step()  # scaler.step + update; skips are reported for fused AdamW too
        scheduler.step()  # accelerate's wrapper: holds when the optimizer step was skipped
        record = {
            "rank": accelerator.process_index,
            "step": step,
            "skipped": optimizer.step_was_skipped,
            "scale": accelerator.scaler.get_scale(),
            "lr": scheduler.get_last_lr()[0],
            "compute_dtype": seen["dtype"],
            "norm_unscaled": bool(math.isfinite(norm.item()) and norm.item() < 100.0),
        }
        print(json.dumps(record), flush=True)
    accelerator.save_state(str(args.state_dir))
    saved = accelerator.scaler.state_dict()
    accelerator.wait_for_everyone()

    # A fresh job's view: new accelerator and scaler, then load_state.
    AcceleratorState._reset_state(True)
    resumed, *_ = build()
    resumed.load_state(str(args.state_dir))
    equal = resumed.scaler.state_dict() == saved
    print(json.dumps({"rank": resumed.process_index, "resumed_equal": equal}), flush=True)
    resumed.wait_for_everyone()


if __name__ == "__main__":
    main()
    leave()  # past torch's C++ teardown, which may abort at exit (_common.py)
