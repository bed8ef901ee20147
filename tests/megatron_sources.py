"""megatron-core's Python sources for the tests: fetched once, unpacked, imported from there.

megatron-core publishes wheels for Python 3.12 and newer only (0.19.2: cp312 and cp313,
`Requires-Python >=3.12`), and CI runs Python 3.11; its `megatron/core` sources import on 3.11
without CUDA, apex or Transformer Engine (0.19.2 warns that it falls back to torch's optimizers and
its own multi-tensor kernels; its `megatron/training` does not: it imports `typing.override`). So
the tests do not pip-install it: `python tests/megatron_sources.py` downloads the one pinned wheel
with pip (`pip download --python-version 3.12 --only-binary=:all: --no-deps`) and unpacks its
`megatron` package into a folder of its own, printed on stdout. launch/test.sh runs it before pytest
and exports the folder as SHARDSCALE_MEGATRON_SOURCES; the tests put it on `sys.path`. Without the
sources they skip, saying so, except where SHARDSCALE_REQUIRE_MEGATRON=1 (CI sets it): there they
fail.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

VERSION = "0.19.2"
"""The megatron-core release whose sources the tests import."""

SOURCES = "SHARDSCALE_MEGATRON_SOURCES"
REQUIRE = "SHARDSCALE_REQUIRE_MEGATRON"


def default_folder() -> Path:
    """Where `fetch()` unpacks by default: beside launch/test.sh's virtual environments."""
    home = os.environ.get("SHARDSCALE_VENVS") or str(Path.home() / ".cache" / "shardscale")
    return Path(home) / f"megatron-core-{VERSION}"


def folder() -> Path | None:
    """The unpacked sources (SHARDSCALE_MEGATRON_SOURCES, else the default folder), or None."""
    candidate = Path(os.environ.get(SOURCES) or default_folder())
    return candidate if (candidate / "megatron" / "core" / "__init__.py").is_file() else None


def missing_reason() -> str:
    """Why the Megatron tests cannot run here, for their skip (or failure, where required)."""
    return (
        f"megatron-core {VERSION}'s sources are not unpacked: run `python "
        f"tests/megatron_sources.py` (or bash launch/test.sh), or set {SOURCES}"
    )


def fetch(target: Path) -> Path:
    """Download megatron-core's wheel with pip and unpack its `megatron` package into
    `target` (kept as it is if it is there already). Returns `target`."""
    if (target / "megatron" / "core" / "__init__.py").is_file():
        return target
    with tempfile.TemporaryDirectory(prefix="megatron-wheel-") as scratch:
        download = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
        download += ["--python-version", "3.12", "--only-binary=:all:", "--dest", scratch]
        subprocess.run([*download, f"megatron-core=={VERSION}"], check=True, stdout=sys.stderr)
        (wheel,) = Path(scratch).glob("megatron_core-*.whl")
        partial = Path(scratch, "unpacked")
        with zipfile.ZipFile(wheel) as archive:
            members = [name for name in archive.namelist() if name.startswith("megatron/")]
            archive.extractall(partial, members)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(target, ignore_errors=True)
        shutil.move(str(partial), str(target))  # whole, or not at all
    return target


if __name__ == "__main__":
    print(fetch(Path(os.environ.get(SOURCES) or default_folder())))
