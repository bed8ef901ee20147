"""What each rank holds, for the launch scripts: its gradient shards, and whether ranks agree.

Used by ``train.py`` (the planted infs, the final ``ranks_agree``) and by the maintainers' soak,
``launch/rigs/soak.py`` (planted overflows, periodic agreement checks).
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
            if param.grad is not None and (local := _local(param.grad)).numel():
                yield local


def _local(grad: torch.Tensor) -> torch.Tensor:
    """The elements of ``grad`` this rank holds: a DTensor's local shard (a view), else ``grad``."""
    return grad.to_local() if isinstance(grad, DTensor) else grad


def _digest(*parts: bytes) -> torch.Tensor:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    return torch.tensor(list(digest.digest()), dtype=torch.int64)


def params_digest(model: nn.Module) -> torch.Tensor:
    """A digest of the full parameters ``model`` holds (gathered from shards: a collective)."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    parts = []
    for name in sorted(full):
        value = full[name]
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        raw = value.detach().float().cpu().reshape(-1).contiguous().view(torch.uint8)
        parts += [name.encode(), bytes(raw.tolist())]
    return _digest(*parts)


def steps_digest(optimizer: torch.optim.Optimizer, extra: str = "") -> torch.Tensor:
    """A digest of the optimizer's step counters and ``extra`` (e.g. the scaler state).

    The step counters matter under FSDP: a rank that stepped while another skipped differs
    there even where the gathered weights cannot show it.
    """
    steps = sorted({float(state["step"]) for state in optimizer.state.values() if "step" in state})
    return _digest(repr((steps, extra)).encode())


def state_digest(
    model: nn.Module, optimizer: torch.optim.Optimizer, extra: str = ""
) -> torch.Tensor:
    """:func:`params_digest` and :func:`steps_digest` in one."""
    return torch.cat((params_digest(model), steps_digest(optimizer, extra)))


def ranks_agree(digest: torch.Tensor, shared: torch.Tensor | None = None, stage: int = 0) -> bool:
    """Whether ranks of the same pipeline ``stage`` hold the same ``digest``, and every rank
    of the default group the same ``shared`` digest (one all_gather)."""
    shared = torch.zeros(0, dtype=torch.int64) if shared is None else shared
    mine = torch.cat((torch.tensor([stage]), digest, shared))
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    same_stage = [row for row in gathered if row[0] == stage]
    width = 1 + len(digest)
    return all(torch.equal(same_stage[0], row) for row in same_stage) and all(
        torch.equal(gathered[0][width:], row[width:]) for row in gathered
    )
