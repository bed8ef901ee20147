#!/usr/bin/env bash
# Check shardscale on one lent GPU, inside one command of the device tool: about 3 minutes on an
# H100, and at most 7 (the checks' timeouts and their 5 s kill grace add up to 410 s):
#
#   bash launch/rigs/gpu_check.sh RESULTS_DIR        # PYTHON=/path/to/python picks the interpreter
#
# Installs nothing: shardscale is taken from this checkout on PYTHONPATH, and everything else
# (torch with CUDA, pytest, pytest-xdist, pytest-timeout, hypothesis, numpy) must be there
# already. Each check runs under its own timeout, even if an earlier one failed, and prints one
# summary line:
#   tests    the GPU-marked tests (pytest -m "gpu or nccl"); NCCL ones run on a 1-rank group,
#            those needing two GPUs skip on one
#   sync     fused step + update (with clip_grad_norm_, unscale_, capturable) under
#            torch.cuda.set_sync_debug_mode("error"): no host synchronisation
#   graph    step + update of a fused capturable AdamW captured in a CUDA graph and replayed
#   count    host reads, copies and kernels per step on CUDA beside the meta device's counts
#   bench    launch/rigs/bench.py on one GPU: ours beside torch's two scalers and the floor
#   example  launch/examples/fsdp2_fp16.py for 3 steps on one GPU, then resumed to 5
# RESULTS_DIR gets summary.txt (the machine and one line per check) and one log per check
# (bench.json too): 8 files. Exit status: 0 if every check passed, 1 if any failed, 2 if no
# GPU is visible (then nothing is written, RESULTS_DIR is not made).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1

PYTHON="${PYTHON:-python3}"
say() { echo "gpu_check: $*"; }

if [[ $# -ne 1 ]]; then
    echo "usage: bash launch/rigs/gpu_check.sh RESULTS_DIR (where the logs and summary.txt go)" >&2
    exit 64
fi
if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null
then
    say "no CUDA device visible to $PYTHON (or no torch there): nothing checked, nothing written"
    exit 2
fi
mkdir -p "$1" && results="$(cd "$1" && pwd)" || exit 1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
summary="$results/summary.txt"

"$PYTHON" - >"$summary" <<'PY'
import os, subprocess, torch, torch.distributed as dist
# the device tool's copy of the tree may carry an older .git: GPU_CHECK_COMMIT names the commit
git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
commit = os.environ.get("GPU_CHECK_COMMIT") or git.stdout.strip() or "unknown (no git)"
nccl = ".".join(map(str, torch.cuda.nccl.version())) if dist.is_nccl_available() else "none"
names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
print(f"gpus: {torch.cuda.device_count()} x {', '.join(names)}")
print(f"torch: {torch.__version__} (CUDA {torch.version.cuda}, NCCL {nccl})")
print(f"commit: {commit}")
PY
cat "$summary"

failed=0
# check NAME SECONDS COMMAND...: run COMMAND under timeout into NAME.txt; one summary line
check() {
    local name="$1" limit="$2" start status outcome
    shift 2
    start=$SECONDS
    timeout --kill-after 5 "$limit" "$@" >"$results/$name.txt" 2>&1
    status=$?
    case "$status" in
        0) outcome="passed" ;;
        124 | 137) outcome="TIMED OUT after ${limit} s" ;;
        *) outcome="FAILED (exit $status)" ;;
    esac
    [[ "$status" == 0 ]] || failed=1
    echo "$name: $outcome in $((SECONDS - start)) s; $(tail -n 1 "$results/$name.txt")" |
        tee -a "$summary"
}

# the project's addopts (--dist loadgroup) stay; 4 workers share the one GPU
check tests 110 "$PYTHON" -m pytest tests -m "gpu or nccl" -p no:cacheprovider -n 4 \
    --timeout 120 -q -rA
check sync 35 "$PYTHON" launch/rigs/gpu_probe.py sync
check graph 35 "$PYTHON" launch/rigs/gpu_probe.py graph
check count 45 "$PYTHON" -c '
import subprocess, sys
for device in ("meta", "cuda"):
    print(f"--device {device}:", flush=True)
    subprocess.run([sys.executable, "launch/rigs/count_device_path.py", "--device", device],
                   check=True)'
check bench 80 "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 1 \
    launch/rigs/bench.py --rounds 10 --json "$results/bench.json"
example() {  # a first run, then a resume from its checkpoint
    local run=("$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 1
        launch/examples/fsdp2_fp16.py --checkpoint-dir "$checkpoints" --steps)
    "${run[@]}" 3 || return 1
    resumed="$("${run[@]}" 5)" || { echo "$resumed"; return 1; }
    echo "$resumed"
    grep -q '^resumed from .* at step 3, scale' <<<"$resumed" || return 1
    echo "resumed at step 3 and trained to step 5"
}
checkpoints="$(mktemp -d)"
export PYTHON checkpoints
export -f example  # timeout runs programs, not functions: a bash runs it
check example 75 bash -c example
rm -rf "$checkpoints"

say "results in $results (summary.txt and one log per check)"
exit "$failed"
