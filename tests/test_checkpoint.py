"""The scaler as a torch.distributed.checkpoint Stateful: save, resume, change world size."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.api import CheckpointException

from shardscale import ShardedGradScaler, ShardScaleCheckpointError, load_whole
from tests.harness import run_ranks
from tests.setups import build, plant

_OVERFLOWS = {1: 1, 2: 0, 4: 0}  # step: the rank whose shard overflows there


def _rank_train_and_save(
    rank: int,
    world_size: int,
    folder: str,
    options: dict[str, Any] | None = None,
    overflows: dict[int, int] | None = None,
) -> dict[str, Any]:
    """Five steps (FSDP2, fused AdamW) with the planted `overflows`, then a DCP save."""
    setup = build("fsdp2", "fused", world_size)
    scaler = ShardedGradScaler(
        **(options or {"init_scale": 2.0**6, "growth_interval": 2, "hysteresis": 2})
    )
    overflows = _OVERFLOWS if overflows is None else overflows
    for step in range(5):
        setup.optimizer.zero_grad()
        scaler.scale(setup.loss(step, rank)).backward()
        if overflows.get(step) == rank:
            plant(setup.optimizer, math.inf)
        scaler.step(setup.optimizer)
        scaler.update()
    dcp.save({"scaler": scaler}, checkpoint_id=folder)
    return scaler.state_dict()


def _rank_resume(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    scaler = ShardedGradScaler(init_scale=1.0, growth_interval=1000)  # other settings: overwritten
    dcp.load({"scaler": scaler}, checkpoint_id=folder)
    loaded = scaler.state_dict()
    setup = build("fsdp2", "for-loop", world_size)
    scaler.scale(setup.loss(0, rank)).backward()
    scaler.step(setup.optimizer)
    scaler.update()
    scaler.verify_agreement()
    return {"loaded": loaded, "after": scaler.state_dict()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    folder = tmp_path_factory.mktemp("checkpoint")
    states = run_ranks(_rank_train_and_save, 2, str(folder))
    assert states[0] == states[1]
    assert states[0]["skipped_steps"] == 3
    return folder, states[0]


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_dcp_resume_at_any_world_size_restores_state_on_every_rank(
    saved: tuple[Path, dict[str, Any]], world_size: int
) -> None:
    folder, state = saved
    results = run_ranks(_rank_resume, world_size, str(folder))
    for result in results:
        assert result["loaded"] == state
        assert result["after"] == results[0]["after"]
        assert result["after"]["steps"] == state["steps"] + 1


def _rank_torch_checkpoint_into_ours(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    theirs = torch.amp.GradScaler("cpu", init_scale=32.0, growth_interval=7)
    theirs.scale(torch.tensor(1.0))
    dcp.save({"scaler": theirs}, checkpoint_id=folder)
    ours = ShardedGradScaler(hysteresis=3)
    # A torch checkpoint lacks our keys: a partial load keeps our settings for them.
    dcp.load(
        {"scaler": ours}, checkpoint_id=folder, planner=DefaultLoadPlanner(allow_partial_load=True)
    )
    helped = ShardedGradScaler(hysteresis=3)
    load_whole({"scaler": helped}, checkpoint_id=folder)  # no partial load needed
    back = torch.amp.GradScaler("cpu")
    dcp.save({"scaler": ours}, checkpoint_id=folder + "-ours")
    dcp.load({"scaler": back}, checkpoint_id=folder + "-ours")
    return {"ours": ours.state_dict(), "helped": helped.state_dict(), "back": back.state_dict()}


def test_dcp_torch_scaler_checkpoint_loads_both_ways(tmp_path: Path) -> None:
    for result in run_ranks(_rank_torch_checkpoint_into_ours, 2, str(tmp_path / "torch")):
        ours = result["ours"]
        assert (ours["scale"], ours["growth_interval"], ours["hysteresis"]) == (32.0, 7, 3)
        assert result["helped"] == ours
        assert result["back"] == {
            "scale": 32.0,
            "growth_factor": 2.0,
            "backoff_factor": 0.5,
            "growth_interval": 7,
            "_growth_tracker": 0,
        }


_FIT_KEYS = ("scale_policy", "_fit_margin", "_fit_window", "_fit_streak")  # formats 3 and 4's
_ALARM_KEYS = ("floor_streak", "loss_streak")  # format 5's


class _OlderFormat:
    """A Stateful that saves ``scaler`` as an older shardscale did: format 0 (no
    ``format_version``) or format 4 (no alarm streaks)."""

    def __init__(self, scaler: ShardedGradScaler, version: int) -> None:
        self.scaler, self.version = scaler, version

    def state_dict(self) -> dict[str, Any]:
        state = self.scaler.state_dict()
        if self.version == 0:
            newer = ("format_version", "forward_overflows", "retries", *_FIT_KEYS, *_ALARM_KEYS)
            return {k: v for k, v in state.items() if k not in newer}
        return {k: v for k, v in state.items() if k not in _ALARM_KEYS} | {"format_version": 4}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise AssertionError("only saved")


def _rank_older_checkpoint(rank: int, world_size: int, folder: str, version: int) -> dict[str, Any]:
    """A checkpoint of format `version` taken with a floor streak under way (4 overflows in a
    row at a floor of 1.0), loaded by this release's scaler: strictly, then with a partial
    load."""
    old = ShardedGradScaler(init_scale=2.0, growth_interval=3, hysteresis=2, min_scale=1.0)
    setup = build("fsdp2", "fused", world_size)
    for step in range(5):
        setup.optimizer.zero_grad()
        old.scale(setup.loss(step, rank)).backward()
        plant(setup.optimizer, math.inf)
        old.step(setup.optimizer)
        old.update()
    dcp.save({"scaler": _OlderFormat(old, version)}, checkpoint_id=folder)
    strict_error = ""
    try:
        dcp.load({"scaler": ShardedGradScaler()}, checkpoint_id=folder)
    except CheckpointException as error:  # DCP's, a BaseException, wraps each rank's failure
        strict_error = str(error)
    new = ShardedGradScaler(init_scale=1.0)
    dcp.load(
        {"scaler": new}, checkpoint_id=folder, planner=DefaultLoadPlanner(allow_partial_load=True)
    )
    helped = ShardedGradScaler(init_scale=1.0)
    load_whole({"scaler": helped}, checkpoint_id=folder)  # asks for the entries it holds
    return {
        "old": old.state_dict(),
        "new": new.state_dict(),
        "helped": helped.state_dict(),
        "strict_error": strict_error,
    }


@pytest.mark.filterwarnings("ignore::shardscale.ShardScaleWarning")  # the floor's warning
@pytest.mark.parametrize("version", [0, 4])
def test_dcp_older_format_checkpoint_loads_with_a_partial_load(
    tmp_path: Path, version: int
) -> None:
    """docs/checkpoints.md: an older format's checkpoint lacks keys the scaler asks DCP for, so
    a strict load fails; with allow_partial_load it loads, what it lacks at 0 (format 4: the
    streaks, though it was taken mid-streak). Format 4 names its version, so the entries the
    partial load fills in from the loading scaler are not taken for the checkpoint's.
    `load_whole` loads it strictly: it asks for the scaler's entries the checkpoint holds."""
    folder = str(tmp_path / f"v{version}")
    for result in run_ranks(_rank_older_checkpoint, 2, folder, version):
        assert "Missing key in checkpoint state_dict: scaler." in result["strict_error"]
        old, new = result["old"], result["new"]
        assert old["floor_streak"] == 4
        assert new == {**old, "floor_streak": 0}
        assert new["format_version"] == 5
        assert result["helped"] == new


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_load_whole_of_no_checkpoint_or_without_the_scaler_names_it(tmp_path: Path) -> None:
    """A folder without metadata (a save that never finished), and a checkpoint saved without
    the scaler's entry: each named, nothing changed."""
    scaler = ShardedGradScaler(init_scale=8.0)
    before = scaler.state_dict()
    with pytest.raises(ShardScaleCheckpointError, match=r"\.metadata cannot be read"):
        load_whole({"scaler": scaler}, checkpoint_id=tmp_path / "none")
    folder = tmp_path / "model-only"
    dcp.save({"model": {"w": torch.ones(2)}}, checkpoint_id=folder)
    weights = {"w": torch.zeros(2)}
    with pytest.raises(ShardScaleCheckpointError, match=r"holds no entry 'scaler'"):
        load_whole({"model": weights, "scaler": scaler}, checkpoint_id=folder)
    assert scaler.state_dict() == before
    assert weights["w"].tolist() == [0.0, 0.0]
    load_whole({"model": weights}, checkpoint_id=folder)  # a plain dict: in place
    assert weights["w"].tolist() == [1.0, 1.0]
