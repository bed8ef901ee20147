#!/usr/bin/env bash
# Run the test suite: `python -m pytest -n 2` (two workers), installing first what it needs.
#
#   bash launch/test.sh                       # the whole suite, torch 2.13.0 (CPU), as CI runs it
#   bash launch/test.sh -m integration -rA    # extra arguments go to pytest
#   TORCH=2.15.0 bash launch/test.sh          # the suite on another torch release
#   TORCH=2.11.0 WITH="verl[cpu]==0.9.1" bash launch/test.sh tests/test_integration_verl.py
#   REPORTS=runs/compat TORCH=2.15.0 bash launch/test.sh   # and keep the run's report
#
# Without TORCH: shardscale with its dev extras (pytest, hypothesis, the framework packages the
# integration tests run, the docs and lint tools) at the versions in .ci/constraints.txt, in the
# interpreter launch/python_env.sh picks.
#
# With TORCH=X.Y.Z: a virtual environment of its own, under $SHARDSCALE_VENVS (default
# ~/.cache/shardscale), holding torch==X.Y.Z, shardscale's test and megatron-test extras (the
# latter: what megatron-core's sources import) and the packages named in
# WITH (pip requirements, space-separated), each package's own pins honoured: only torch and
# pytest are pinned by us. It is made the first time and kept for the next run; it is made
# afresh when torch, WITH, pyproject.toml or the pins change, or with FRESH=1. shardscale itself
# is installed from this checkout (editable, no dependencies) at every run. pytest then runs
# `-m "not integration"` unless arguments are given: the frameworks pin a torch of their own.
# torch releases other than 2.13.0 come from PyPI as CUDA builds (several GB; they run on the
# CPU). A machine-wide pip constraint file (PIP_CONSTRAINT or pip.conf's `constraint`) that caps
# torch is set aside for these installs (PIP_CONSTRAINT=/dev/null): the release asked for wins.
#
# With REPORTS=DIR, pytest also writes its JUnit XML report into DIR (NAME.xml), and a
# description of the run goes beside it (NAME.json: the torch build, the commit, this command):
# .ci/compatibility.py makes docs/compatibility.md from them.
set -euo pipefail
typed=("$@")  # the arguments as given, for the run's description
if [[ -n "${REPORTS:-}" ]]; then
    REPORTS="$(mkdir -p "$REPORTS" && cd "$REPORTS" && pwd)"  # relative to where we were called
fi
cd "$(dirname "$0")/.."

# megatron_sources PYTHON: unpack megatron-core's pinned sources (tests/megatron_sources.py: its
# wheels need Python 3.12 or newer, so the tests import its sources, never install it) and export
# their folder for tests/test_integration_megatron.py; offline, those tests skip, saying why (or
# fail, with SHARDSCALE_REQUIRE_MEGATRON=1, as in CI)
megatron_sources() {
    if SHARDSCALE_MEGATRON_SOURCES="$("$1" tests/megatron_sources.py)"; then
        export SHARDSCALE_MEGATRON_SOURCES
    else
        echo "test.sh: megatron-core's sources could not be fetched" >&2
    fi
}

# reporting PYTHON PYTEST_ARGS...: with REPORTS set, describe the run into REPORTS and set
# report_args to what makes pytest write its report beside the description
report_args=()
reporting() {
    [[ -n "${REPORTS:-}" ]] || return 0
    local python="$1" name
    shift
    name="$REPORTS/$(date -u +%Y%m%dT%H%M%SZ)-$$"
    "$python" .ci/compatibility.py describe --torch "${TORCH:-}" --with "${WITH:-}" \
        "${typed[@]/#/--typed-arg=}" -- "$@" >"$name.json"
    report_args=(--junitxml "$name.xml")
}

if [[ -z "${TORCH:-}" ]]; then
    . launch/python_env.sh
    use_python_with dev "import shardscale, pytest, xdist, pytest_timeout, hypothesis, numpy, verl, trl, lightning, torchtitan, deepspeed, build, triton, psutil"
    megatron_sources "$PYTHON"
    reporting "$PYTHON" "$@"
    exec "$PYTHON" -m pytest -n 2 ${report_args[@]+"${report_args[@]}"} "$@"
fi

venv="${SHARDSCALE_VENVS:-$HOME/.cache/shardscale}/torch-$TORCH"
pins="$(grep -E '^(pytest|pytest-xdist)==' .ci/constraints.txt; echo "torch==$TORCH")"
stamp="$(printf '%s\n' "$pins" "${WITH:-}" "$(python3 --version)" | cat - pyproject.toml |
    sha256sum | cut -d' ' -f1)"
if [[ "${FRESH:-0}" == 1 || "$(cat "$venv/stamp" 2>/dev/null)" != "$stamp" ]]; then
    echo "test.sh: making $venv (torch $TORCH${WITH:+, $WITH})" >&2
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    constraints="$venv/constraints.txt"
    echo "$pins" >"$constraints"
    # shellcheck disable=SC2086  # WITH is a list of requirements
    PIP_CONSTRAINT=/dev/null "$venv/bin/python" -m pip install --quiet -c "$constraints" \
        "torch==$TORCH" ".[test,megatron-test]" ${WITH:-}
    echo "$stamp" >"$venv/stamp"
fi
PIP_CONSTRAINT=/dev/null "$venv/bin/python" -m pip install --quiet --no-deps -e .
"$venv/bin/python" -c 'import torch; print("test.sh: torch", torch.__version__)'
megatron_sources "$venv/bin/python"
if [[ $# -eq 0 ]]; then
    set -- -m "not integration"
fi
reporting "$venv/bin/python" "$@"
exec "$venv/bin/python" -m pytest -n 2 ${report_args[@]+"${report_args[@]}"} "$@"
