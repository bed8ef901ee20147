"""Lightning Fabric in fp16 with shardscale's precision plugin, FSDP2 or DDP, checkpointed.

    torchrun --standalone --nproc-per-node 2 launch/demos/lightning_fabric.py --inject-inf-at 3

Fabric refuses ``precision="16-mixed"`` with ``ModelParallelStrategy`` (FSDP2) and turns it into
bf16 on CPUs; ``plugins=FabricPrecision(...)`` (``shardscale.integrations.lightning``) gives fp16
with shardscale's scaler under either strategy. ``--inject-inf-at K`` writes an inf into rank 1's
local gradient at step K; every rank prints one JSON line per step, then saves a checkpoint,
loads it into fresh objects and prints whether the scaler came back exactly.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import lightning as L
import torch
from _common import leave, plant
from lightning.fabric.strategies import DDPStrategy, ModelParallelStrategy
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from shardscale import count_collectives
from shardscale.integrations.lightning import FabricPrecision


def parallelize(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """FSDP2 over the data-parallel dimension of Fabric's mesh, one unit per linear layer."""
    data_parallel = mesh["data_parallel"]
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=data_parallel)
    fully_shard(model, mesh=data_parallel)
    return model


SEEN: dict[str, str] = {}  # Fabric casts the module's outputs back to fp32: look inside


def build(strategy: str, accelerator: str) -> tuple[Any, Any, Any, FabricPrecision]:
    plugin = FabricPrecision(accelerator, init_scale=2.0**10)
    chosen: Any = (
        ModelParallelStrategy(parallelize, data_parallel_size=2, tensor_parallel_size=1)
        if strategy == "fsdp2"
        else DDPStrategy()
    )
    fabric = L.Fabric(accelerator=accelerator, devices=2, strategy=chosen, plugins=plugin)
    fabric.launch()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    net[0].register_forward_hook(
        lambda module, inputs, output: SEEN.update(dtype=str(output.dtype))
    )
    model = fabric.setup_module(net)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    return fabric, model, optimizer, plugin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", choices=("fsdp2", "ddp"), default="fsdp2")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--inject-inf-at", type=int, default=0, help="0: never")
    parser.add_argument("--checkpoint", type=Path, help="save and reload a checkpoint here")
    parser.add_argument("--accelerator", default="cpu")
    args = parser.parse_args()

    fabric, model, optimizer, plugin = build(args.strategy, args.accelerator)
    for step in range(1, args.steps + 1):
        optimizer.zero_grad()
        inputs = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
        with fabric.autocast():
            output = model(inputs.to(fabric.device))
        fabric.backward(output.float().pow(2).mean())  # scaler.scale(loss).backward()
        if step == args.inject_inf_at and fabric.global_rank == 1:
            plant(model.parameters())  # in rank 1's shard alone (FSDP2: its local shard)
        with count_collectives() as step_counts:
            norm = plugin.clip_grad_norm_(model.parameters(), 1.0)  # global, one collective
            optimizer.step()  # scaler.step + scaler.update
        record = {
            "rank": fabric.global_rank,
            "step": step,
            "compute_dtype": SEEN["dtype"],
            "skipped": plugin.scaler.last_step_skipped,
            "scale": plugin.scaler.get_scale(),
            "finite_norm": math.isfinite(norm.item()),
            "collectives": sum(step_counts.values()),
        }
        print(json.dumps(record), flush=True)
    if args.checkpoint is not None:
        fabric.save(args.checkpoint, {"model": model, "optimizer": optimizer, "scaler": plugin})
        saved = plugin.scaler.state_dict()
        _, model2, optimizer2, plugin2 = build(args.strategy, args.accelerator)
        state = {"model": model2, "optimizer": optimizer2, "scaler": plugin2}
        fabric.load(args.checkpoint, state)
        if isinstance(state["scaler"], dict):  # a sharded load hands the plugin's state back
            plugin2.load_state_dict(state["scaler"])
        equal = plugin2.scaler.state_dict() == saved
        print(json.dumps({"rank": fabric.global_rank, "resumed_equal": equal}), flush=True)
    fabric.barrier()


if __name__ == "__main__":
    main()
    leave()  # past torch's C++ teardown, which may abort at exit (_common.py)
