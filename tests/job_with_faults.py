"""The example job, ``launch/job/train.py``, with faults the tests inject: the job itself has none.

    torchrun --standalone --max-restarts 1 --nproc-per-node 2 tests/job_with_faults.py \\
        --kill 5:1 --steps 6 --checkpoint-dir runs/ckpt --checkpoint-every 2

``--kill STEP:RANK`` SIGKILLs RANK as it starts step STEP (1-based), on torchrun's first attempt
only, as a crashed node would: torchrun restarts the job, which resumes from its last checkpoint.
``--exit-after K`` ends the training loop after step K, as an interrupted job would, and the job
then writes its summary (``interrupted``: true) and checkpoints as it does. Every other argument
goes to the job.

The faults wrap two of the job's functions, ``train_step`` and ``train_loop``, which the job
calls through its module: renaming either fails the tests that use this wrapper, loudly.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "launch" / "job"))
import train


@dataclass(frozen=True)
class Faults:
    """Where the run is cut short: after a step, or by a killed rank."""

    exit_after: int | None = None
    """The last step the loop runs (None: every step)."""
    kill_step: int | None = None
    """The step (1-based) at whose start ``kill_rank`` is killed (None: no rank is)."""
    kill_rank: int = 0


def _step_and_rank(text: str) -> tuple[int, int]:
    step, _, rank = text.partition(":")
    if not (step.isdigit() and rank.isdigit()):
        raise argparse.ArgumentTypeError(f"--kill must be STEP:RANK, got {text!r}")
    return int(step), int(rank)


def parse_faults(argv: Sequence[str]) -> tuple[Faults, list[str]]:
    """The faults asked for, and the arguments left for the job."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--exit-after", type=int, metavar="K", help="stop after step K")
    parser.add_argument(
        "--kill", type=_step_and_rank, metavar="STEP:RANK", help="SIGKILL RANK at STEP"
    )
    known, job_argv = parser.parse_known_args(argv)
    if known.exit_after is not None and known.exit_after < 1:
        parser.error(f"--exit-after must be a step >= 1, got {known.exit_after}")
    kill_step, kill_rank = known.kill or (None, 0)
    return Faults(known.exit_after, kill_step, kill_rank), job_argv


def _killing(faults: Faults, train_step: Callable[..., Any]) -> Callable[..., Any]:
    """``train_step``, killing ``faults.kill_rank`` as it starts ``faults.kill_step``."""

    def train_step_or_die(args: Any, job: Any, step: int, *batch: Any) -> Any:
        rank = dist.get_rank()
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if step + 1 == faults.kill_step and rank == faults.kill_rank and first_attempt:
            print(f"rank {rank}: killed at step {step + 1} (--kill)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return train_step(args, job, step, *batch)

    return train_step_or_die


def _interrupting(exit_after: int, train_loop: Callable[..., Any]) -> Callable[..., Any]:
    """``train_loop``, ending after step ``exit_after``: it runs to ``args.steps``, lowered for
    the loop alone, so the summary still compares the steps run with the steps asked for."""

    def interrupted_loop(args: Any, *rest: Any) -> Any:
        steps_asked = args.steps
        args.steps = min(steps_asked, exit_after)
        try:
            return train_loop(args, *rest)
        finally:
            args.steps = steps_asked

    return interrupted_loop


def install(faults: Faults) -> None:
    """Wrap the job's functions with ``faults``."""
    if faults.kill_step is not None:
        train.train_step = _killing(faults, train.train_step)
    if faults.exit_after is not None:
        train.train_loop = _interrupting(faults.exit_after, train.train_loop)


if __name__ == "__main__":
    faults, job_argv = parse_faults(sys.argv[1:])
    install(faults)
    train.main(job_argv)
    # As the job itself leaves (launch/job/train.py): past torch's C++ teardown at exit.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
