"""Shared fixtures: a world-size-1 process group, and skips for hardware we lack."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist


@pytest.fixture
def world_of_one() -> Iterator[dist.ProcessGroup]:
    """An initialised gloo group of one rank, in this process (no ports, no files)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "gpu" in item.keywords and gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        if "nccl" in item.keywords and (gpus < 2 or not dist.is_nccl_available()):
            item.add_marker(pytest.mark.skip(reason="needs NCCL and two CUDA devices"))
