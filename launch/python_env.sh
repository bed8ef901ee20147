# Sourced by launch/run.sh and launch/test.sh, so that each works on a fresh clone with nothing
# installed. `use_python_with EXTRAS IMPORTS` sets PYTHON to an interpreter in which IMPORTS
# succeed, installing shardscale with EXTRAS (`pip install -e ".[EXTRAS]"`) there first if not.
#
# The interpreter is $PYTHON if set, else python3. A Python outside any virtual environment that
# refuses pip installs (PEP 668 "externally managed", as Debian's and Ubuntu's do) gets one in
# .venv instead, which sees the system's packages: a GPU machine's CUDA torch stays in use.
# Torch is pinned to the tested CPU build (.ci/constraints.txt) only where no torch is installed,
# so a CUDA build is never replaced.

use_python_with() {
    local extras="$1" imports="$2"
    PYTHON="${PYTHON:-python3}"
    if [[ -x .venv/bin/python && -z "${VIRTUAL_ENV:-}" ]] && ! "$PYTHON" -c "$imports" 2>/dev/null; then
        PYTHON=.venv/bin/python  # made by an earlier run
    fi
    "$PYTHON" -c "$imports" 2>/dev/null && return 0

    local managed
    managed="$("$PYTHON" -c 'import os, sys, sysconfig
outside_venv = sys.prefix == sys.base_prefix
marker = os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")
print(int(outside_venv and os.path.exists(marker)))')"
    if [[ "$managed" == 1 ]]; then
        echo "$(basename "$0"): this Python refuses pip installs (PEP 668): using .venv" >&2
        "$PYTHON" -m venv --system-site-packages .venv
        PYTHON=.venv/bin/python
    fi

    echo "$(basename "$0"): installing shardscale[$extras] into $("$PYTHON" -c 'import sys; print(sys.prefix)')" >&2
    local constraints
    constraints="$(mktemp)"
    if "$PYTHON" -c "import torch" 2>/dev/null; then
        grep -v '^torch==' .ci/constraints.txt > "$constraints"
    else
        cp .ci/constraints.txt "$constraints"
    fi
    # DeepSpeed's extra: build none of its ops at install time (the torch-autocast path needs none)
    DS_BUILD_OPS=0 "$PYTHON" -m pip install --quiet -c "$constraints" -e ".[$extras]"
    rm -f "$constraints"
}
