"""The house's budget, so that the next feature pays for its lines.

- **Size**: the core package (``shardscale/``, ``integrations/`` left out) holds at most 2,800
  lines of code: lines with a token that is neither a comment nor part of a docstring.
- **Cycles**: no import cycle among the package's modules (every import counts, those under
  ``TYPE_CHECKING`` too).
- **The walk**: one steady training step (the third; rank 0 of 2 gloo ranks, a small replicated
  model, gradients all-reduced by hand) enters at most 8 of the package's modules and 40 of its
  functions for a plain step + update, and at most 9 and 55 in every traced case. A reader who
  follows one step opens these (comprehensions count: they are functions of their own in
  Python 3.11).

The rules are those of the tools the budget was set with (``code_lines.py``, ``import_cycles.py``,
``step_walk.py``), restated here so that CI runs them from a clean clone.
"""

from __future__ import annotations

import ast
import io
import os
import sys
import tokenize
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import shardscale
from tests.harness import run_ranks

PACKAGE = Path(shardscale.__file__).resolve().parent
CODE_LINES = 2800
PLAIN_WALK = (8, 40)  # modules, functions
ANY_WALK = (9, 55)


def _code_lines(source: str) -> int:
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                docstrings.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    layout = {
        tokenize.COMMENT,
        tokenize.NL,
        tokenize.NEWLINE,
        tokenize.INDENT,
        tokenize.DEDENT,
        tokenize.ENDMARKER,
        tokenize.ENCODING,
    }
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in layout:
            lines.update(range(token.start[0], token.end[0] + 1))
    return len(lines - docstrings)


def test_core_code_lines_within_budget() -> None:
    core = [f for f in PACKAGE.rglob("*.py") if "integrations" not in f.relative_to(PACKAGE).parts]
    sizes = {str(f.relative_to(PACKAGE)): _code_lines(f.read_text()) for f in core}
    total = sum(sizes.values())
    assert total <= CODE_LINES, (
        f"the core package holds {total} lines of code, over its budget of {CODE_LINES}: "
        f"remove before adding ({sorted(sizes.items(), key=lambda item: -item[1])})"
    )


def _imports() -> dict[str, set[str]]:
    modules = {
        ".".join(("shardscale", *f.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(
            ".__init__"
        ): f
        for f in PACKAGE.rglob("*.py")
    }
    edges: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            edges[name].update(t for t in targets if t in modules and t not in (name, "shardscale"))
    return edges


def test_no_import_cycle() -> None:
    edges = _imports()
    state: dict[str, str] = {}  # "open" while on the current path, "done" after

    def find(module: str, path: list[str]) -> list[str] | None:
        state[module] = "open"
        for imported in sorted(edges[module]):
            if state.get(imported) == "open":
                return [*path[path.index(imported) :], imported]
            if imported not in state and (cycle := find(imported, [*path, imported])):
                return cycle
        state[module] = "done"
        return None

    for module in sorted(edges):
        if module not in state:
            cycle = find(module, [module])
            assert cycle is None, f"import cycle: {' -> '.join(cycle or [])}"


WALK_CASES = {  # name: (fused, clip, unscale_ first)
    "plain step": (False, False, False),
    "plain clip": (False, True, False),
    "plain unscale_+clip": (False, True, True),
    "fused step": (True, False, False),
    "fused clip": (True, True, False),
}


def _walk(fused: bool, clip: bool, unscale: bool) -> tuple[set[str], set[tuple[str, str]]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    options = {"fused": True} if fused else {"foreach": True}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, **options)  # type: ignore[arg-type]
    scaler = shardscale.ShardedGradScaler()
    inputs = torch.randn(8, 16)

    def one_step() -> None:
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(inputs).float().pow(2).mean()
        scaler.scale(loss).backward()
        for param in model.parameters():
            assert param.grad is not None
            dist.all_reduce(param.grad)
        if unscale:
            scaler.unscale_(optimizer)
        if clip:
            scaler.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()

    one_step()
    one_step()
    modules: set[str] = set()
    functions: set[tuple[str, str]] = set()
    root = str(PACKAGE) + os.sep

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(root):
            module = os.path.relpath(frame.f_code.co_filename, PACKAGE)
            modules.add(module)
            functions.add((module, frame.f_code.co_qualname))

    sys.setprofile(profile)
    try:
        one_step()
    finally:
        sys.setprofile(None)
    return modules, functions


def _rank_walks(rank: int, world_size: int) -> dict[str, tuple[list[str], list[str]]]:
    walks = {}
    for name, case in WALK_CASES.items():
        modules, functions = _walk(*case)
        walks[name] = (sorted(modules), sorted(f"{m}:{f}" for m, f in functions))
    return walks


def test_one_step_walks_within_budget() -> None:
    walks = run_ranks(_rank_walks, 2)[0]
    for name, (modules, functions) in walks.items():
        budget = PLAIN_WALK if name == "plain step" else ANY_WALK
        over = f"{name} is over its budget of {budget[0]} modules and {budget[1]} functions"
        assert len(modules) <= budget[0], f"{over}: {len(modules)} modules, {modules}"
        assert len(functions) <= budget[1], f"{over}: {len(functions)} functions, {functions}"
