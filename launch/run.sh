#!/usr/bin/env bash
# Start the example training job on this machine: NPROC ranks (default 2), gloo on CPUs or NCCL
# on GPUs (train.py picks). Every argument goes to launch/train.py, e.g.
#   bash launch/run.sh --steps 200 --inject-inf-every 25 --inject-rank 1 --plot runs/train.png
#   NPROC=4 bash launch/run.sh --parallel fsdp1
# Installs shardscale and the job's extras first if they are missing.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! python -c "import shardscale, matplotlib, numpy" 2>/dev/null; then
    echo "run.sh: installing shardscale with the example job's extras" >&2
    constraint=()
    # Pin torch only when there is none: never replace the CUDA build a GPU machine has.
    python -c "import torch" 2>/dev/null || constraint=(-c .ci/constraints.txt)
    python -m pip install --quiet "${constraint[@]}" -e ".[launch]"
fi
exec torchrun --standalone --nproc-per-node "${NPROC:-2}" launch/train.py "$@"
