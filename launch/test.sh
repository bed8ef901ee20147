#!/usr/bin/env bash
# Run the test suite: `python -m pytest -n 2` (two workers), installing first what the suite needs
# if it is missing (launch/python_env.sh says where): shardscale with its dev extras (pytest,
# hypothesis, the framework packages the integration tests run, the docs and lint tools) at the
# versions in .ci/constraints.txt. Extra arguments go to pytest, e.g.
#   bash launch/test.sh -m integration -rA        # the framework tests only
set -euo pipefail
cd "$(dirname "$0")/.."
. launch/python_env.sh

use_python_with dev "import shardscale, pytest, xdist, pytest_timeout, hypothesis, numpy, verl, trl, lightning, torchtitan, build"
exec "$PYTHON" -m pytest -n 2 "$@"
