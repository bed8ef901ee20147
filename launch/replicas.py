"""What each rank holds, for the launch scripts: its gradient shards, and whether ranks agree.

Shared by ``train.py`` (fault injection, underflow tracking, the final ``ranks_agree``) and
``soak.py`` (planted overflows, periodic agreement checks).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor


def local_grad_shards(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """This rank's non-empty local gradient tensors (a DTensor's local shard; plain otherwise)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            grad = param.grad
            if grad is None:
                continue
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            if local.numel():
                yield local


def state_digest(
    model: nn.Module, optimizer: torch.optim.Optimizer, extra: str = ""
) -> torch.Tensor:
    """A digest of the full parameters, the optimizer step counters and ``extra``.

    The step counters matter under FSDP: a rank that stepped while another skipped differs
    there even where the gathered weights cannot show it.
    """
    digest = hashlib.sha256()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    for name in sorted(full):
        value = full[name]
        value = value.full_tensor() if isinstance(value, DTensor) else value
        digest.update(name.encode())
        raw = value.detach().float().cpu().reshape(-1).contiguous().view(torch.uint8)
        digest.update(bytes(raw.tolist()))
    steps = sorted({float(state["step"]) for state in optimizer.state.values() if "step" in state})
    digest.update(repr((steps, extra)).encode())
    return torch.tensor(list(digest.digest()), dtype=torch.int64)


def ranks_agree(digest: torch.Tensor) -> bool:
    """Whether every rank of the default group holds the same ``digest``."""
    gathered = [torch.empty_like(digest) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, digest)
    return all(torch.equal(gathered[0], other) for other in gathered)
