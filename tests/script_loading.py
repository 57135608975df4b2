"""Import a script of `scripts/` or `recipes/` (not a package) as a module, for tests that call its functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def load_script(relative_path: str, name: str):
    """The module of `REPO / relative_path`, imported as `name` (registered in `sys.modules`: a script's dataclasses
    look their module up there)."""
    spec = importlib.util.spec_from_file_location(name, REPO / relative_path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
