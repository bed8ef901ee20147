"""Every rank takes the same decision, for every gradient kind and optimizer flavour.

An inf planted in ONE rank's shard (and a NaN in another's) must make every rank skip, back off
and keep its parameters; clean steps must step everywhere; each step+update costs one collective.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from shardscale import ShardedGradScaler, count_collectives
from tests.harness import run_ranks
from tests.setups import FLAVOURS, KINDS, REPLICATED_KINDS, build, local_checksum, plant

INIT_SCALE = 2.0**10
# (what to plant, in which rank) per step; None: a clean step.
SCHEDULE: list[tuple[float, int] | None] = [
    None,
    (math.inf, 1),
    (math.nan, 0),
    None,
    (-math.inf, 0),
]


def _rank_schedule(rank: int, world_size: int, kind: str, flavour: str) -> list[dict[str, Any]]:
    setup = build(kind, flavour, world_size)
    scaler = ShardedGradScaler(init_scale=INIT_SCALE, growth_interval=1000)
    records = []
    for step, planted in enumerate(SCHEDULE):
        setup.optimizer.zero_grad(set_to_none=True)
        scaler.scale(setup.loss(step, rank)).backward()
        if planted is not None and planted[1] == rank:
            plant(setup.optimizer, planted[0])
        before = local_checksum(setup.model)
        with count_collectives() as counts:
            scaler.step(setup.optimizer)
            scaler.update()
        after = local_checksum(setup.model)
        records.append(
            {
                "skipped": scaler.last_step_skipped,
                "scale": scaler.get_scale(),
                "changed": before != after,
                "checksum": after,
                "collectives": sum(counts.values()),
            }
        )
    return records


def _cases() -> list[Any]:
    cases = []
    for kind in KINDS:
        for flavour in FLAVOURS:
            if kind == "sparse" and flavour == "fused":
                continue  # torch's fused SGD does not take sparse gradients
            cases.append(pytest.param(kind, flavour, id=f"{kind}-{flavour}"))
    return cases


@pytest.mark.parametrize(("kind", "flavour"), _cases())
def test_step_nonfinite_in_one_rank_every_rank_skips(kind: str, flavour: str) -> None:
    per_rank = run_ranks(_rank_schedule, 2, kind, flavour)
    expected_scale = INIT_SCALE
    for step, planted in enumerate(SCHEDULE):
        records = [ranks[step] for ranks in per_rank]
        if planted is not None:
            expected_scale *= 0.5
        for rank, record in enumerate(records):
            where = f"step {step} (planted {planted}) rank {rank}"
            assert record["skipped"] is (planted is not None), where
            assert record["changed"] is (planted is None), where
            assert record["scale"] == expected_scale, where
            assert record["collectives"] == 1, where
        if kind in REPLICATED_KINDS:
            assert records[0]["checksum"] == records[1]["checksum"], f"step {step} diverged"
