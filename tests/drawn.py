"""Scenarios drawn by Hypothesis as data, the same on every run.

The property tests that run hundreds of scenarios in a few processes (tests/test_rank_fuzz.py,
tests/test_torch_differential.py: one pair of ranks for all of them, not one per example) draw
them here and run them themselves, rather than under `@given`. Derandomized: the draws depend on
the strategy and the count alone, so a CI run and a local one see the same scenarios.
"""

from __future__ import annotations

from typing import TypeVar

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

T = TypeVar("T")


def derandomized(strategy: st.SearchStrategy[T], count: int) -> list[T]:
    """`count` examples of `strategy`, the same on every run."""
    drawn: list[T] = []

    @settings(
        max_examples=count,
        derandomize=True,
        database=None,
        phases=[Phase.generate],
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def collect(example: T) -> None:
        drawn.append(example)

    collect()
    return drawn[:count]
