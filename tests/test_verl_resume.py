"""verl's resume, as shardscale's integration wraps it, on 2 gloo ranks, without verl.

verl's FSDP checkpoints are per-rank shards; their folder may be shared or node-local. Rank 0
alone writes the scaler's file: on node-local folders the other ranks have none. Each rank must
still end with the one state (the ranks that found the file tell the others, in one gather over
the scaler's group, bounded by its sync_timeout), or every rank raise together: never one rank
loading while another warns and goes on, nor waits for a rank that never comes.
"""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from shardscale import ShardedGradScaler, ShardScaleDistributedError
from shardscale.integrations import verl
from tests.harness import run_ranks


def _verl_files(path: str, *args: Any, **kwargs: Any) -> None:
    """verl's own save or load of its files (not the scaler's): nothing here."""


def _scaler(scale: float) -> ShardedGradScaler:
    scaler = ShardedGradScaler(init_scale=scale, sync_timeout=20.0)
    scaler.scale(torch.ones(()))  # the state on the CPU
    return scaler


def _rank_resume(rank: int, world_size: int, folder: str, layout: str) -> dict[str, Any]:
    """Save from one scaler, load into a fresh one whose own scale differs; the folder each
    rank sees: the same one (shared), or its node's own (node-local: rank 1's lacks the file);
    "stale": rank 1's node has an older file."""
    own = os.path.join(folder, f"node{rank}") if layout != "shared" else folder
    os.makedirs(own, exist_ok=True)  # verl's own files are there on every node
    verl._saving(_verl_files, lambda: _scaler(2.0**10))(own)
    if layout == "stale" and rank == 1:
        torch.save({**_scaler(2.0**5).state_dict()}, os.path.join(own, verl.SCALER_FILE))
    resumed = _scaler(2.0**16)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            verl._loading(_verl_files, lambda: resumed)(own)
    except ShardScaleDistributedError as error:
        return {"raised": str(error)[:120]}
    return {"scale": resumed.get_scale(), "warned": [str(w.message)[:40] for w in caught]}


@pytest.mark.parametrize("layout", ["shared", "node-local"])
def test_verl_resume_every_rank_takes_the_one_scale(tmp_path: Path, layout: str) -> None:
    results = run_ranks(_rank_resume, 2, str(tmp_path), layout)
    assert results == [{"scale": 2.0**10, "warned": []}] * 2


def test_verl_resume_from_files_that_differ_raises_on_every_rank(tmp_path: Path) -> None:
    rank0, rank1 = run_ranks(_rank_resume, 2, str(tmp_path), "stale")
    assert rank0 == rank1
    assert "shardscale_scaler.pt files the ranks read" in rank0["raised"]


def _rank_one_never_loads(rank: int, world_size: int, folder: str) -> tuple[float, str]:
    """Rank 1 never reaches the load (it hangs elsewhere, past the scaler's sync_timeout)."""
    verl._saving(_verl_files, lambda: _scaler(2.0**10))(folder)
    if rank == 1:
        time.sleep(8.0)
        return 0.0, "away"
    resumed = ShardedGradScaler(sync_timeout=2.0)
    started = time.monotonic()
    try:
        verl._loading(_verl_files, lambda: resumed)(folder)
    except ShardScaleDistributedError as error:
        return time.monotonic() - started, str(error)
    return time.monotonic() - started, "loaded"


def test_verl_resume_a_rank_that_never_arrives_is_an_error_within_the_sync_timeout(
    tmp_path: Path,
) -> None:
    """The gather of what each rank read is the scaler's own, bounded by its sync_timeout: not
    a wait for the process group's timeout (30 minutes by default)."""
    (waited, said), away = run_ranks(_rank_one_never_loads, 2, str(tmp_path))
    assert away == (0.0, "away")
    assert "shardscale_scaler.pt each rank read" in said, said
    assert waited < 6.0  # rank 1 leaves at 8 s: the bound, not its leaving, ended the wait
