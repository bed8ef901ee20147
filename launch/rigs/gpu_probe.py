"""Two checks only a GPU can make, runnable without pytest (``launch/rigs/gpu_check.sh`` runs both).

    python launch/rigs/gpu_probe.py sync    # fused step + update make no host synchronisation
    python launch/rigs/gpu_probe.py graph   # step + update captured in a CUDA graph, replayed

``sync``: step + update with fused AdamW (after ``clip_grad_norm_``, ``unscale_`` or neither;
with ``capturable=True`` too) under ``torch.cuda.set_sync_debug_mode("error")``, which raises on
any call that waits for the GPU (``.item()``, a blocking copy to the host).

``graph``: step + update of a fused, capturable AdamW captured once in a CUDA graph, then replayed
on a clean step (the parameters move) and on an overflowing one (they hold, the scale halves).

Prints one line per case (``ok`` or ``FAILED``); exits 1 if any failed.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch
from torch import nn

from shardscale import ShardedGradScaler

FIT = {"scale_policy": "fit"}
METER = {"underflow_every": 1}  # the underflow meter (its histc) on every step
SYNC_CASES: dict[
    str, tuple[dict[str, Any], str | None] | tuple[dict[str, Any], str | None, Any]
] = {
    "fused: step + update": ({"fused": True}, None),
    "fused: clip_grad_norm_ + step + update": ({"fused": True}, "clip"),
    "fused: unscale_ + step + update": ({"fused": True}, "unscale"),
    "fused + capturable: step + update": ({"fused": True, "capturable": True}, None),
    "fused + capturable: clip_grad_norm_ + step + update": (
        {"fused": True, "capturable": True},
        "clip",
    ),
    'fused, scale_policy="fit": step + update': ({"fused": True}, None, FIT),
    'fused, scale_policy="fit": clip_grad_norm_ + step + update': ({"fused": True}, "clip", FIT),
    "fused, every step metered: step + update": ({"fused": True}, None, METER),
    "fused, every step metered: unscale_ + step + update": ({"fused": True}, "unscale", METER),
    "fused, every step metered: clip_grad_norm_ + step + update": (
        {"fused": True},
        "clip",
        METER,
    ),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).cuda()


def _backward(model: nn.Module, scaler: ShardedGradScaler, inputs: torch.Tensor) -> None:
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(inputs).float().pow(2).mean()
    scaler.scale(loss).backward()


def sync_case(options: dict[str, Any], before_step: str | None, scaler_options: Any = None) -> None:
    """Three steps; the third runs under ``set_sync_debug_mode("error")`` (the first two make
    the scaler's cached constants)."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, **options)
    scaler = ShardedGradScaler(**(scaler_options or {}))
    for step in range(3):
        optimizer.zero_grad()
        _backward(model, scaler, torch.randn(4, 16, device="cuda"))
        if step == 2:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            if before_step == "clip":
                scaler.clip_grad_norm_(model.parameters(), 1.0)
            elif before_step == "unscale":
                scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    if scaler.last_step_skipped:
        raise AssertionError("a clean step was skipped")


def graph_case(scaler_options: Any = None) -> None:
    """Capture step + update once, replay it clean and with an inf planted in a gradient."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True, capturable=True)
    scaler = ShardedGradScaler(init_scale=2.0**8, growth_interval=1000, **(scaler_options or {}))
    inputs = torch.randn(4, 16, device="cuda")
    side = torch.cuda.Stream()  # warm up on a side stream, as torch's CUDA-graph recipe asks
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            optimizer.zero_grad(set_to_none=False)
            _backward(model, scaler, inputs)
            scaler.step(optimizer)
            scaler.update()
    torch.cuda.current_stream().wait_stream(side)
    optimizer.zero_grad(set_to_none=False)
    _backward(model, scaler, inputs)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        scaler.step(optimizer)
        scaler.update()
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    graph.replay()
    if all(torch.equal(b, p) for b, p in zip(before, params, strict=True)):
        raise AssertionError("a clean replay left every parameter as it was")
    scale = scaler.get_scale()
    params[0].grad[0, 0] = math.inf  # the captured kernels read these same gradient tensors
    before = [p.detach().clone() for p in params]
    graph.replay()
    if not all(torch.equal(b, p) for b, p in zip(before, params, strict=True)):
        raise AssertionError("an overflowing replay moved the parameters")
    if scaler.get_scale() != scale / 2:
        raise AssertionError(f"an overflowing replay left the scale at {scaler.get_scale()}")


def main() -> int:
    which = sys.argv[1] if len(sys.argv) > 1 else ""
    if which == "sync":
        cases = {name: (lambda c=case: sync_case(*c)) for name, case in SYNC_CASES.items()}
    elif which == "graph":
        name = "fused + capturable: step + update captured, replayed clean and inf"
        cases = {
            name: graph_case,
            f'{name}, scale_policy="fit"': lambda: graph_case(FIT),
            f"{name}, every step metered": lambda: graph_case(METER),
        }
    else:
        print(f"usage: {sys.argv[0]} sync|graph (got {which!r})", file=sys.stderr)
        return 2
    failures = 0
    for name, case in cases.items():
        try:
            case()
            print(f"ok      {name}")
        except Exception as error:  # set_sync_debug_mode raises a RuntimeError
            failures += 1
            print(f"FAILED  {name}: {type(error).__name__}: {str(error).splitlines()[0]}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
