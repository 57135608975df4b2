"""When longattn registers with transformers: the first time something needs it, not at `import longattn`.

Registering (`longattn.register()`: `LongAttnConfig` and the model classes with the Auto classes, the `"longattn"`
attention implementation with its build hooks, the shareable save) needs longattn's classes, and they need
transformers' model machinery (`PreTrainedConfig`, `PreTrainedModel`, the stock modeling modules): seconds that a
bare `import torch, transformers` never pays, transformers' top level being lazy. So `import longattn` only installs
the hooks below (standard library only), and the first one that fires runs `register()`, once:

- longattn's configuration module is imported. Every model class, `apply_longattn`, `lengthen`, `LongAttnConfig`
  itself import it: whoever holds a longattn config or model finds the Auto classes, the implementation and the
  save hook in place, as when `import longattn` registered. The registration waits for the outermost longattn import
  under way to finish, so that it never reads a longattn module that is still being initialised (the configuration
  is imported from the middle of the modeling module, for one).
- transformers imports a stock modeling module whose attention class takes longattn's kinds (`STOCK_FAMILIES`, the
  packages of `integration_transformers.SUPPORTED_ATTENTION_CLASSES`). A lengthened folder (`"attn_implementation":
  "longattn"`) holds a stock config, so nothing of longattn is looked up when it loads; its family's modeling module
  is, before any model is built, so the implementation and the build hooks are registered in time.
- transformers imports its `AutoConfig` machinery (`configuration_auto`): the model type `"longattn"` is named there
  without importing anything (`name_config`), and its first lookup (`AutoConfig.from_pretrained(folder)`,
  `AutoModel.from_pretrained(folder)`, `AutoConfig.for_model("longattn")`) imports the configuration through the
  package's lazy attribute, hence registers, before transformers goes on to the model classes.

The hooks are post-import hooks: a finder first on `sys.meta_path` hands back the spec the other finders find, its
loader wrapped to call the hook once the module has executed. Nothing runs at the moment transformers' own modules
are half-imported: the callbacks of transformers modules only record names or register once the module is complete.
After the registration the finder answers nothing.

Fallbacks: with a transformers major version other than `TESTED_MAJOR` (read from the installed metadata, without
importing transformers), `install` registers at once, as before; and when `configuration_auto` does not look as
`name_config` expects, nothing is changed there (`FALLBACK` says why, with a warning): the other hooks still
register on first use, and `longattn.register()` does it up front. tests/test_cli.py fails if either fallback
is taken with the pinned transformers.

This module imports nothing from longattn (the package hands `install` its `register`).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from types import ModuleType

PACKAGE = __name__.rpartition(".")[0]
MODEL_TYPE = "longattn"
CONFIG_CLASS = "LongAttnConfig"
CONFIG_MODULE = f"{PACKAGE}.configuration_longattn"
CONFIGURATION_AUTO = "transformers.models.auto.configuration_auto"
TESTED_MAJOR = "5"
"""The transformers major version whose `configuration_auto` `name_config` was written against."""
STOCK_FAMILIES = (
    "bert",
    "roberta",
    "xlm_roberta",
    "electra",
    "gpt2",
    "opt",
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "phi3",
    "gemma",
    "bart",
)
"""The `transformers.models` packages of `integration_transformers.SUPPORTED_ATTENTION_CLASSES` (a test keeps the
two equal: that module imports transformers' model machinery, this one must not)."""

FALLBACK: str | None = None
"""Why `install` registered at once or the model type could not be named lazily; None while the lazy path holds."""

_register: Callable[[], None] | None = None
_original_names: dict | None = None  # transformers' own CONFIG_MAPPING names, while a copy names "longattn"
_pending = False
_registered = False
_waiting: dict[str, list[Callable[[ModuleType], None]]] = {}
_local = threading.local()  # depth: longattn modules executing in this thread; searching; registering


def _depth() -> int:
    return getattr(_local, "depth", 0)


def name_config(configuration_auto: ModuleType, *, named: bool) -> bool:
    """Name the model type `"longattn"` in transformers' `CONFIG_MAPPING` (or, once registered, take the name away
    again) without importing anything: the one function that relies on transformers internals.

    `CONFIG_MAPPING` (a `_LazyConfigMapping`) keeps a class *name* per model type (`_mapping`) and resolves it on first
    lookup as `getattr(_modules[model_type_to_module_name(model_type)], name)`, importing transformers' model package
    into `_modules` the first time. With `_modules` holding the longattn package for `"longattn"`, that `getattr` is
    the package's lazy attribute (PEP 562): it imports the configuration, which registers everything. The names are a
    copy, so that transformers' own `CONFIG_MAPPING_NAMES` (read by its docs and by every `_LazyAutoMapping`) never
    holds "longattn"; once registered, `AutoConfig.register` holds the class itself, as it did when `import longattn`
    registered, and `named=False` puts transformers' table back (the package stays in `_modules`, which only the
    names are looked up in: the lookup that registered reads it once more).

    Returns False, changing nothing, when the mapping is not built that way (another transformers version) or
    already names another class `"longattn"`.
    """
    global _original_names
    mapping = getattr(configuration_auto, "CONFIG_MAPPING", None)
    names = getattr(mapping, "_mapping", None)
    modules = getattr(mapping, "_modules", None)
    to_module = getattr(configuration_auto, "model_type_to_module_name", None)
    if not (isinstance(names, dict) and isinstance(modules, dict) and callable(to_module)):
        return False
    module_name = to_module(MODEL_TYPE)
    package = sys.modules[PACKAGE]
    if not named:
        # The module entry stays: the lookup that registered is still running, and reads it once more.
        if _original_names is not None and names.get(MODEL_TYPE) == CONFIG_CLASS:
            mapping._mapping, _original_names = _original_names, None
        return True
    if names.get(MODEL_TYPE, CONFIG_CLASS) != CONFIG_CLASS or modules.get(module_name, package) is not package:
        return False
    if MODEL_TYPE not in names:
        _original_names = names
        mapping._mapping = OrderedDict([*names.items(), (MODEL_TYPE, CONFIG_CLASS)])
    modules[module_name] = package
    if MODEL_TYPE in mapping:  # the lookup reads the names as assumed
        return True
    name_config(configuration_auto, named=False)
    del modules[module_name]
    return False


# ------------------------------------------------------------------------------------------------ the hooks
def _name_config(configuration_auto: ModuleType) -> None:
    global FALLBACK
    if _registered or name_config(configuration_auto, named=True):
        return
    FALLBACK = (
        f"{CONFIGURATION_AUTO}.CONFIG_MAPPING does not resolve model types as longattn expects (transformers "
        f"{getattr(sys.modules.get('transformers'), '__version__', '?')})"
    )
    warnings.warn(
        f"{FALLBACK}: call `longattn.register()` before loading a saved longattn model through the Auto classes "
        "(using any longattn model class or `LongAttnConfig` registers too).",
        RuntimeWarning,
        stacklevel=2,
    )


def _request(_module: ModuleType | None = None) -> None:
    """Register now, or when the outermost longattn import under way in this thread has finished."""
    global _pending
    if _registered:
        return
    _pending = True
    if _depth() == 0 and not getattr(_local, "registering", False) and _register is not None:
        _register()


@contextlib.contextmanager
def registering() -> Iterator[None]:
    """`register()`'s body runs inside: the hooks its own imports fire wait, and they are done with once it is."""
    global _pending
    outer = getattr(_local, "registering", False)
    _local.registering = True
    try:
        yield
    except BaseException:
        _pending = not _registered  # the next longattn import to finish tries again
        raise
    finally:
        _local.registering = outer
    registered()


def _executed(name: str, module: ModuleType) -> None:
    for callback in _waiting.pop(name, ()):
        callback(module)
    if _pending and name.startswith(f"{PACKAGE}."):
        _request()


def registered() -> None:
    """`register()` has run: the hooks have nothing left to do."""
    global _registered, _pending
    _registered, _pending = True, False
    _waiting.clear()
    configuration_auto = sys.modules.get(CONFIGURATION_AUTO)
    if configuration_auto is not None:
        name_config(configuration_auto, named=False)


def when_imported(name: str, callback: Callable[[ModuleType], None]) -> None:
    """Call `callback(module)` once module `name` has executed (now, if it is imported already: then before the
    hooks were installed, hence complete)."""
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
    else:
        _waiting.setdefault(name, []).append(callback)


class _HookedLoader:
    """The loader another finder found, which calls the hooks once the module has executed (the rest of the loader
    protocol, `get_code` for `python -m` and `get_resource_reader` among it, is the wrapped loader's)."""

    def __init__(self, loader) -> None:
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        name = module.__spec__.name
        own = name.startswith(f"{PACKAGE}.")
        _local.depth = _depth() + own
        try:
            self.loader.exec_module(module)
        finally:
            _local.depth = _depth() - own
        _executed(name, module)

    def __getattr__(self, attribute: str):
        if attribute == "loader":  # not set yet (a copy being made): no recursion
            raise AttributeError(attribute)
        return getattr(self.loader, attribute)


class PostImportFinder:
    """First on `sys.meta_path`: for the modules the hooks watch (and every longattn module, to know when the outermost
    longattn import has finished), the spec that the finders after it find, its loader wrapped."""

    def find_spec(self, name: str, path=None, target=None):
        if _registered or not (name in _waiting or name.startswith(f"{PACKAGE}.")):
            return None
        searching = _local.__dict__.setdefault("searching", set())
        if name in searching:  # asked again by a finder below (one that asks the whole meta path itself)
            return None
        searching.add(name)
        try:
            for finder in list(sys.meta_path):
                find = getattr(finder, "find_spec", None)
                spec = None if finder is self or find is None else find(name, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            searching.discard(name)
        # File-based modules only: the old paths of moved modules (longattn._moved) keep their own loader.
        if spec.loader is not None and spec.has_location and hasattr(spec.loader, "exec_module"):
            spec.loader = _HookedLoader(spec.loader)
        return spec


def _transformers_major() -> str | None:
    transformers = sys.modules.get("transformers")
    version = getattr(transformers, "__version__", None)
    if version is None:
        from importlib import metadata

        try:
            version = metadata.version("transformers")
        except metadata.PackageNotFoundError:
            return None
    return version.split(".")[0]


def install(register: Callable[[], None]) -> None:
    """Install the hooks (`import longattn`), each called at once for a module already imported; with an untested
    transformers major version, `register()` at once instead."""
    global _register, FALLBACK
    _register = register
    major = _transformers_major()
    if major not in (None, TESTED_MAJOR):
        FALLBACK = f"transformers {major}.x, not {TESTED_MAJOR}.x: registered at import"
        register()
        return
    if not any(isinstance(finder, PostImportFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, PostImportFinder())
    when_imported(CONFIGURATION_AUTO, _name_config)
    when_imported(CONFIG_MODULE, _request)
    for family in STOCK_FAMILIES:
        when_imported(f"transformers.models.{family}.modeling_{family}", _request)
