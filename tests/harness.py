"""Run a function on N real ranks (gloo by default), fast, and never hang.

* Ranks are forked from a forkserver that has torch preloaded (~0.2 s per 2-rank run, against
  2-5 s for plain spawn).
* They meet on a ``FileStore`` in a fresh temporary folder: no ports, so runs side by side under
  pytest-xdist never collide.
* Each rank sends its result, or its traceback, to the parent *before* tearing the group down,
  so the rank that really failed is the one reported.
* The parent waits until a deadline, then kills every survivor and reports who never answered.

Rank functions must be module-level (they are pickled by reference) and should return plain
Python data (lists, numbers, dicts): use ``tensor.tolist()``.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

_PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "shardscale"]
_context = multiprocessing.get_context("forkserver")
_context.set_forkserver_preload(_PRELOAD)


class RankFailure(AssertionError):
    """One or more ranks raised, or never answered before the deadline."""


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    store_path: str,
    results: Any,
    args: tuple[Any, ...],
    group_timeout_s: float,
    backend: str,
    env: dict[str, str] | None = None,
) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # the profiler's start/stop chatter
    os.environ.update(env or {})  # before the process group, which reads its variables once
    # torch reads TORCH_DISTRIBUTED_DEBUG when torch.distributed is imported: in the forkserver,
    # before this rank's env was set. Read again, so that DETAIL wraps this rank's groups.
    dist.set_debug_level_from_env()
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    try:
        store = dist.FileStore(store_path, world_size)
        device_id = None
        if backend == "nccl":
            torch.cuda.set_device(rank)
            # Eager: the communicator is made here, by every rank, not lazily inside the first
            # collective, where a rank that never arrives would block ncclCommInitRank before
            # any sync_timeout could start counting.
            device_id = torch.device("cuda", rank)
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=group_timeout_s),
            device_id=device_id,
        )
        # Every rank's group is up before any runs `fn`: a rank that raises at once would
        # otherwise tear its group down while a peer's gloo is still connecting to it, and the
        # peer would fail in init ("Connection closed by peer"), not with the test's error.
        store.set(f"up/{rank}", "1")
        store.wait([f"up/{peer}" for peer in range(world_size)], timedelta(seconds=group_timeout_s))
        results.put((rank, True, fn(rank, world_size, *args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    *args: Any,
    timeout_s: float = 90.0,
    group_timeout_s: float = 30.0,
    backend: str = "gloo",
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return each rank's result.

    ``backend="nccl"`` puts rank r on CUDA device r and creates its communicator eagerly
    (``device_id``). ``env`` is set in each rank before its process group is created.

    Raises:
        RankFailure: with every failing rank's traceback, or the ranks that never answered.
    """
    results = _context.Queue()
    with tempfile.TemporaryDirectory(prefix="shardscale-ranks-") as folder:
        store_path = os.path.join(folder, "store")
        processes = [
            _context.Process(
                target=_rank_main,
                args=(
                    fn,
                    rank,
                    world_size,
                    store_path,
                    results,
                    args,
                    group_timeout_s,
                    backend,
                    env,
                ),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for process in processes:
            process.start()
        answers: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout_s
        grace_until: float | None = None
        try:
            while len(answers) < world_size:
                now = time.monotonic()
                # Once a rank has failed, give the others a short grace period, then stop:
                # a survivor may be blocked in a collective the failed rank will never join.
                if grace_until is None and any(not ok for ok, _ in answers.values()):
                    grace_until = now + 3.0
                end = deadline if grace_until is None else min(deadline, grace_until)
                if now >= end:
                    break
                try:
                    rank, ok, payload = results.get(timeout=min(end - now, 1.0))
                except queue.Empty:
                    for rank, process in enumerate(processes):  # died without a word: a signal
                        if rank not in answers and process.exitcode not in (None, 0):
                            answers[rank] = (False, f"exited with code {process.exitcode}")
                    continue
                answers[rank] = (ok, payload)
        finally:
            for process in processes:
                if process.is_alive():
                    process.kill()
            for process in processes:
                process.join(timeout=10)
    failures = [f"--- rank {r} raised:\n{p}" for r, (ok, p) in sorted(answers.items()) if not ok]
    silent = [r for r in range(world_size) if r not in answers]
    if failures or silent:
        message = "\n".join(failures)
        if silent:
            message += f"\nranks {silent} never answered within {timeout_s} s (killed)"
        raise RankFailure(message)
    return [answers[rank][1] for rank in range(world_size)]
