"""The package layout: what a Hub folder carries stays flat, the tooling lives in `longattn.train` / `longattn.tools`,
the old module paths still import (with a DeprecationWarning), and the wheel holds every subpackage and command.

The wheel test builds from a copy of the sources, installs into a fresh venv and runs there, away from this checkout:
`pytest -m packaging` selects it.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import shutil
import site
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import pytest
import tomllib

import longattn
from longattn._moved import MOVED, MOVED_NAMES
from longattn.tools import hub

REPO = Path(__file__).resolve().parents[1]
# The package's `__init__` and `__main__` (`python -m longattn`: the command line) are the package's entry points,
# not modules a Hub folder carries.
FLAT = sorted(path.stem for path in (REPO / "longattn").glob("*.py") if path.name not in ("__init__.py", "__main__.py"))
SCRIPTS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]


def test_hub_finds_the_flat_model_files_and_their_imports_stay_flat():
    """`hub.PACKAGE_DIR` is the flat package (not `tools/`), and every sibling import of the copied model files names
    a flat module: a file in a subpackage would be missing from a Hub folder."""
    assert hub.PACKAGE_DIR == Path(longattn.__file__).resolve().parent
    closure = hub.code_closure()
    assert {"configuration_longattn.py", "modeling_longattn.py", "attention_registry.py", "numerics.py"} <= set(closure)
    for name in closure:
        assert (hub.PACKAGE_DIR / name).is_file(), name
        for module in hub._sibling_imports(hub.PACKAGE_DIR / name)[0]:
            assert (hub.PACKAGE_DIR / f"{module}.py").is_file(), f"{name} imports .{module}, which is not flat"


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_module_paths_warn_and_are_the_moved_modules(old):
    new = importlib.import_module(MOVED[old])
    sys.modules.pop(old, None)  # an earlier import would answer without warning
    with pytest.warns(DeprecationWarning, match=rf"`{old}` moved to `{MOVED[old]}`"):
        module = importlib.import_module(old)
    assert module is new and module.__spec__.name == MOVED[old]  # one module: a monkeypatch reaches both names
    name = {
        "longattn.training": "train",
        "longattn.data": "generate_task",
        "longattn.hub": "save_hub_folder",
        "longattn.visualize": "draw_pattern",
    }[old]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        exec(f"from {old} import {name}", namespace := {})
    assert namespace[name] is getattr(new, name)


def test_old_command_path_still_runs_and_warns():
    done = subprocess.run(
        [sys.executable, "-m", "longattn.hub", "--help"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "usage: longattn-hub" in done.stdout
    assert "DeprecationWarning: `longattn.hub` moved to `longattn.tools.hub`" in done.stderr


@pytest.mark.parametrize(
    ("old", "name"), [(old, name) for old, (_, names) in sorted(MOVED_NAMES.items()) for name in names]
)
def test_moved_names_warn_where_used_and_are_the_moved_objects(old, name):
    new = MOVED_NAMES[old][0]
    with pytest.warns(DeprecationWarning, match=rf"`{old}.{name}` moved to `{new}.{name}`") as caught:
        exec(f"from {old} import {name}", namespace := {})
    assert caught[0].filename == "<string>"  # the line that named it, not the lookup machinery
    assert namespace[name] is getattr(importlib.import_module(new), name)
    with pytest.warns(DeprecationWarning):
        assert getattr(importlib.import_module(old), name) is namespace[name]


def test_moved_names_leave_other_missing_names_alone():
    old = importlib.import_module("longattn.context_parallel")
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        old.not_a_name  # noqa: B018
    assert not hasattr(old, "__path__")  # a plain module still, not taken for a package


def _flat_imports(name: str) -> list[tuple[int, str]]:
    """Every import statement of flat module `name`, inside functions too, as (relative level, module): level 0 for
    an absolute import, 1 for a sibling, 2 for the package above."""
    tree = ast.parse((REPO / "longattn" / f"{name}.py").read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            found.extend(
                [(node.level, node.module)]
                if node.module
                else [(node.level, alias.name) for alias in node.names]  # `from . import x`
            )
        elif isinstance(node, ast.Import):
            found.extend((0, alias.name) for alias in node.names)
    return found


@pytest.mark.parametrize("name", FLAT)
def test_flat_modules_never_import_the_tooling(name):
    """No flat module names `longattn.train` / `longattn.tools`, not even lazily inside a function: they sit above
    the flat package, and a Hub folder carries the flat files without them."""
    for level, module in _flat_imports(name):
        assert level <= 1, f"{name}.py imports from the package above it ({'.' * level}{module})"
        full = module if level == 0 else f"longattn.{module}"
        assert full.split(".")[:2] not in (["longattn", "train"], ["longattn", "tools"]), f"{name}.py imports {full}"


def test_flat_modules_import_each_other_without_a_cycle():
    """The sibling imports of the flat modules, lazy ones inside functions included, form no cycle: every arrow
    points down, so each module can be read (and loaded from a Hub folder) after the ones it imports."""
    arrows = {name: {module.split(".")[0] for level, module in _flat_imports(name) if level == 1} for name in FLAT}
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            raise AssertionError("import cycle: " + " -> ".join([*path[path.index(name) :], name]))
        if name not in done:
            for below in sorted(arrows.get(name, ())):
                visit(below, [*path, name])
            done.add(name)

    for name in FLAT:
        visit(name, [])


def test_importing_the_flat_modules_loads_no_tooling():
    """Each flat module imported on its own, in a fresh process, loads nothing from `longattn.train` or
    `longattn.tools` (the package's `__init__`, which does, is left out: the modules load as a Hub folder's do)."""
    code = f"""
