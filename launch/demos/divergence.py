"""Show ranks diverging under torch's ShardedGradScaler, and agreeing under shardscale's.

The layout: two replicas of one model held as plain tensors (every rank holds the whole model, as
DDP's ranks do), a fused AdamW, and an inf in rank 1's gradients only: an inf one rank alone sees,
as in an FSDP1 flat-parameter shard or a hand-sharded tensor. torch's ``ShardedGradScaler``
reduces ``found_inf`` in ``unscale_()``, which the fused path of ``step()`` never calls: rank 1
skips, rank 0 steps, and their scales and weights part ways.

Not every layout parts: on FSDP2 and DTensor tensor-parallel gradients torch's scalers agree
(DTensor all-reduces ``found_inf``). Every layout, torch's two scalers beside ours:
``tests/test_claims.py`` and docs/index.md ("Torch's scalers, layout by layout").

    torchrun --standalone --nproc-per-node 2 launch/demos/divergence.py
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist
from _common import leave, plant
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchShardedGradScaler

from shardscale import ShardedGradScaler


def _one_step(scaler: Any) -> torch.Tensor:
    """One fused-AdamW step with an inf in rank 1's gradient; return [scale, *weights]."""
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    scaler.scale(model(torch.ones(2, 8)).sum()).backward()
    if dist.get_rank() == 1:
        plant([model.weight])  # an inf in rank 1's gradient alone
    scaler.step(optimizer)
    scaler.update()
    return torch.cat((torch.tensor([scaler.get_scale()]), model.weight.detach().reshape(-1)))


def main() -> None:
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    scalers = {
        "torch ShardedGradScaler": lambda: TorchShardedGradScaler("cpu", init_scale=4.0),
        "shardscale.ShardedGradScaler": lambda: ShardedGradScaler(init_scale=4.0),
    }
    ours_agree = True
    if rank == 0:
        print(
            "layout: 2 replicas, plain-tensor gradients (no FSDP2/DTensor), fused AdamW; "
            "an inf in rank 1's gradients only"
        )
    for name, make in scalers.items():
        outcome = _one_step(make())
        outcomes = [torch.empty_like(outcome) for _ in range(world_size)]
        dist.all_gather(outcomes, outcome)
        agree = all(torch.equal(outcomes[0], other) for other in outcomes)
        if name.startswith("shardscale"):
            ours_agree = agree
        if rank == 0:
            print(f"{name}: {'ranks AGREE' if agree else 'ranks DIVERGED'}")
            for other, gathered in enumerate(outcomes):
                weights = bytes(gathered[1:].view(torch.uint8).tolist())
                digest = hashlib.sha256(weights).hexdigest()[:12]
                print(f"  rank {other}: scale {gathered[0].item():g}, weights {digest}")
    dist.barrier()  # no rank leaves while another still needs the group
    dist.destroy_process_group()
    if not ours_agree:
        raise SystemExit("shardscale's ranks disagreed: please report this")


if __name__ == "__main__":
    main()
    leave()  # past torch's C++ teardown, which may abort at exit (_common.py)
