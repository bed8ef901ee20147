#!/usr/bin/env bash
# shardscale resolves beside the pins of the stacks it is for: pip --dry-run, nothing installed.
#
#   bash .ci/check_resolution.sh PYTHON
#
# PYTHON: an interpreter in a venv holding torch 2.11.0 (launch/test.sh's, TORCH=2.11.0).
# * verl[fsdp]==0.9.1 pins torch==2.11.0. Its flash-attn 2.8.3 is an sdist whose metadata build
#   imports torch (and wants CUDA): resolved in PYTHON's venv without build isolation, the CUDA
#   build skipped. The torch there is 2.11.0, so it must stay.
# * vllm==0.33.0 pins torch==2.14.0: resolved in a bare venv.
# Each must resolve with shardscale from this checkout, at the torch its stack pins.
# fast-deps: pip reads each wheel's metadata by HTTP range requests. The registry serves no
# separate metadata files, so pip would otherwise download every candidate it weighs in full:
# torch 2.15.0 and 2.14.0 are ~0.5 GB each (a download cut short there failed CI once).
set -euo pipefail
cd "$(dirname "$0")/.."
python="$1"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
export PIP_CONSTRAINT=/dev/null  # a machine-wide cap on torch must not decide (launch/test.sh)

# resolve NAME PYTHON EXPECTED_TORCH PIP_ARGS...: what pip would install, checked
resolve() {
    local name="$1" py="$2" torch="$3"
    shift 3
    "$py" -m pip install --dry-run --use-feature=fast-deps --quiet --report "$work/$name.json" . "$@" \
        >"$work/$name.log" 2>&1 || { cat "$work/$name.log"; echo "$name: does not resolve"; exit 1; }
    "$py" - "$work/$name.json" "$torch" "$name" <<'PY'
import json, sys
from importlib.metadata import version
report, torch_wanted, name = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3]
chosen = {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in report["install"]}
torch = chosen.get("torch") or version("torch").split("+")[0]  # not in the list: the one there
assert "shardscale" in chosen, f"{name}: shardscale is not among what pip would install"
assert torch == torch_wanted, f"{name}: pip would run torch {torch}, the stack pins {torch_wanted}"
print(f"{name}: resolves with shardscale {chosen['shardscale']}, torch {torch}")
PY
}

"$python" -m pip install --quiet "setuptools>=77,<82" wheel packaging psutil ninja
FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE resolve verl-fsdp "$python" 2.11.0 \
    --no-build-isolation "verl[fsdp]==0.9.1"
python3 -m venv "$work/bare"
"$work/bare/bin/python" -m pip install --quiet --upgrade pip
resolve vllm "$work/bare/bin/python" 2.14.0 "vllm==0.33.0"
