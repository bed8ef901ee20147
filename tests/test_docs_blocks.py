"""Every ```python block of README.md and docs/*.md runs, as written, on 2 gloo ranks.

A page's code is what users copy, so each block is a test: the suite collects them from the
Markdown itself (no copy of a block lives here) and executes each one on both ranks of one
2-rank gloo job, each in a fresh namespace. A block that cannot run in CI (it needs a GPU, or a
framework's model and parallel state that a page's few lines cannot build) starts with
``# Not run in CI: <the reason>``, a comment the reader sees on the page; the test checks that
each such marker gives a reason.

Why the suite's own harness and not a maintained Markdown-testing plugin (pytest-codeblocks,
pytest-markdown-docs, phmdoctest): those run each block in one process, and most of these
blocks are distributed (the scaler's agreement, the pipeline's stages, DCP, FSDP): they need
ranks, which ``tests.harness.run_ranks`` gives (forkserver, a ``FileStore``, a deadline), and all
blocks run in one spawn, which no plugin does. It also adds no test dependency.

What a block is given (fresh per block, the same on both ranks, so the replicas are replicated
by construction: the scaler's default for plain gradients):

* the names a page's loop leaves to the reader: ``model`` (a small MLP, its layers in
  ``model.blocks``), ``optimizer``, ``loader`` of ``(inputs, targets)``, ``loss_fn``,
  ``inputs``/``targets``/``batch``, ``loss`` (a forward not yet backwarded), ``scaler``,
  ``scheduler``, ``writer`` (a recorder with TensorBoard's ``add_scalar``/``add_histogram``),
  ``rank``, ``step``, ``device``, ``path`` (a folder both ranks share), ``model_state`` /
  ``optim_state`` (``get_state_dict``), ``optimizers`` (two), ``hidden``/``aux_loss``;
* a block with no ``import`` is an excerpt of a loop and also gets ``torch``, ``nn``,
  ``shardscale`` and ``ShardedGradScaler``; a block that imports must import what it uses (the
  README's quick start once lacked ``import torch``);
* a block that never calls ``scale()`` continues an iteration: ``scaler`` has scaled a loss and
  run its backward before the block runs;
* by what the block uses: ``PipelineStage`` gets a pipeline (pure PP: a stage per rank,
  ``stage_module``, ``stage_index``, ``num_stages``, ``pp_group``, ``is_first``, ``is_last``);
  ``AsyncShardedGradScaler`` gets an optimizer over ``master_params`` and a ``loader`` of
  batches.

A ``ShardScaleWarning`` fails the block: a page's code that makes the scaler warn shows users a
warning the page does not mention (the pipeline loop's global norm once did). After the first
failing block a rank stops, since its peer may be left in a collective; the failure names the
page and line, with the traceback.
"""

from __future__ import annotations

import contextlib
import io
import re
import tempfile
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardscale
from shardscale import ShardedGradScaler, ShardScaleWarning
from tests.harness import run_ranks

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN = "# Not run in CI:"
_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[ \t]*$")


@dataclass(frozen=True)
class Block:
    page: str
    """The page, relative to the repository (``docs/pipeline.md``)."""
    line: int
    """The line of the block's first code line on its page (1-based)."""
    code: str


def python_blocks() -> list[Block]:
    """Every ```python block of the pages, dedented as a list item's block is."""
    found = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        opened: tuple[int, str, bool] | None = None  # (line index, indent, python?)
        for number, text in enumerate(lines):
            fence = _FENCE.match(text)
            if fence is None:
                continue
            if opened is None:
                opened = (number, fence["indent"], fence["lang"] == "python")
                continue
            start, indent, python = opened
            if python:
                code = "\n".join(line.removeprefix(indent) for line in lines[start + 1 : number])
                found.append(Block(str(page.relative_to(ROOT)), start + 2, code))
            opened = None
    return found


def _is_marked(block: Block) -> bool:
    return block.code.lstrip().startswith(NOT_RUN)


