"""What every demo does alike: reach this rank's share of a gradient, plant an inf there, leave.

Each demo imports it by name (``from _common import ...``): Python puts a script's own folder on
``sys.path``, so it is found however the demo is started (python, torchrun, Lightning's launcher).
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Iterable
from typing import NoReturn

import torch
from torch.distributed.tensor import DTensor


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """The elements of ``tensor`` this rank holds: a DTensor's local shard (FSDP2, tensor
    parallel; a view, so writes land in the gradient), else ``tensor`` itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@torch.no_grad()
def plant(parameters: Iterable[torch.Tensor], value: float = math.inf) -> None:
    """Write ``value`` into the first element this rank holds of the first of ``parameters``'
    gradients it holds any of: an overflow on this rank alone, which every rank must skip."""
    for parameter in parameters:
        if parameter.grad is not None and (local := local_shard(parameter.grad)).numel():
            local.view(-1)[0] = value
            return
    raise RuntimeError("this rank holds no gradient element to plant an inf in")


def leave() -> NoReturn:
    """Leave once the demo's output is written, past torch's C++ teardown at interpreter exit.

    That teardown sometimes aborts ("terminate called without an active exception"; about 1 run
    in 8 with 3 ranks on 2 cores: docs/reliability.md), and torchrun then reports a finished job
    as failed. Call it after ``main()`` returns: an error still exits with its own status.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
