"""Counting the collectives a block of code issues, to check "one collective per step".

Every collective torch runs reaches the process group through one dispatcher namespace, `c10d::`,
whatever the backend (gloo, NCCL) or caller (`torch.distributed`, DTensor, FSDP): a functional
collective (`_c10d_functional::all_reduce`, DTensor's) records its own operator *and* the `c10d::`
one it runs. Counting `c10d::` operators alone counts each collective once, ours and torch's alike.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from torch.profiler import ProfilerActivity, profile


@contextmanager
def count_collectives() -> Iterator[Counter[str]]:
    """Count, by operator name, the collectives issued inside the block on this rank.

    The counter is filled when the block exits.

    Examples:
        >>> with count_collectives() as counts:   # doctest: +SKIP
        ...     scaler.step(optimizer); scaler.update()
        >>> sum(counts.values())                  # doctest: +SKIP
        1
    """
    counts: Counter[str] = Counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        yield counts
    names = (event.name for event in prof.events())
    counts.update(name for name in names if name.startswith("c10d::") and name != "c10d::wait")
