"""What the docs quote from the code is read from the code: error texts, and figures tests pin.

docs/errors.md quotes the messages users will search for. Each quote checked here is raised for
real (cheaply, in one process) and compared with what the code says: the quote's pieces between
``...`` must appear, in order, in ``"<Type>: <message>"``. A quote whose trigger is listed here
but that the page no longer holds fails too, so a reworded row is noticed.

Figures a test already pins are held to that one place: docs/index.md's core line ceiling is
``tests/test_budget.py``'s ``CODE_LINES``; the meter's kernels per gradient tensor, as
docs/observability.md, docs/benchmarks.md and the scaler's docstring state them, are counted on
``meta``.
"""

from __future__ import annotations

import pickle
import re
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from shardscale import (
    AsyncShardedGradScaler,
    ShardedGradScaler,
    ShardScaleSkipError,
    load_whole,
)
from tests.test_budget import CODE_LINES

ROOT = Path(__file__).resolve().parent.parent
ERRORS = (ROOT / "docs" / "errors.md").read_text()


def _skip_limit() -> None:
    """Three steps with an inf, `max_consecutive_skips=2`: the third raises."""
    scaler = ShardedGradScaler(max_consecutive_skips=2)
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        scaler.scale(model(torch.ones(1, 2)).sum()).backward()
        model.weight.grad[0, 0] = float("inf")  # type: ignore[index]
        scaler.step(optimizer)
        scaler.update()


def _load(**changes: object) -> Callable[[], None]:
    def load() -> None:
        state = {**ShardedGradScaler().state_dict(), **changes}
        ShardedGradScaler().load_state_dict(state)

    return load


def _load_whole(saved: bool) -> Callable[[], None]:
    """`load_whole` of a folder that is no checkpoint, or of one saved without the scaler."""

    def load() -> None:
        folder = Path(tempfile.mkdtemp(prefix="shardscale-errors-"))
        with warnings.catch_warnings():  # DCP's "assuming ... a single process"
            warnings.simplefilter("ignore", UserWarning)
            if saved:
                dcp.save({"model": {"w": torch.ones(1)}}, checkpoint_id=folder)
            load_whole({"scaler": ShardedGradScaler()}, checkpoint_id=folder)

    return load


def _clip_before_scale() -> None:
    ShardedGradScaler().clip_grad_norm_(nn.Linear(2, 1).parameters(), 1.0)


def _scaled() -> tuple[ShardedGradScaler, torch.optim.Optimizer]:
    """A scaler and an optimizer after one scaled backward, ready for unscale_/step."""
    scaler, model = ShardedGradScaler(), nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    return scaler, optimizer


def _twice(first: str, second: str) -> Callable[[], None]:
    """`first` then `second` on the same optimizer, in one iteration."""

    def call() -> None:
        scaler, optimizer = _scaled()
        getattr(scaler, first)(optimizer)
        getattr(scaler, second)(optimizer)

    return call


def _update_alone() -> None:
    scaler, _ = _scaled()
    scaler.update()


def _step_before_scale() -> None:
    model = nn.Linear(2, 1)
    model(torch.ones(1, 2)).sum().backward()
    ShardedGradScaler().step(torch.optim.SGD(model.parameters(), lr=0.1))


def _load_mid_iteration() -> None:
    scaler, _ = _scaled()
    scaler.load_state_dict(scaler.state_dict())


def _clip_without_gradients() -> None:
    scaler = ShardedGradScaler()
    scaler.scale(torch.ones((), requires_grad=True))
    scaler.clip_grad_norm_(nn.Linear(2, 1).parameters(), 1.0)


