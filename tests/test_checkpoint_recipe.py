"""The recipe users copy survives (issue 69): the README's loop and docs/checkpoints.md's save and
load, run as the pages write them (read from the pages, as `tests/test_docs_blocks.py` reads
them), on 2 gloo ranks with FSDP2 and CPU autocast fp16.

- A checkpoint taken while every step so far was skipped (real fp16 gradient overflows at
  every scale the loop tries) loads after a restart, and the restarted run steps as the one that
  saved it does: without the recipe's care, torch 2.13 saved no optimizer state and every load
  failed ("Missing key ... step"), a crash loop.
- A load from a checkpoint whose scaler entry is garbled or cut short in its shard raises
  `ShardScaleCheckpointError` on every rank, naming the file and the entry, and leaves the live
  model, optimizer and scaler bit for bit as they were (DCP alone overwrote the model, then
  raised a bare EOFError/UnpicklingError).
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from shardscale import ShardedGradScaler, ShardScaleCheckpointError
from tests.harness import run_ranks
from tests.test_docs_blocks import _Model, python_blocks  # the pages' model


def _block(page: str, holding: str) -> str:
    """The page's one python block that holds `holding`."""
    found = [b.code for b in python_blocks() if b.page == page and holding in b.code]
    assert len(found) == 1, f"{page} holds {len(found)} python blocks with {holding!r}"
    return found[0]


README_LOOP = ("README.md", "scaler.scale(loss).backward()")
RECIPE = ("docs/checkpoints.md", "load_whole(state")


def _overflowing_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A finite loss whose fp16 backward overflows at any scale the loop tries (>= 1)."""
    return ((output.float() - target) ** 2).mean() * 2.0**60


def _healthy_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output.float() - target) ** 2).mean()


def _names(path: str, loss_fn: Any = _healthy_loss) -> dict[str, Any]:
    """What the pages leave to the reader: an FSDP2 model, AdamW, 3 batches, a loss, a scaler."""
    model = _Model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    generator = torch.Generator().manual_seed(1)
    loader = [(torch.randn(8, 8, generator=generator), torch.randn(8, 4, generator=generator))]
    return {
        "model": model,
        "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-2),
        "loader": loader * 3,
        "loss_fn": loss_fn,
        "scaler": ShardedGradScaler(),
        "path": path,
    }


def _step(names: dict[str, Any]) -> None:
    """One healthy iteration, as the README's loop runs it."""
    model, optimizer, scaler = names["model"], names["optimizer"], names["scaler"]
    inputs, targets = names["loader"][0]
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = _healthy_loss(model(inputs), targets)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


def _live(names: dict[str, Any]) -> list[Any]:
    """This rank's model and optimizer state, as bytes, and the scaler's state dict."""
    tensors = [*names["model"].state_dict().values()]
    for state in names["optimizer"].state.values():
        tensors += [state[k] for k in sorted(state)]
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    raw = [bytes(t.detach().reshape(-1).view(torch.uint8).tolist()) for t in local]
    return [raw, names["scaler"].state_dict()]


def _rank_all_skipped_then_restart(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    """The README's loop, every step skipped; the recipe's save (and load); a restart that runs
    the recipe without its save; then one healthy step on each side."""
    first = _names(folder, _overflowing_loss)
    exec(_block(*README_LOOP), first)
    skipped = first["scaler"].stats.skipped_steps
    never_stepped = not first["optimizer"].state
    exec(_block(*RECIPE), first)
    restarted = _names(folder)
    without_save = [line for line in _block(*RECIPE).splitlines() if "dcp.save(" not in line]
    exec("\n".join(without_save), restarted)
    loaded_alike = _live(restarted) == _live(first)
    first["loss_fn"] = _healthy_loss
    _step(first)
    _step(restarted)
    return {
        "skipped": skipped,
        "never_stepped": never_stepped,
        "loaded_alike": loaded_alike,
        "stepped_alike": _live(restarted) == _live(first),
        "steps_taken": restarted["scaler"].stats.steps - restarted["scaler"].stats.skipped_steps,
    }


def test_recipe_checkpoint_while_every_step_was_skipped_resumes(tmp_path: Path) -> None:
    for result in run_ranks(_rank_all_skipped_then_restart, 2, str(tmp_path / "ckpt")):
        assert result["skipped"] == 3
        assert result["never_stepped"]
        assert result["loaded_alike"]
        assert result["stepped_alike"]
        assert result["steps_taken"] == 1


def _damage(path: str, entry: str, how: str) -> str:
    """Damage `entry`'s bytes in its shard file; return that file. `garbled`: zeros; `cut`:
    the file ends halfway through it; `wrong`: a scale of -1.0, which reads (DCP then loads
    everything else in place) and the scaler refuses."""
    storage = FileSystemReader(path).read_metadata().storage_data
    info = next(info for index, info in storage.items() if index.fqn == entry)
    file = os.path.join(path, info.relative_path)
    with open(file, "r+b") as shard:
        if how == "cut":
            shard.truncate(info.offset + info.length // 2)
            return file
        written = io.BytesIO()
        torch.save(-1.0, written)
        assert len(written.getvalue()) == info.length  # a float as long as the scale
        shard.seek(info.offset)
        shard.write(bytes(info.length) if how == "garbled" else written.getvalue())
    return file


def _rank_load_damaged(rank: int, world_size: int, folder: str, how: str) -> dict[str, Any]:
    """Two steps, the recipe's save, the scaler's entry damaged, two more steps; then the
    recipe's load of the damaged checkpoint."""
    names = _names(folder)
    _step(names)
    _step(names)
    exec(_block(*RECIPE), names)
    file = _damage(folder, "scaler.scale", how) if rank == 0 else ""
    dist.barrier()
    _step(names)
    _step(names)
    before = _live(names)
    with pytest.raises(ShardScaleCheckpointError) as raised:
        names["load_whole"](names["state"], checkpoint_id=folder)
    dist.barrier()
    return {"message": str(raised.value), "file": file, "unchanged": _live(names) == before}


@pytest.mark.parametrize("how", ["garbled", "cut", "wrong"])
def test_recipe_load_of_a_damaged_scaler_entry_changes_nothing_and_names_it(
    tmp_path: Path, how: str
) -> None:
    results = run_ranks(_rank_load_damaged, 2, str(tmp_path / "ckpt"), how)
    file = results[0]["file"]
    for result in results:
        assert result["unchanged"], "the live model, optimizer or scaler changed"
        message = result["message"]
        assert "nothing was loaded: what you passed is as it was" in message
        if how == "wrong":
            assert f"the entry 'scaler' (in {os.path.basename(file)}) was refused" in message
            assert "state_dict['scale'] must be finite and > 0, got -1.0" in message
            continue
        assert f"the entry 'scaler.scale' in {file}" in message, message
        if how == "cut":
            assert "is cut short: the file has" in message
        else:
            assert "cannot be read (UnpicklingError" in message
