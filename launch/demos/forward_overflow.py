"""A loss that overflows, and a batch whose gradients do: torch's scalers beside shardscale's.

Two ranks, an FSDP2 MLP trained under fp16 autocast; its first backward overflows fp16 at a scale
of 2**16 and above, and holds at 2**15.

1. **Forward overflow.** Rank 1's loss is inf at steps 2, 3 and 4 (as when fp16 activations
   overflow in the forward). No scale can fix that: torch's scalers halve the scale at each of
   those steps anyway; shardscale skips them on every rank and holds the scale.
2. **Retry.** The scale starts at 2**18. torch's scalers drop a batch at each of 2**18, 2**17
   and 2**16; shardscale with `scaler.step(optimizer, closure=...)` reruns the first batch at
   the lower scales and drops none, ending with the parameters of a (retrying) run started at
   2**15, the scale it settled on.

    torchrun --standalone --nproc-per-node 2 launch/demos/forward_overflow.py
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from _common import leave
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchShardedGradScaler
from torch.distributed.tensor import DTensor

from shardscale import ShardedGradScaler

STEPS = 6
INF_LOSS_STEPS = (2, 3, 4)  # 1-based, on rank 1


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    return model, torch.optim.SGD(model.parameters(), lr=1e-4)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step * 10 + dist.get_rank())
    inputs = torch.randn(32, 16, generator=generator)
    return inputs, torch.randn(32, 16, generator=generator) * 32


def _train(scaler: Any, inf_loss_steps: tuple[int, ...], retry: bool) -> dict[str, Any]:
    """``STEPS`` steps; the scale after each, the steps skipped (batches dropped), the reruns."""
    model, optimizer = _model()
    scales, skipped, runs = [], [], []

    def run_batch(step: int) -> torch.Tensor:
        """The batch of ``step``, forward and backward, from its start (torch's closure)."""
        runs.append(step)
        optimizer.zero_grad()
        inputs, targets = _batch(step)
        with torch.autocast("cpu", dtype=torch.float16):
            outputs = model(inputs)
        loss = (outputs.float() - targets).pow(2).mean()
        if dist.get_rank() == 1 and step in inf_loss_steps:
            loss = loss * math.inf  # this rank's forward overflowed
        scaler.scale(loss).backward()
        return loss

    for step in range(1, STEPS + 1):
        scale_before = scaler.get_scale()
        if retry:
            scaler.step(optimizer, closure=functools.partial(run_batch, step))
        else:
            run_batch(step)
            scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
        if _skipped(scaler, scale_before):
            skipped.append(step)
    weights = torch.cat(
        [p.full_tensor().reshape(-1) for p in model.parameters() if isinstance(p, DTensor)]
    )  # the whole model, on every rank
    return {"scales": scales, "skipped": skipped, "reruns": len(runs) - STEPS, "weights": weights}


def _skipped(scaler: Any, scale_before: float) -> bool:
    if isinstance(scaler, ShardedGradScaler):
        return scaler.last_step_skipped
    return scaler.get_scale() < scale_before  # torch's scalers back off exactly when they skip


def _agree(tensor: torch.Tensor) -> bool:
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor)
    return all(torch.equal(gathered[0], other) for other in gathered)


def _report(title: str, rows: list[tuple[str, dict[str, Any]]], extra: Callable[..., str]) -> None:
    if dist.get_rank() != 0:
        return
    print(f"\n{title}\n")
    print(
        "| scaler | steps skipped (batches dropped) | batches rerun | scale after each step |"
        + extra.__doc__
        + "|"
    )
    print("|---|---|---:|---|---|")
    for name, run in rows:
        scales = ", ".join(f"2^{int(math.log2(s))}" for s in run["scales"])
        print(
            f"| {name} | {run['skipped'] or 'none'} | {run['reruns']} | {scales} | {extra(run)} |"
        )


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    torch_scalers: dict[str, Callable[[float], Any]] = {
        "torch.amp.GradScaler": lambda scale: torch.amp.GradScaler("cpu", init_scale=scale),
        "torch ShardedGradScaler": lambda scale: TorchShardedGradScaler("cpu", init_scale=scale),
    }
    rows = [
        (name, _train(make(2.0**15), INF_LOSS_STEPS, retry=False))
        for name, make in torch_scalers.items()
    ]
    ours = ShardedGradScaler(init_scale=2.0**15)
    rows.append(("shardscale.ShardedGradScaler", _train(ours, INF_LOSS_STEPS, retry=False)))
    forward_overflows = ours.stats.forward_overflows

    def ranks_agree(run: dict[str, Any]) -> str:
        """ranks hold the same weights"""
        return "yes" if run["agree"] else "NO"

    for _, run in rows:
        run["agree"] = _agree(run["weights"])
    _report(
        f"1. rank 1's loss is inf at steps {INF_LOSS_STEPS}, scale 2^15 "
        f"(shardscale counted {forward_overflows} forward overflows)",
        rows,
        ranks_agree,
    )

    rows = [(name, _train(make(2.0**18), (), retry=False)) for name, make in torch_scalers.items()]
    rows.append(
        (
            "shardscale.ShardedGradScaler, step(closure=...)",
            _train(ShardedGradScaler(init_scale=2.0**18), (), retry=True),
        )
    )
    settled = _train(ShardedGradScaler(init_scale=2.0**15), (), retry=True)["weights"]

    def same_as_settled(run: dict[str, Any]) -> str:
        """weights equal shardscale's retrying run started at 2^15"""
        return "yes" if torch.equal(run["weights"], settled) else "no"

    _report(
        "2. the scale starts at 2^18; the first backward overflows fp16 at 2^16 and above",
        rows,
        same_as_settled,
    )
    dist.barrier()  # no rank tears down while another still needs the group
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    leave()  # past torch's C++ teardown, which may abort at exit (_common.py)
