"""launch/rigs/gpu_check.sh, where CI can check it: without a GPU, and its bounds."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "launch" / "rigs" / "gpu_check.sh"
COMMAND_LIMIT_S = 7 * 60  # what a lent machine's one command leaves for a second run


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_without_a_gpu_it_says_so_exits_2_and_writes_nothing(tmp_path: Path) -> None:
    results = tmp_path / "results"
    run = subprocess.run(
        ["bash", str(SCRIPT), str(results)],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHON=os.environ.get("PYTHON", "python")),
    )
    assert run.returncode == 2, run.stdout + run.stderr
    assert "no CUDA device visible" in run.stdout
    assert "nothing written" in run.stdout
    assert not results.exists()


def test_every_check_is_bounded_and_all_fit_one_command() -> None:
    """Each check runs under `timeout`, and their limits with the kill grace fit 7 minutes."""
    text = SCRIPT.read_text()
    checks = re.findall(r"^check (\w+) (\d+) ", text, flags=re.MULTILINE)
    assert [name for name, _ in checks] == ["tests", "sync", "graph", "count", "bench", "example"]
    grace = int(re.search(r"timeout --kill-after (\d+) ", text).group(1))  # type: ignore[union-attr]
    assert '"$limit" "$@" >"$results/$name.txt"' in text  # `check` runs its command under them
    assert sum(int(limit) + grace for _, limit in checks) <= COMMAND_LIMIT_S
