"""A short soak in CI: random overflows in random ranks' shards across kinds and flavours."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_train import ROOT, _env

pytestmark = [pytest.mark.torchrun, pytest.mark.xdist_group("torchrun")]


def test_soak_three_ranks_every_planted_overflow_skipped_no_divergence(tmp_path: Path) -> None:
    report_path = tmp_path / "soak.json"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "3",
        str(ROOT / "launch" / "soak.py"),
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
    ]
    result = subprocess.run(
        command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(report_path.read_text())
    assert report["divergences_all_ranks"] == 0
    assert report["planted"] > 30
    assert report["skipped"] == report["planted"] == report["scaler"]["skipped_steps"]
    assert report["checks"] == 10
    assert len({segment.split("/")[0] for segment in report["segments"]}) >= 3
