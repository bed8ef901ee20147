"""The example job, ``launch/job/train.py``, with faults the tests inject: the job itself has none.

    torchrun --standalone --max-restarts 1 --nproc-per-node 2 tests/job_with_faults.py \\
        --kill 5:1:backward --steps 6 --checkpoint-dir runs/ckpt --checkpoint-every 2

``--kill STEP:RANK[:POINT]`` SIGKILLs RANK at POINT of step STEP (1-based), on torchrun's first
attempt only, as a crashed node would: torchrun restarts the job, which resumes from its last
complete checkpoint. The points, inside a step and inside the save that follows it:

- ``start`` (the default): as the step starts;
- ``forward``: in the model's forward, as a module halfway through it runs;
- ``backward``: in the backward, as that module's output gradient is computed;
- ``allreduce``: in the scaler's one collective (its all-reduce), the peers already inside it;
- ``update``: between ``scaler.step()`` and ``scaler.update()``;
- ``shard``: in step STEP's checkpoint save, as RANK's shard file is written: the file cut to
  half its length, then the kill (no metadata: the save never finishes);
- ``commit``: in that save, at the metadata commit (rank 0, DCP's coordinator, before it writes
  ``.metadata``): every shard written, the checkpoint never complete.

``--exit-after K`` ends the training loop after step K, as an interrupted job would, and the job
then writes its summary (``interrupted``: true) and checkpoints as it does. Every other argument
goes to the job.

With ``SHARDSCALE_TEST_CORPUS`` set to a file, the job's corpus is read from it (written there
once, by the first rank to build it): parsing the standard library's docstrings costs each rank
of each attempt more than a second, and a test with restarts starts many.

The faults wrap four of the job's functions, ``train_step``, ``save_checkpoint``,
``train_loop`` and ``build_corpus``, which the job calls through its module, and, at the kill
step only,
``torch.distributed.all_reduce`` and DCP's ``FileSystemWriter``: renaming any fails the tests
that use this wrapper, loudly.
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

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemWriter

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "launch" / "job"))
import train

STEP_POINTS = ("start", "forward", "backward", "allreduce", "update")
SAVE_POINTS = ("shard", "commit")


@dataclass(frozen=True)
class Faults:
    """Where the run is cut short: after a step, or by a killed rank."""

    exit_after: int | None = None
    """The last step the loop runs (None: every step)."""
    kill_step: int | None = None
    """The step (1-based) in which ``kill_rank`` is killed (None: no rank is)."""
    kill_rank: int = 0
    kill_point: str = "start"
    """Where in the step, or in its save (``STEP_POINTS``, ``SAVE_POINTS``)."""


def _kill_spec(text: str) -> tuple[int, int, str]:
    step, rank, *point = text.split(":")
    points = (*STEP_POINTS, *SAVE_POINTS)
    known = len(point) == 0 or (len(point) == 1 and point[0] in points)
    if not (step.isdigit() and rank.isdigit() and known):
        raise argparse.ArgumentTypeError(
            f"--kill must be STEP:RANK[:POINT], POINT one of {points}, got {text!r}"
        )
    return int(step), int(rank), point[0] if point else "start"


def parse_faults(argv: Sequence[str]) -> tuple[Faults, list[str]]:
    """The faults asked for, and the arguments left for the job."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--exit-after", type=int, metavar="K", help="stop after step K")
    parser.add_argument(
        "--kill", type=_kill_spec, metavar="STEP:RANK[:POINT]", help="SIGKILL RANK there"
    )
    known, job_argv = parser.parse_known_args(argv)
    if known.exit_after is not None and known.exit_after < 1:
        parser.error(f"--exit-after must be a step >= 1, got {known.exit_after}")
    kill_step, kill_rank, kill_point = known.kill or (None, 0, "start")
    if kill_point == "commit" and kill_rank != 0:
        parser.error(f"--kill ...:commit needs rank 0 (DCP's coordinator), got {kill_rank}")
    return Faults(known.exit_after, kill_step, kill_rank, kill_point), job_argv


