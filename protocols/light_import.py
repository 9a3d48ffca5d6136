"""hivemind's DHT, p2p and utils without torch, for the commands that only read the DHT (``atoll status``).

hivemind's package ``__init__`` files import everything they export: ``import hivemind.dht.node`` first runs
``hivemind/__init__.py``, which imports the averager, the optimizer and torch (about a second and 250 MiB), though
the DHT node, libp2p and the record validators never touch a tensor. ``install()`` puts in their place, in
``sys.modules``, packages whose names resolve on first use (PEP 562): ``from hivemind.utils import get_dht_time``
imports ``hivemind.utils.timed_storage`` only, and ``hivemind.DHT`` still gives hivemind's DHT (torch and all) to
whoever asks for it. What each package exports is read from its own ``__init__.py`` (its ``from ... import``
statements and constants), so the names are those of the installed hivemind, not a copy of them.

It must run before anything imports hivemind; after that it does nothing (the real packages are loaded).
"""

from __future__ import annotations

import ast
import importlib
import importlib.machinery
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

# The packages whose ``__init__`` imports torch on the way to the DHT: hivemind's own, hivemind.utils' (its
# ``MPFuture`` and ``TensorDescriptor``) and hivemind.dht's (its ``DHT``, which runs on ``MPFuture``).
LAZY_PACKAGES = ("hivemind", "hivemind.utils", "hivemind.dht")


def exports(init_file: Path, package: str) -> tuple[dict[str, str], dict[str, Any]]:
    """What a package's ``__init__.py`` defines at its top level: ({name: module it is imported from}, {name:
    constant}); relative imports resolved against ``package``. Other statements are not followed."""
    names: dict[str, str] = {}
    constants: dict[str, Any] = {}
    for node in ast.parse(init_file.read_text()).body:
        if isinstance(node, ast.ImportFrom):
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), package) if node.level \
                else str(node.module)
            for alias in node.names:
                if alias.name != "*":
                    names[alias.asname or alias.name] = base
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    constants[target.id] = node.value.value
    return names, constants


def _lazy_package(name: str, directory: Path) -> types.ModuleType:
    init_file = directory / "__init__.py"
    names, constants = exports(init_file, name)
    module = types.ModuleType(name)
    module.__file__ = str(init_file)
    module.__path__ = [str(directory)]
    module.__package__ = name
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, origin=str(init_file), is_package=True)
    module.__spec__.submodule_search_locations = [str(directory)]
    module.__dict__.update(constants)

    def __getattr__(attr: str) -> Any:
        if attr in names and names[attr] != name:
            value = getattr(importlib.import_module(names[attr]), attr)
        elif (directory / attr).is_dir() or (directory / f"{attr}.py").is_file():
            value = importlib.import_module(f"{name}.{attr}")
        else:
            raise AttributeError(f"module {name!r} has no attribute {attr!r}")
        setattr(module, attr, value)
        return value

    module.__getattr__ = __getattr__  # type: ignore[method-assign]
    return module


def install() -> bool:
    """Register hivemind's torch-importing packages as lazy ones; False (nothing done) if hivemind is already
    imported or not installed."""
    if "hivemind" in sys.modules:
        return False
    spec = importlib.util.find_spec("hivemind")
    if spec is None or not spec.submodule_search_locations:
        return False
    root = Path(next(iter(spec.submodule_search_locations)))
    for name in LAZY_PACKAGES:
        directory = root.joinpath(*name.split(".")[1:])
        module = _lazy_package(name, directory)
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)
    return True