import importlib, json, sys, types
package = types.ModuleType("longattn")
package.__path__ = [{str(REPO / "longattn")!r}]
sys.modules["longattn"] = package  # the bare folder, without the package's __init__
offenders = {{}}
for name in {FLAT!r}:
    before = set(sys.modules)
    importlib.import_module("longattn." + name)
    loaded = sorted(m for m in set(sys.modules) - before if m.startswith(("longattn.train", "longattn.tools")))
    if loaded:
        offenders[name] = loaded
print(json.dumps(offenders))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {}


@pytest.mark.packaging
def test_wheel_holds_every_subpackage_and_command(tmp_path):
    """Build the wheel from a copy of the sources, install it (no dependencies) into a fresh venv that sees this
    interpreter's packages, import every module there and run every console script's --help."""
    pytest.importorskip("setuptools", reason="--no-build-isolation builds with this environment's setuptools")
    source = tmp_path / "src"
    shutil.copytree(REPO / "longattn", source / "longattn", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", "-q"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(tmp_path / "dist"), str(source)],
        check=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    (wheel,) = (tmp_path / "dist").glob("longattn-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for module in (
        "longattn/modeling_longattn.py",
        "longattn/train/training.py",
        "longattn/train/collators.py",
        "longattn/train/data.py",
        "longattn/tools/hub.py",
        "longattn/tools/visualize.py",
        "longattn/tools/lengthen.py",
    ):
        assert module in names, module

    venv = tmp_path / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True, timeout=120
    )
    python = venv / "bin" / "python"
    # The venv's own site-packages comes first; this interpreter's (torch, transformers, ...) after it, without
    # running its .pth files (an editable install of longattn there must not answer for the wheel).
    (purelib,) = venv.glob("lib/python*/site-packages")
    (purelib / "parent_environment.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run(
        [*pip, "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)],
        check=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )

    check = """
import importlib, pkgutil, sys
import longattn
assert longattn.__file__.startswith(sys.argv[1]), longattn.__file__
names = [m.name for m in pkgutil.walk_packages(longattn.__path__, "longattn.")]
for name in names:
    importlib.import_module(name)
print(" ".join(sorted(names)))
"""
    done = subprocess.run(
        [str(python), "-c", check, str(purelib)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    imported = done.stdout.split()
    assert {"longattn.train", "longattn.train.training", "longattn.tools", "longattn.tools.hub"} <= set(imported)
    runs = {
        script: subprocess.Popen(
            [str(venv / "bin" / script), "--help"],
            cwd=tmp_path,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for script in SCRIPTS
    }
    for script, process in runs.items():
        stdout, stderr = process.communicate(timeout=300)
        assert process.returncode == 0 and "usage:" in stdout, (script, stderr[-3000:])
