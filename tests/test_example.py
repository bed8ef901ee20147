"""The example users copy, launch/examples/fsdp2_fp16.py: a first run, then a resume, under
torchrun on 2 gloo ranks, as the README tells users to run it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# On the torchrun worker (``--dist loadgroup``), after or before test_train's jobs, never beside.
pytestmark = [pytest.mark.torchrun, pytest.mark.xdist_group("torchrun")]

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "launch" / "examples" / "fsdp2_fp16.py"
STEP = re.compile(r"^step (\d+): loss ([0-9.]+), scale ([0-9.e+]+)(, skipped.*)?$", re.MULTILINE)


def _run(steps: int, checkpoints: Path, *options: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", str(EXAMPLE), "--steps", str(steps)]
    command += ["--checkpoint-dir", str(checkpoints), *options]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, f"{command}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def test_example_first_run_then_larger_steps_resumes_where_it_stopped(tmp_path: Path) -> None:
    first = _run(3, tmp_path, "--growth-interval", "2")  # the scale doubles at step 2
    assert "resumed" not in first
    first_steps = [(int(s), float(loss)) for s, loss, _, _ in STEP.findall(first)]
    assert [s for s, _ in first_steps] == [1, 2, 3]  # rank 0 alone logs
    assert [float(scale) for _, _, scale, _ in STEP.findall(first)] == [65536, 131072, 131072]

    second = _run(5, tmp_path)  # the default interval: a fresh scaler would start at 65536
    assert f"resumed from {tmp_path / 'step_000003'} at step 3, scale 131072\n" in second
    second_steps = [(int(s), float(loss)) for s, loss, _, _ in STEP.findall(second)]
    assert [s for s, _ in second_steps] == [4, 5]
    # training went on from the saved weights: a fresh model would start near step 1's loss
    assert second_steps[0][1] < 0.8 * first_steps[0][1]
    assert sorted(os.listdir(tmp_path)) == ["step_000003", "step_000005"]
