"""A short soak in CI: random overflows in random ranks' shards across kinds and flavours."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_train import ROOT, torchrun

pytestmark = [pytest.mark.torchrun, pytest.mark.xdist_group("torchrun")]


def test_soak_three_ranks_every_planted_overflow_skipped_no_divergence(tmp_path: Path) -> None:
    report_path = tmp_path / "soak.json"
    torchrun(
        3,
        "--steps",
        "400",
        "--segment",
        "40",
        "--check-every",
        "40",
        "--overflow-rate",
        "0.15",
        "--seed",
        "3",
        "--json",
        str(report_path),
        script=str(ROOT / "launch" / "rigs" / "soak.py"),
        timeout=300,
    )
    report = json.loads(report_path.read_text())
    assert report["divergences_all_ranks"] == 0
    assert report["planted"] > 30
    assert report["skipped"] == report["planted"] == report["scaler"]["skipped_steps"]
    assert report["checks"] == 10
    assert len({segment.split("/")[0] for segment in report["segments"]}) >= 3
