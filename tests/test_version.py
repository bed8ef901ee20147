"""One version source: pyproject.toml's, read back through the installed package's metadata."""

from __future__ import annotations

from pathlib import Path

import pytest

import shardscale


def test_version_is_pyprojects() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert shardscale.__version__ == pyproject["project"]["version"]
