#!/usr/bin/env bash
# Start the example training job on this machine: NPROC ranks (default 2), gloo on CPUs or NCCL
# on GPUs (train.py picks). Every argument goes to launch/job/train.py, e.g.
#   bash launch/run.sh --steps 200 --inject-inf-every 25 --inject-rank 1 --plot runs/train.png
#   NPROC=4 bash launch/run.sh --parallel fsdp1
# Installs shardscale and the job's extras first if they are missing (launch/python_env.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
. launch/python_env.sh

use_python_with launch "import shardscale, matplotlib, numpy"
exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "${NPROC:-2}" launch/job/train.py "$@"
