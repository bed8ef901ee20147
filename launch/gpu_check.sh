#!/usr/bin/env bash
# Check shardscale on a GPU machine, the day one is lent, and record what happened in docs/gpu.md.
#
#   bash launch/gpu_check.sh            # PYTHON=/path/to/python to pick the interpreter
#
# Written for a machine with a CUDA build of torch (2.11 or newer), one or more GPUs, and no
# internet: it installs nothing the machine lacks. shardscale is installed in place without its
# dependencies (`pip install --no-deps -e .`), or, where pip cannot (offline build backend, a
# PEP 668 "externally managed" Python), put on PYTHONPATH. Then, each step running even if an
# earlier one failed:
#   1. the GPU-marked tests (`pytest -m "gpu or nccl"`), if pytest is there (it says so if not);
#   2. host-synchronisation checks under torch.cuda.set_sync_debug_mode("error"): fused
#      optimizers with clip_grad_norm_ / unscale_ / capturable, whose step + update must not
#      synchronise (inline Python; needs no pytest);
#   3. launch/bench/bench.py on one GPU (torchrun --standalone --nproc-per-node 1);
# and rewrites the results block of docs/gpu.md (between its gpu_check markers): the date, the
# GPUs, torch/CUDA/NCCL versions, the commit, and each step's outcome. Exit status: 0 if every
# step that ran passed, 1 otherwise, 2 if no GPU is visible (nothing is written then).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

PYTHON="${PYTHON:-python3}"
OUT="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"
say() { echo "gpu_check: $*" >&2; }

if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    say "$PYTHON sees no CUDA device (or no torch): nothing to check, docs/gpu.md left as it is"
    exit 2
fi

# shardscale from this checkout, without fetching anything
if "$PYTHON" -m pip install --quiet --no-deps --no-build-isolation -e . >"$OUT/pip.txt" 2>&1; then
    say "installed shardscale in place (pip install --no-deps -e .)"
else
    say "pip could not install shardscale in place (see $OUT/pip.txt): using PYTHONPATH=$PWD"
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! "$PYTHON" -c 'import shardscale' 2>"$OUT/import.txt"; then
    say "shardscale does not import:"
    cat "$OUT/import.txt" >&2
    exit 1
fi

failed=0

# 1. the GPU-marked tests. The project's pytest options name plugins (xdist, timeout) a bare
# machine may lack: they are dropped (-o addopts=), and coreutils' timeout bounds the run.
if "$PYTHON" -c 'import pytest' 2>/dev/null; then
    say "running the GPU-marked tests"
    timeout 1800 "$PYTHON" -m pytest tests -o addopts= -p no:cacheprovider -m "gpu or nccl" \
        --continue-on-collection-errors -rA -q >"$OUT/tests.txt" 2>&1
    status=$?
    tail -n 60 "$OUT/tests.txt" >&2
    echo "$status" >"$OUT/tests.status"
    [[ "$status" == 0 ]] || failed=1
else
    say "pytest is not installed for $PYTHON, and nothing is installed here: the GPU tests" \
        "did not run (install pytest, then run this again); the other checks still run"
    echo "pytest is not installed: not run" >"$OUT/tests.txt"
    echo "missing" >"$OUT/tests.status"
fi

# 2. host synchronisations: none in fused step + update, with or without clip / unscale_ (the
# cases of tests/test_gpu.py::test_cuda_fused_path_makes_no_host_sync, here without pytest)
say "running the host-synchronisation checks"
"$PYTHON" - >"$OUT/sync.txt" 2>&1 <<'PY'
import torch
from torch import nn

from shardscale import ShardedGradScaler

CASES = {
    "fused: step + update": ({"fused": True}, None),
    "fused: clip_grad_norm_ + step + update": ({"fused": True}, "clip"),
    "fused: unscale_ + step + update": ({"fused": True}, "unscale"),
    "fused + capturable: clip_grad_norm_ + step + update": (
        {"fused": True, "capturable": True},
        "clip",
    ),
}
failures = 0
for name, (options, before_step) in CASES.items():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, **options)
    scaler = ShardedGradScaler()
    try:
        for step in range(3):  # two warm-up steps make the cached constants
            optimizer.zero_grad()
            scaler.scale(model(torch.randn(4, 16, device="cuda")).pow(2).mean()).backward()
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
        print(f"ok      {name}: no host synchronisation")
    except Exception as error:  # what set_sync_debug_mode raises is a RuntimeError
        failures += 1
        print(f"FAILED  {name}: {type(error).__name__}: {str(error).splitlines()[0]}")
raise SystemExit(1 if failures else 0)
PY
status=$?
cat "$OUT/sync.txt" >&2
echo "$status" >"$OUT/sync.status"
[[ "$status" == 0 ]] || failed=1

# 3. the benchmark, on one GPU
say "running launch/bench/bench.py on one GPU"
timeout 1800 "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 1 \
    launch/bench/bench.py --rounds 10 --json "$OUT/bench.json" >"$OUT/bench.txt" 2>&1
status=$?
tail -n 40 "$OUT/bench.txt" >&2
echo "$status" >"$OUT/bench.status"
[[ "$status" == 0 ]] || failed=1

# the results block of docs/gpu.md
"$PYTHON" - "$OUT" <<'PY' || failed=1
import datetime
import pathlib
import subprocess
import sys

import torch

out = pathlib.Path(sys.argv[1])
page = pathlib.Path("docs/gpu.md")
begin, end = "<!-- gpu_check:begin -->", "<!-- gpu_check:end -->"


def text(name: str) -> str:
    path = out / name
    return path.read_text(errors="replace").strip() if path.exists() else "(not run)"


def outcome(name: str) -> str:
    status = text(f"{name}.status")
    return {"0": "passed", "missing": "not run (pytest missing)"}.get(status, f"FAILED ({status})")


def tail(name: str, lines: int) -> str:
    return "\n".join(text(name).splitlines()[-lines:])


try:
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
except (OSError, subprocess.CalledProcessError):
    commit = "unknown"
gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.distributed.is_nccl_available() else "none"
bench = text("bench.txt")
table_at = bench.find("world_size=")  # where bench.py's own Markdown report begins
fence = "```"
bench_block = bench[table_at:] if table_at >= 0 else f"{fence}\n{tail('bench.txt', 30)}\n{fence}"
block = f"""{begin}
Written by `launch/gpu_check.sh` on {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC.

| | |
|---|---|
| GPUs | {len(gpus)} × {", ".join(sorted(set(gpus)))} |
| torch | {torch.__version__} (CUDA {torch.version.cuda}, NCCL {nccl}) |
| shardscale commit | `{commit}` |
| GPU-marked tests | {outcome("tests")} |
| host-sync checks | {outcome("sync")} |
| benchmark | {outcome("bench")} |

GPU-marked tests (pytest's summary):

```
{tail("tests.txt", 40)}
```

Host-synchronisation checks:

```
{text("sync.txt")}
```

Benchmark (`torchrun --standalone --nproc-per-node 1 launch/bench/bench.py --rounds 10`):

{bench_block}
{end}"""
current = page.read_text()
if begin in current and end in current:
    head, rest = current.split(begin, 1)
    updated = head + block + rest.split(end, 1)[1]
else:
    updated = current.rstrip("\n") + "\n\n" + block + "\n"
page.write_text(updated)
print(f"gpu_check: wrote the results into {page}", file=sys.stderr)
PY

say "logs in $OUT; docs/gpu.md updated (review it, then commit it)"
exit "$failed"
