"""The example job's data: English text that every machine with Python already has.

The corpus is the docstrings of the standard library's top-level modules (~0.9 MB of prose,
parsed with ``ast``, in sorted file order), byte-level tokenised (vocabulary of 256). Nothing is
downloaded. The same Python version gives the same corpus, byte for byte.

Batches are a pure function of (seed, step): the global batch of step ``s`` is drawn with a
generator seeded by ``(seed, s)`` and rank ``r`` takes its slice. So the data position is just
the step, and a resumed run sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import ast
import sysconfig
from pathlib import Path

import torch

VOCAB_SIZE = 256
_HELD_OUT = 0.1  # the corpus's last tenth is for evaluation only


def build_corpus() -> torch.Tensor:
    """The corpus as a uint8 tensor of bytes."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for path in sorted(stdlib.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                docstring = ast.get_docstring(node)
                if docstring:
                    texts.append(docstring)
    data = "\n\n".join(texts).encode("utf-8")
    if len(data) < 100_000:
        raise RuntimeError(
            f"the standard library at {stdlib} yielded only {len(data)} bytes of docstrings; "
            "the example job needs at least 100000"
        )
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class Batches:
    """Deterministic batches of (inputs, targets) from the corpus."""

    def __init__(self, corpus: torch.Tensor, seq_len: int, batch_size: int, seed: int) -> None:
        split = int(len(corpus) * (1 - _HELD_OUT))
        self.train, self.held_out = corpus[:split].long(), corpus[split:].long()
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed

    def _windows(self, tokens: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        offsets = torch.arange(self.seq_len + 1)
        windows = tokens[starts[:, None] + offsets]
        return windows[:, :-1], windows[:, 1:]

    def train_batch(self, step: int, rank: int, world_size: int) -> tuple[torch.Tensor, ...]:
        """This rank's slice of the global batch of ``step``."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        high = len(self.train) - self.seq_len - 1
        starts = torch.randint(0, high, (world_size * self.batch_size,), generator=generator)
        mine = starts[rank * self.batch_size : (rank + 1) * self.batch_size]
        return self._windows(self.train, mine)

    def held_out_batches(self, count: int) -> list[tuple[torch.Tensor, ...]]:
        """The same ``count`` evaluation batches every time."""
        high = len(self.held_out) - self.seq_len - 1
        starts = torch.linspace(0, high, count * self.batch_size).long()
        return [
            self._windows(self.held_out, starts[i * self.batch_size : (i + 1) * self.batch_size])
            for i in range(count)
        ]
