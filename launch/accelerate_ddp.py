"""Hugging Face accelerate with shardscale's scaler, including save_state / load_state.

accelerate makes its own scaler when ``mixed_precision="fp16"`` (torch's ``ShardedGradScaler``
for FSDP1, a plain ``torch.amp.GradScaler`` for FSDP2, whose ranks can disagree on a sharded
overflow). Replace it before ``prepare()``; accelerate then calls ours for ``backward``,
``clip_grad_norm_``'s unscale, ``optimizer.step()`` (``step_was_skipped`` works) and
``save_state``/``load_state``:

    accelerator = Accelerator(mixed_precision="fp16", fsdp_plugin=...)
    accelerator.scaler = ShardedGradScaler()
    model, optimizer = accelerator.prepare(model, optimizer)

On CPU, accelerate refuses fp16 ("fp16 mixed precision requires a device in (...)") and ignores
its FSDP plugin (the job stays ``MULTI_CPU``, i.e. DDP), so this example, run on CPU ranks, is a
DDP job with an fp32 model and shardscale's scaler set by hand; the scaler logic is the same:

    torchrun --standalone --nproc-per-node 2 launch/accelerate_ddp.py --state-dir /tmp/acc
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn

from shardscale import ShardedGradScaler


def build(accelerator: Accelerator) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return accelerator.prepare(model, optimizer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--inject-inf-at", type=int, default=3)
    parser.add_argument("--inject-rank", type=int, default=1)
    parser.add_argument("--state-dir", type=Path, required=True)
    args = parser.parse_args()

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    accelerator.scaler = ShardedGradScaler(init_scale=2.0**10, growth_interval=2)
    model, optimizer = build(accelerator)
    for step in range(1, args.steps + 1):
        optimizer.zero_grad()
        inputs = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
        loss = model(inputs.to(accelerator.device)).pow(2).mean()
        accelerator.backward(loss)  # scaler.scale(loss).backward()
        if step == args.inject_inf_at and accelerator.process_index == args.inject_rank:
            next(model.parameters()).grad.view(-1)[0] = math.inf
        accelerator.clip_grad_norm_(model.parameters(), 1.0)  # unscales through our scaler
        optimizer.step()  # scaler.step + scaler.update
        print(
            json.dumps(
                {
                    "rank": accelerator.process_index,
                    "step": step,
                    "skipped": optimizer.step_was_skipped,
                    "scale": accelerator.scaler.get_scale(),
                }
            ),
            flush=True,
        )
    accelerator.save_state(str(args.state_dir))
    saved = accelerator.scaler.state_dict()

    # A fresh job's view: new accelerator, new scaler, then load_state.
    resumed = Accelerator(cpu=not torch.cuda.is_available())
    resumed.scaler = ShardedGradScaler()
    build(resumed)
    resumed.load_state(str(args.state_dir))
    print(
        json.dumps(
            {
                "rank": accelerator.process_index,
                "resumed_equal": resumed.scaler.state_dict() == saved,
            }
        ),
        flush=True,
    )
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
