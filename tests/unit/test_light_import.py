"""The light commands import no torch (``protocols/light_import.py``, ``node/cli.py``'s ``LIGHT_COMMANDS``): each check
runs in a fresh interpreter and reads its ``sys.modules`` (no sockets)."""

import json
import subprocess
import sys
import types
from pathlib import Path

import hivemind
import hivemind.dht
import hivemind.utils
import pytest

from atoll.protocols.light_import import LAZY_PACKAGES, exports

HEAVY = ("torch", "atoll.models", "hivemind.averaging", "hivemind.optim", "hivemind.moe", "scipy")


def fresh(code: str) -> dict:
    """Run ``code`` (which sets ``out``) in a fresh interpreter; ``out`` and the heavy modules it imported."""
    wrapper = (f"import sys, json\n{code}\nheavy = sorted(m for m in sys.modules if m.startswith({HEAVY!r}))\n"
               "print(json.dumps({'out': out, 'heavy': heavy}))")
    done = subprocess.run([sys.executable, "-c", wrapper], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_readers_modules_and_the_light_parser_import_no_torch():
    doc = fresh("from atoll.protocols import light_import\n"
                "installed = light_import.install()\n"
                "import atoll.node.ops.status, atoll.node.ops.dashboard, atoll.node.ops.reader\n"
                "import atoll.protocols.revocation, atoll.protocols.record_validator, atoll.protocols.dht_io\n"
                "from atoll.node.cli import build_parser\n"
                "args = build_parser(light=True).parse_args(['status', '--initial-peers', '/ip4/1.2.3.4/tcp/1'])\n"
                "out = [installed, args.command]")
    assert doc["out"] == [True, "status"]
    assert doc["heavy"] == []


def test_the_light_commands_themselves_import_no_torch(tmp_path):
    """Each light command run to its first refusal (a missing run key: after its imports, before the network)."""
    peer = "/ip4/127.0.0.1/tcp/1/p2p/QmXoypizjW3WknFiJnKLwHCnL72vedxjQkDDP1mXWo6uco"
    missing = str(tmp_path / "missing.key")
    commands = [["revoke", "--run-key", missing, "--initial-peers", peer, "--peer-id", peer.rsplit("/", 1)[1]],
                ["token", "--run-key", missing, "--out", str(tmp_path / "t")],
                ["status", "--run-key", missing, "--initial-peers", peer],
                ["dashboard", "--run-key", missing, "--port", "0", "--initial-peers", peer]]
    for argv in commands:
        doc = fresh(f"from atoll.node.cli import main\nout = main({argv!r})")
        assert doc["out"] == 2 and doc["heavy"] == [], (argv, doc)


def test_without_the_lazy_packages_the_same_imports_bring_torch():
    """What the test above guards against: hivemind's own package ``__init__`` imports torch."""
    doc = fresh("import atoll.node.ops.status\nout = None")
    assert "torch" in doc["heavy"]


def test_a_command_that_trains_still_parses_with_every_subcommand():
    doc = fresh("from atoll.node.cli import build_parser\n"
                "sub = next(a for a in build_parser()._actions if a.__class__.__name__ == '_SubParsersAction')\n"
                "out = sorted(sub.choices)")
    assert {"start", "status", "dashboard", "token", "revoke", "data", "pause", "resume", "export"} <= set(doc["out"])


@pytest.mark.parametrize("package", [hivemind, hivemind.utils, hivemind.dht], ids=LAZY_PACKAGES)
def test_the_lazy_packages_export_what_hivemind_exports(package):
    """Every public name of the real package (imported in this process) is one the lazy package resolves, to an object
    of the same module and name (in a fresh interpreter)."""
    public = {n: v for n, v in vars(package).items() if not n.startswith("_") and not isinstance(v, types.ModuleType)}
    names, constants = exports(Path(package.__file__), package.__name__)
    assert set(public) == {n for n in [*names, *constants] if not n.startswith("_")}
    doc = fresh("from atoll.protocols import light_import\nlight_import.install()\nimport importlib\n"
                f"p = importlib.import_module({package.__name__!r})\n"
                f"out = {{n: [getattr(getattr(p, n), '__module__', None), getattr(getattr(p, n), '__qualname__', None)]"
                f" for n in {sorted(names)!r}}}\n"
                f"out.update({{n: repr(getattr(p, n)) for n in {sorted(constants)!r}}})")
    for name, value in public.items():
        if name in constants:
            assert doc["out"][name] == repr(value)
        else:
            assert doc["out"][name] == [getattr(value, "__module__", None), getattr(value, "__qualname__", None)], name


def test_install_does_nothing_once_hivemind_is_imported():
    from atoll.protocols import light_import

    assert "hivemind" in sys.modules and light_import.install() is False
    assert isinstance(sys.modules["hivemind"].DHT, type)


def test_exports_reads_from_imports_relative_imports_and_constants(tmp_path):
    init = tmp_path / "__init__.py"
    init.write_text("from pkg.a import x, y as z\nfrom .b import w\nfrom . import c\n__version__ = '1.2'\n"
                    "import os\nif os: q = 1\n")
    names, constants = exports(init, "pkg")
    assert names == {"x": "pkg.a", "z": "pkg.a", "w": "pkg.b", "c": "pkg"}
    assert constants == {"__version__": "1.2"}


def test_the_light_parser_refuses_a_heavy_command():
    from atoll.node.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser(light=True).parse_args(["start"])