# The quote's start (its row's error text) -> a call that raises it.
TRIGGERS: dict[str, Callable[[], object]] = {
    "device must name": lambda: ShardedGradScaler("gpu"),
    "growth_factor must be": lambda: ShardedGradScaler(growth_factor=0.5),
    "backoff_factor must be": lambda: ShardedGradScaler(backoff_factor=1.0),
    "hysteresis must be": lambda: ShardedGradScaler(hysteresis=0),
    "process_group must be": lambda: ShardedGradScaler(process_group="world"),  # type: ignore[arg-type]
    "verify_every must be": lambda: ShardedGradScaler(verify_every=-1),
    "max_retries must be": lambda: ShardedGradScaler(max_retries=-1),
    "init_scale must be": lambda: ShardedGradScaler(init_scale=-1.0),
    "growth_interval must be >= 1": lambda: ShardedGradScaler(growth_interval=0),
    "growth_interval must be an int": lambda: ShardedGradScaler(growth_interval=2.0),  # type: ignore[arg-type]
    "min_scale must be": lambda: ShardedGradScaler(min_scale=1e-50),
    "max_scale must be": lambda: ShardedGradScaler(max_scale=1e-9),
    "enabled must be": lambda: ShardedGradScaler(enabled=1),  # type: ignore[arg-type]
    "sync_timeout must be": lambda: ShardedGradScaler(sync_timeout=0.0),
    "max_consecutive_skips must be": lambda: ShardedGradScaler(max_consecutive_skips=0),
    "locate_overflow must be": lambda: ShardedGradScaler(locate_overflow=1),  # type: ignore[arg-type]
    "scale_policy must be": lambda: ShardedGradScaler(scale_policy="amax"),  # type: ignore[arg-type]
    "TypeError: scale() takes a Tensor": lambda: ShardedGradScaler().scale("loss"),  # type: ignore[arg-type]
    "TypeError: scale() takes floating-point": lambda: ShardedGradScaler().scale(
        torch.ones(1, dtype=torch.int64)
    ),
    "ValueError: state_dict['format_version']": _load(format_version=99),
    "ValueError: state_dict['scale'] must be finite": _load(scale=float("nan")),
    "TypeError: state_dict must be a mapping": lambda: ShardedGradScaler().load_state_dict([]),  # type: ignore[arg-type]
    "RuntimeError: Attempted step but _scale is None": _step_before_scale,
    "RuntimeError: unscale_() has already been called": _twice("unscale_", "unscale_"),
    "RuntimeError: unscale_() is being called after step()": _twice("step", "unscale_"),
    "RuntimeError: step() has already been called": _twice("step", "step"),
    "RuntimeError: No inf checks were recorded prior to update.": _update_alone,
    "ValueError: state_dict has unknown key(s)": _load(extra=1),
    "ShardScaleCheckpointError: checkpoint ...: its metadata": _load_whole(saved=False),
    "ShardScaleCheckpointError: checkpoint ... holds no entry": _load_whole(saved=True),
    "ValueError: state_dict counters must satisfy floor_streak": _load(
        steps=2, skipped_steps=1, consecutive_skips=1, last_overflow_step=2, floor_streak=2
    ),
    "TypeError: state_dict['scale'] must be a float": _load(scale="8"),
    "RuntimeError: Attempted clip_grad_norm_": _clip_before_scale,
    "RuntimeError: clip_grad_norm_() got parameters none": _clip_without_gradients,
    "RuntimeError: A GradScaler state may only be loaded": _load_mid_iteration,
    "ValueError: _growth_tracker must be in": _load(_growth_tracker=-1),
    "ShardScaleSkipError: step 3": _skip_limit,
    "ValueError: AsyncShardedGradScaler does not take verify_every": lambda: AsyncShardedGradScaler(
        verify_every=1
    ),
    "TypeError: an AsyncShardedGradScaler cannot be pickled": lambda: pickle.dumps(
        AsyncShardedGradScaler()
    ),
}


def _quote(start: str) -> str:
    """The page's backticked error text that begins with `start` (exactly one)."""
    quotes = [q for q in re.findall(r"`([^`]+)`", ERRORS) if q.startswith(start)]
    assert len(quotes) == 1, f"docs/errors.md holds {len(quotes)} quotes starting {start!r}"
    return quotes[0]


@pytest.mark.parametrize("start", list(TRIGGERS))
def test_errors_page_quote_is_what_the_code_raises(start: str) -> None:
    quote = _quote(start)
    with pytest.raises(Exception) as raised:  # noqa: PT011 (the quote names the type)
        TRIGGERS[start]()
    said = f"{type(raised.value).__name__}: {raised.value}"
    position = 0
    for piece in (p.strip() for p in quote.split("...")):
        found = said.find(piece, position)
        assert found >= 0, f"docs/errors.md quotes {quote!r}; the code says {said!r}"
        position = found + len(piece)
    if ShardScaleSkipError.__name__ in quote:
        assert isinstance(raised.value, ShardScaleSkipError)


def test_index_core_line_ceiling_is_the_budget_tests() -> None:
    index = (ROOT / "docs" / "index.md").read_text()
    stated = re.findall(r"the core within ([\d,]+) code lines", index)
    assert stated == [f"{CODE_LINES:,}"], (
        f"docs/index.md states the core ceiling as {stated}; tests/test_budget.py's CODE_LINES "
        f"is {CODE_LINES:,}"
    )


@pytest.mark.parametrize(("dtype", "per_tensor"), [(torch.float32, 4), (torch.float16, 5)])
def test_meter_kernels_per_tensor_are_what_the_docs_say(
    dtype: torch.dtype, per_tensor: int
) -> None:
    """Counted on meta for one tensor and for two: the difference is one tensor's kernels."""
    from shardscale import _bins
    from tests.devicepath import META, DeviceCounter

    def kernels(count: int) -> int:
        grads = [torch.ones(8, 4, dtype=dtype, device=META) for _ in range(count)]
        groups = [{(META, dtype): grads}]
        _bins.counted(groups, META, None)  # constants made once are not counted
        with DeviceCounter() as counter:
            _bins.counted(groups, META, None)
        return len(counter.kernels)

    assert kernels(2) - kernels(1) == per_tensor
    pages = {
        "docs/observability.md": "four kernels per gradient tensor",
        "docs/benchmarks.md": "four kernels per gradient tensor (five for an fp16 or bf16 one",
        "shardscale/scaler.py": "Four kernels per gradient tensor on those steps (five for",
    }
    for page, claim in pages.items():
        text = " ".join((ROOT / page).read_text().split())
        assert claim in text, f"{page} no longer says {claim!r}: count again, then say it"
