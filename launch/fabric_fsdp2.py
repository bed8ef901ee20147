"""Lightning Fabric: FSDP2 (``ModelParallelStrategy``) in fp16, unlocked by shardscale's scaler.

Fabric refuses ``ModelParallelStrategy`` with ``precision="16-mixed"`` ("does not support
Fabric(..., precision='16-mixed')"): torch has no scaler for DTensor gradients that keeps ranks
agreeing. A precision *plugin* is not checked against that list, so passing Fabric's own
``MixedPrecision("16-mixed", ...)`` with a ``shardscale.ShardedGradScaler`` gives fp16 FSDP2:

    torchrun --standalone --nproc-per-node 2 launch/fabric_fsdp2.py --inject-inf-at 3

Every rank prints the same skip decisions and scales; an inf planted in one rank's shard skips
the step on all of them. Fabric's ``FSDPStrategy`` (FSDP1) takes the scaler the same way, through
``FSDPPrecision("16-mixed", scaler=...)``, but Fabric allows FSDP1 only on GPUs.
"""

from __future__ import annotations

import argparse
import json
import math

import lightning as L
import torch
from lightning.fabric.plugins.precision.amp import MixedPrecision
from lightning.fabric.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from shardscale import ShardedGradScaler


def parallelize(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """FSDP2 over the data-parallel dimension of Fabric's mesh, one unit per linear layer."""
    data_parallel = mesh["data_parallel"]
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=data_parallel)
    fully_shard(model, mesh=data_parallel)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument(
        "--inject-inf-at", type=int, default=0, help="step to plant an inf (0: never)"
    )
    parser.add_argument("--inject-rank", type=int, default=1)
    parser.add_argument("--accelerator", default="cpu")
    args = parser.parse_args()

    scaler = ShardedGradScaler(init_scale=2.0**10)
    fabric = L.Fabric(
        accelerator=args.accelerator,
        devices=2,
        strategy=ModelParallelStrategy(parallelize, data_parallel_size=2, tensor_parallel_size=1),
        plugins=MixedPrecision("16-mixed", args.accelerator, scaler=scaler),
    )
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    for step in range(1, args.steps + 1):
        optimizer.zero_grad()
        inputs = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
        with fabric.autocast():
            loss = model(inputs.to(fabric.device)).float().pow(2).mean()
        fabric.backward(loss)  # Fabric's precision plugin calls scaler.scale(loss).backward()
        if step == args.inject_inf_at and fabric.global_rank == args.inject_rank:
            weight = next(model.parameters())
            weight.grad.to_local().view(-1)[0] = math.inf  # this rank's shard only
        norm = scaler.clip_grad_norm_(model.parameters(), 1.0)  # global norm, same collective
        optimizer.step()  # Fabric calls scaler.step(optimizer) and scaler.update()
        record = {
            "rank": fabric.global_rank,
            "step": step,
            "skipped": scaler.last_step_skipped,
            "scale": scaler.get_scale(),
            "finite_norm": math.isfinite(norm.item()),
        }
        print(json.dumps(record), flush=True)
    assert fabric.strategy.precision.scaler is scaler
    fabric.barrier()


if __name__ == "__main__":
    main()