def _kill(where: str) -> None:
    print(f"rank {dist.get_rank()}: killed {where} (--kill)", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _due(faults: Faults, step: int, points: tuple[str, ...]) -> bool:
    """Whether this rank dies in step ``step`` (1-based) at one of ``points`` (first attempt
    only)."""
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    mine = dist.get_rank() == faults.kill_rank and faults.kill_point in points
    return first_attempt and mine and step == faults.kill_step


def _arm_step(point: str, job: Any, step: int) -> None:
    """Set the step's kill at ``point``: at once, or where it will come."""
    where = f"at step {step}" + ("" if point == "start" else f", {point}")
    halfway = [m for m in job.model.modules() if m is not job.model]
    module = halfway[len(halfway) // 2]
    if point == "start":
        _kill(where)
    elif point == "forward":
        module.register_forward_hook(lambda *_: _kill(where))
    elif point == "backward":

        def kill_in_backward(_module: Any, _inputs: Any, output: torch.Tensor) -> None:
            output.register_hook(lambda _grad: _kill(where))  # returns None: output unchanged

        module.register_forward_hook(kill_in_backward)
    elif point == "allreduce":
        all_reduce = dist.all_reduce

        def scalers_all_reduce(*args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("shardscale."):  # the scaler's, not the job's loss average
                _kill(where)
            return all_reduce(*args, **kwargs)

        dist.all_reduce = scalers_all_reduce
    else:  # update: the step taken (or skipped), the scale not moved yet
        job.scaler.update = lambda *_args, **_kwargs: _kill(where)


def _killing(faults: Faults, train_step: Callable[..., Any]) -> Callable[..., Any]:
    """``train_step``, killing ``faults.kill_rank`` in step ``faults.kill_step``."""

    def train_step_or_die(args: Any, job: Any, step: int, *batch: Any) -> Any:
        if _due(faults, step + 1, STEP_POINTS):
            _arm_step(faults.kill_point, job, step + 1)
        return train_step(args, job, step, *batch)

    return train_step_or_die


def _cut_shards_and_die(write_data: Callable[..., Any], where: str) -> Callable[..., Any]:
    """DCP's shard writer, which writes this rank's shard files, cuts each to half, and dies."""

    def write_half_and_die(self: FileSystemWriter, plan: Any, planner: Any) -> Any:
        results = write_data(self, plan, planner).wait()
        for relative in {result.storage_data.relative_path for result in results}:
            shard = Path(str(self.path)) / relative
            with open(shard, "r+b") as file:
                file.truncate(shard.stat().st_size // 2)
        _kill(where)

    return write_half_and_die


def _killing_saves(faults: Faults, save: Callable[..., Any]) -> Callable[..., Any]:
    """``save_checkpoint``, killing ``faults.kill_rank`` inside the save of ``faults.kill_step``."""

    def save_or_die(directory: Path, step: int, state: dict[str, Any]) -> None:
        if _due(faults, step, SAVE_POINTS):
            where = f"in the save of step {step}, {faults.kill_point}"
            if faults.kill_point == "shard":
                FileSystemWriter.write_data = _cut_shards_and_die(  # type: ignore[method-assign]
                    FileSystemWriter.write_data, where
                )
            else:  # commit: the coordinator, before the metadata
                FileSystemWriter.finish = lambda *_a, **_k: _kill(where)  # type: ignore[method-assign]
        save(directory, step, state)

    return save_or_die


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


def _cached(build_corpus: Callable[[], torch.Tensor], file: Path) -> Callable[[], torch.Tensor]:
    """``build_corpus``, its result kept in ``file`` (the same Python: the same bytes)."""

    def corpus() -> torch.Tensor:
        if not file.is_file():
            partial = file.with_name(f"{file.name}.{os.getpid()}")
            torch.save(build_corpus(), partial)
            os.replace(partial, file)  # whole, whoever writes it last
        loaded: torch.Tensor = torch.load(file)
        return loaded

    return corpus


def install(faults: Faults) -> None:
    """Wrap the job's functions with ``faults``."""
    if os.environ.get("SHARDSCALE_TEST_CORPUS"):
        train.build_corpus = _cached(train.build_corpus, Path(os.environ["SHARDSCALE_TEST_CORPUS"]))
    if faults.kill_step is not None:
        train.train_step = _killing(faults, train.train_step)
        train.save_checkpoint = _killing_saves(faults, train.save_checkpoint)
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