class _Writer:
    """TensorBoard's ``SummaryWriter`` calls the pages use, recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.calls.append(("scalar", tag))

    def add_histogram(self, tag: str, values: torch.Tensor, step: int) -> None:
        self.calls.append(("histogram", tag))


class _Model(nn.Module):
    """A small MLP whose layers sit in ``blocks`` (the FSDP2 excerpt wraps each)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Linear(8, 16), nn.Linear(16, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[1](torch.tanh(self.blocks[0](x)))


def _loss_fn(output: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
    """Mean squared error, against zeros where a page passes no target."""
    return nn.functional.mse_loss(output, torch.zeros_like(output) if target is None else target)


def _data(width: int, out: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Three batches of 8, the same on every rank."""
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, width, generator=generator), torch.randn(8, out, generator=generator))
        for _ in range(3)
    ]


def _loop_names(rank: int, folder: str) -> dict[str, Any]:
    """The names a page's training loop leaves to the reader (module docstring)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = _Model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = _data(8, 4)
    inputs, targets = loader[0]
    first, second = model.blocks
    # before the forward below: it initialises the optimizer's state, stepping in place
    model_state, optim_state = get_state_dict(model, optimizer)
    return {
        "model": model,
        "optimizer": optimizer,
        "optimizers": [
            torch.optim.AdamW(first.parameters(), lr=1e-3),
            torch.optim.AdamW(second.parameters(), lr=1e-3),
        ],
        "loader": loader,
        "loss_fn": _loss_fn,
        "inputs": inputs,
        "targets": targets,
        "batch": inputs,
        "loss": _loss_fn(model(inputs), targets),
        "scaler": ShardedGradScaler(),
        "scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0),
        "writer": _Writer(),
        "rank": rank,
        "step": 0,
        "device": torch.device("cpu"),
        "path": folder,
        "model_state": model_state,
        "optim_state": optim_state,
        "hidden": torch.randn(2, 8, requires_grad=True),
        "aux_loss": torch.tensor(0.1, requires_grad=True),
    }


def _pipeline_names(rank: int, world_size: int) -> dict[str, Any]:
    """Pure pipeline parallelism: one stage per rank, the loss on the last."""
    from tests.pipelines import BLOCKS, WIDTH, Stage

    per_stage = BLOCKS // world_size
    stage_module = Stage(list(range(rank * per_stage, (rank + 1) * per_stage)))
    return {
        "stage_module": stage_module,
        "stage_index": rank,
        "num_stages": world_size,
        "pp_group": dist.group.WORLD,
        "is_first": rank == 0,
        "is_last": rank == world_size - 1,
        "optimizer": torch.optim.AdamW(stage_module.parameters(), lr=1e-3),
        "loader": _data(WIDTH, WIDTH),
    }


def _async_names(model: nn.Module) -> dict[str, Any]:
    """An optimizer over its own copy of the weights, and a loader of batches."""
    master_params = [p.detach().clone().requires_grad_() for p in model.parameters()]
    return {
        "master_params": master_params,
        "optimizer": torch.optim.AdamW(master_params, lr=1e-3),
        "loader": [inputs for inputs, _ in _data(8, 4)],
    }


def _namespace(block: Block, rank: int, world_size: int, folder: str) -> dict[str, Any]:
    names = _loop_names(rank, folder)
    if "PipelineStage" in block.code:
        names.update(_pipeline_names(rank, world_size))
    if "AsyncShardedGradScaler" in block.code:
        names.update(_async_names(names["model"]))
    if not re.search(r"^\s*(import|from)\s", block.code, re.MULTILINE):
        names.update(torch=torch, nn=nn, shardscale=shardscale, ShardedGradScaler=ShardedGradScaler)
    # a block without scale() continues an iteration; one that loads a state starts between
    # iterations (a load mid-iteration is refused)
    if not re.search(r"\bscale\(|\bload\(|load_state_dict\(", block.code):
        names["scaler"].scale(
            _loss_fn(names["model"](names["inputs"]), names["targets"])
        ).backward()
    return names


def _run(block: Block, namespace: dict[str, Any]) -> None:
    # Padded so that a traceback's line number is the page's.
    code = compile("\n" * (block.line - 1) + block.code, block.page, "exec")
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("error", ShardScaleWarning)
            exec(code, namespace)
    finally:
        if "pool" in namespace:  # the async page's optimizer thread: its last step runs
            namespace["pool"].shutdown(wait=True)


def _rank_run_blocks(rank: int, world_size: int, folder: str) -> list[tuple[str, int, str]]:
    """Run every unmarked block; return the failures as (page, line, traceback)."""
    for block in python_blocks():
        if _is_marked(block):
            continue
        try:
            _run(block, _namespace(block, rank, world_size, f"{folder}/{block.page}-{block.line}"))
        except Exception:
            return [(block.page, block.line, traceback.format_exc())]
        dist.barrier()
    return []


def test_docs_python_blocks_run_on_two_ranks() -> None:
    with tempfile.TemporaryDirectory(prefix="shardscale-docs-") as folder:
        answers = run_ranks(_rank_run_blocks, 2, folder, timeout_s=240.0, group_timeout_s=30.0)
    failures = [
        f"{page}:{line} on rank {rank}:\n{trace}"
        for rank, answer in enumerate(answers)
        for page, line, trace in answer
    ]
    assert not failures, "a docs code block fails as written:\n" + "\n".join(failures)


@pytest.mark.parametrize(
    "block", [b for b in python_blocks() if _is_marked(b)], ids=lambda b: f"{b.page}:{b.line}"
)
def test_docs_block_not_run_says_why(block: Block) -> None:
    first = block.code.lstrip().splitlines()[0]
    reason = first.removeprefix(NOT_RUN).strip()
    assert len(reason.split()) >= 3, (
        f"{block.page}:{block.line}: {NOT_RUN} needs a reason, got {first!r}"
    )


def test_docs_blocks_are_found() -> None:
    """The collector sees the pages' blocks, the README's quick start and pipeline.md's loop
    among them (a fence it misread would silently test nothing)."""
    blocks = python_blocks()
    pages = {block.page for block in blocks}
    assert {"README.md", "docs/pipeline.md", "docs/index.md"} <= pages
    fences = sum(
        len(re.findall(r"^[ \t]*```python[ \t]*$", page.read_text(), re.MULTILINE))
        for page in PAGES
    )
    assert len(blocks) == fences
