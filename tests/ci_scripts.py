"""The scripts in `.ci/`, loaded as modules so their functions can be tested one by one."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

CI = Path(__file__).parents[1] / ".ci"


def load(name: str) -> ModuleType:
    """`.ci/<name>.py` as the module `name` (registered, as dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location(name, CI / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
