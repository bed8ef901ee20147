"""Sharded checkpoints for the example job, with torch.distributed.checkpoint (DCP).

Layout: ``DIR/step_000120/`` holds one DCP checkpoint: one shard file per rank and ``.metadata``,
no gather to rank 0. A save writes ``DIR/step_000120.partial/`` and rank 0 renames it once every
rank has finished, so a folder without a suffix is complete. ``--resume`` takes the newest
complete one and checks, before loading, that every file the metadata names is there at full
length: a missing, partial or corrupt checkpoint is a clear error naming the file on every rank
together, never a silent fresh start. The load is ``shardscale.load_whole``: into copies,
taken whole once everything was read, so an entry that cannot be read (a garbled one, which no
length check sees) leaves the job's model, optimizer and scaler as they were and is named, with
its file.

What is saved: the model and optimizer (``get_state_dict``: sharded for FSDP, at any world size),
the scaler (a Stateful of its own), the step and data position, the seed, and the torch RNG state.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from shardscale import ShardScaleCheckpointError, load_whole

_NAME = re.compile(r"^step_(\d{6,})$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, partial or corrupt; the message names the file."""


# Optimizer state keyed by parameter name (``param_groups.<name>.lr``), not as a list of param
# groups: DCP keeps ONE copy of a non-tensor value saved under the same key on every rank, so
# pipeline stages, whose param groups hold different parameters, would overwrite each other's.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class ModelAndOptimizer:
    """The model and optimizer as one DCP Stateful (DCP's recommended pattern)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        if not self.optimizer.state:
            # No step taken yet (all skipped). get_state_dict gives such an optimizer its state
            # (as a load does) only when no parameter holds a gradient; with the skipped step's
            # gradients still there it would save no optimizer state, which no load accepts.
            self.optimizer.zero_grad(set_to_none=True)
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer, options=_OPTIONS)
        return {"model": model_state, "optim": optimizer_state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optim"],
            options=_OPTIONS,
        )


def checkpoint_path(directory: Path, step: int) -> Path:
    return directory / f"step_{step:06d}"


def save(directory: Path, step: int, state: dict[str, Any]) -> Path:
    """Write ``state`` as the checkpoint of ``step``; complete once this returns on every rank.

    A checkpoint of the same step already there (a re-run) is replaced, never mixed with.
    """
    final = checkpoint_path(directory, step)
    partial = final.with_name(final.name + ".partial")
    if dist.get_rank() == 0 and partial.exists():  # left by a save that died
        shutil.rmtree(partial)
    dist.barrier()
    dcp.save(state, checkpoint_id=partial)
    dist.barrier()
    if dist.get_rank() == 0:
        if final.exists():
            replaced = final.with_name(final.name + ".replaced")
            os.replace(final, replaced)
            os.replace(partial, final)
            shutil.rmtree(replaced)
        else:
            os.replace(partial, final)
    dist.barrier()
    return final


def has_checkpoint(directory: Path) -> bool:
    """Whether ``directory`` holds a complete checkpoint folder (it may still be damaged)."""
    return directory.is_dir() and any(
        _NAME.match(p.name) and p.is_dir() for p in directory.iterdir()
    )


def latest(directory: Path) -> Path:
    """The newest complete checkpoint in ``directory``.

    Raises:
        CheckpointError: there is none, or the newest folder is damaged.
    """
    if not directory.is_dir():
        raise CheckpointError(f"--resume: the checkpoint directory {directory} does not exist")
    complete = sorted(p for p in directory.iterdir() if _NAME.match(p.name) and p.is_dir())
    if not complete:
        partial = sorted(directory.glob("step_*.partial"))
        detail = f" (only unfinished saves: {[p.name for p in partial]})" if partial else ""
        raise CheckpointError(
            f"--resume: no checkpoint in {directory}: expected a folder step_NNNNNN/{detail}"
        )
    newest = complete[-1]
    verify(newest)
    return newest


def verify(path: Path) -> None:
    """Check that every file ``path``'s metadata names exists at its full length."""
    metadata_file = path / ".metadata"
    if not metadata_file.is_file():
        raise CheckpointError(f"checkpoint {path} is partial: {metadata_file} is missing")
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as error:
        raise CheckpointError(f"checkpoint metadata {metadata_file} is corrupt: {error}") from error
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for relative, size in sorted(needed.items()):
        shard = path / relative
        if not shard.is_file():
            raise CheckpointError(f"checkpoint {path} is partial: shard file {shard} is missing")
        if shard.stat().st_size < size:
            raise CheckpointError(
                f"checkpoint shard {shard} is truncated: {shard.stat().st_size} bytes, "
                f"the metadata needs {size}"
            )


def load(path: Path, state: dict[str, Any]) -> None:
    """Load ``path`` into ``state``, whole or not at all (Statefuls through their methods)."""
    verify(path)
    try:
        load_whole(state, checkpoint_id=path)
    except ShardScaleCheckpointError as error:
        raise CheckpointError(str(error)) from error
