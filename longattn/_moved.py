"""The old paths of the modules that moved out of the flat package, importable for one release.

`longattn/` keeps flat only what a Hub folder loaded with `trust_remote_code` carries (the modules
`configuration_longattn.py` and `modeling_longattn.py` import); the tooling lives in `longattn.train` and
`longattn.tools`. `import longattn.hub` (or `python -m longattn.data ...`) still works and warns: the old name is the
moved module itself (`longattn.hub is longattn.tools.hub`), so a monkeypatch through either name reaches the same
functions. No file stands at an old path, so nothing else claims it.

Names that moved out of a module that stays (the model-level half of `longattn.context_parallel`, now
`longattn.train.context_parallel`) resolve through the staying module's `__getattr__` (`moved_names`): the new module
is imported on first use of an old name, never when the staying module is imported, so a flat module that offers an
old name still imports nothing above itself. This file imports nothing from longattn, so any flat module may use it
(a Hub folder then carries it too).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings

# old module path -> new one; removed in the release after 0.1
MOVED = {
    "longattn.training": "longattn.train.training",
    "longattn.data": "longattn.train.data",
    "longattn.hub": "longattn.tools.hub",
    "longattn.visualize": "longattn.tools.visualize",
}
_OWN_SPECS: dict = {}  # new module name -> its own spec

# module that stays -> (the module the names moved to, the names); removed in the release after 0.1
MOVED_NAMES = {
    "longattn.context_parallel": (
        "longattn.train.context_parallel",
        (
            "check_context_parallel",
            "context_parallel_paused",
            "enable_context_parallel",
            "reduce_gradients",
            "shard_batch",
        ),
    ),
}


def _warn(old: str, stacklevel: int) -> None:
    warnings.warn(
        f"`{old}` moved to `{MOVED[old]}`: import it from there (or use its console script); the old path "
        f"goes away in the next release.",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def moved_names(module: str):
    """The module-level `__getattr__` (PEP 562) for `module`, which stays but lost the names `MOVED_NAMES[module]`:
    an old name warns (pointing at the line that used it) and is the moved object itself; any other missing name
    raises AttributeError as usual. A module not in `MOVED_NAMES` (the same file loaded under another name, as from a
    Hub folder) gets the plain AttributeError for every name."""
    new, names = MOVED_NAMES.get(module, ("", ()))

    def __getattr__(name: str):
        if name not in names:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(
            f"`{module}.{name}` moved to `{new}.{name}`: import it from there; the old path goes away in the next "
            f"release.",
            DeprecationWarning,
            stacklevel=2,  # the caller of `__getattr__`: the `from ... import` or the attribute access
        )
        return getattr(importlib.import_module(new), name)

    return __getattr__


class MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """A finder and loader that answers an old path with the moved module, after a `DeprecationWarning`."""

    def find_spec(self, name, path=None, target=None):
        return importlib.machinery.ModuleSpec(name, self) if name in MOVED else None

    def create_module(self, spec):
        _warn(spec.name, stacklevel=3)  # the import statement (the import machinery's frames are skipped)
        module = importlib.import_module(MOVED[spec.name])
        # The import system sets `__spec__` to the old name's next; `exec_module` puts the module's own back.
        _OWN_SPECS[module.__name__] = module.__spec__
        return module

    def exec_module(self, module):
        module.__spec__ = _OWN_SPECS[module.__name__]

    def get_code(self, name):
        """`python -m longattn.data ...`: warn (from `__main__`, so that the default filters show it), then run the
        moved module's command line."""
        return compile(
            f"import sys\nfrom longattn._moved import _warn\n_warn({name!r}, stacklevel=2)\n"
            f"from {MOVED[name]} import main\nsys.exit(main())\n",
            f"<{name}>",
            "exec",
        )


def install() -> None:
    """Put the finder first on `sys.meta_path` (once): it answers the old paths only, and before any finder that
    could find a stale copy of an old module (an older installation of longattn)."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())
