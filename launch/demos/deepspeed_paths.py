"""DeepSpeed's torch-autocast fp16 path, stock and with shardscale, on 2 CPU ranks (gloo).

    DS_ACCELERATOR=cpu torchrun --standalone --nproc-per-node 2 launch/demos/deepspeed_paths.py

A small MLP with two parameter groups, ZeRO stage 1, 2 and 3 (`--stages`), clipping at 1.0,
`"torch_autocast": {"enabled": true, "dtype": "torch.float16"}`. Step 1 plants an inf in rank
0's gradient partition only. Once with DeepSpeed's own per-rank `torch.amp.GradScaler`
(`--compute-grad-norm false` for ZeRO 1 and 2 turns off DeepSpeed's all-reduced norm, the only
check that sees the other rank), once through `shardscale.integrations.deepspeed.use_shardscale`.
Printed per stage, path and rank: what each step did as the engine reports it, the scale, the
reported gradient norm, and how far the ranks' parameters are apart at the end.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from torch import nn

STEPS = 3


def build(stage: int, shardscale: bool, compute_grad_norm: bool) -> tuple[Any, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    groups = [{"params": model[0].parameters()}, {"params": model[2].parameters()}]
    zero: dict[str, Any] = {"stage": stage}
    if stage < 3:
        zero["compute_grad_norm"] = compute_grad_norm
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "zero_optimization": zero,
        "gradient_clipping": 1.0 if compute_grad_norm or stage == 3 else 0.0,
        "torch_autocast": {"enabled": True, "dtype": "torch.float16"},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**6,
    }
    optimizer = torch.optim.SGD(groups, lr=0.1)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    if shardscale:
        from shardscale.integrations.deepspeed import use_shardscale

        return engine, use_shardscale(engine)
    return engine, engine.optimizer.torch_autocast_gradscaler


def run(stage: int, shardscale: bool, compute_grad_norm: bool) -> dict[str, Any]:
    engine, scaler = build(stage, shardscale, compute_grad_norm)
    rank, steps = dist.get_rank(), []
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(4, 8, generator=generator), torch.randn(4, 4, generator=generator)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        if step == 1 and rank == 0:
            grads = [g for g in engine.optimizer.averaged_gradients[0] if g is not None]
            grads[0].view(-1)[0] = float("inf")
        engine.step()
        norm = engine.get_global_grad_norm()
        steps.append(
            {
                "applied": engine.was_step_applied(),
                "skipped_steps": engine.skipped_steps,
                "scale": scaler.get_scale(),
                "norm": None if norm is None else round(float(norm), 3),
            }
        )
    params = torch.cat([p.detach().flatten() for p in engine.module.parameters()])
    if stage == 3:
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            params = torch.cat([p.detach().flatten() for p in engine.module.parameters()])
    gathered = [torch.empty_like(params) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, params)
    return {"steps": steps, "rank_gap": float((gathered[0] - gathered[1]).abs().max())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    args = parser.parse_args()
    dist.init_process_group("gloo")
    cases = []
    for stage in args.stages:
        cases.append((stage, False, True))
        if stage < 3:
            cases.append((stage, False, False))
        cases.append((stage, True, True))
    for stage, shardscale, norm in cases:
        result = run(stage, shardscale, norm)
        record = {"stage": stage, "path": "shardscale" if shardscale else "stock"}
        record.update(compute_grad_norm=norm, rank=dist.get_rank(), **result)
        print(json.dumps(record), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
