"""Counting the collectives a block of code issues, to check "one collective per step".

Every collective torch runs passes through one of two dispatcher namespaces, whatever the backend
(gloo, NCCL) or caller (`torch.distributed`, DTensor, FSDP): `c10d::` for the eager API and
`_c10d_functional::` for functional collectives. The profiler records both, so counting their
operators counts collectives, ours and torch's alike.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from torch.profiler import ProfilerActivity, profile

_NOT_COLLECTIVES = frozenset(
    {"_c10d_functional::wait_tensor", "_c10d_functional::_wrap_tensor_autograd", "c10d::wait"}
)


def _is_collective(name: str) -> bool:
    return name.startswith(("c10d::", "_c10d_functional::")) and name not in _NOT_COLLECTIVES


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
    counts.update(event.name for event in prof.events() if _is_collective(event.name))
