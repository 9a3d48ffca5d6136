"""The architecture as the imports show it: ``models`` and ``protocols`` never reach into ``node``, and inside
``node`` the rooms stack in one order (docs/design.md, "Where things live"): the shared vocabulary at the top of
``node/`` (configuration, device, trainee, counters, log) imports no room; ``rounds/`` only that vocabulary;
``home/`` and ``ops/`` the rounds too; ``island/`` all of them; and only ``cli.py``, the front door, reaches into
every room. A module that imports upwards fails here with its file and line."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# A room may import the rooms listed for it (and itself); "top" is node/'s own modules.
ALLOWED = {
    "top": {"top"},
    "rounds": {"top", "rounds"},
    "home": {"top", "rounds", "home"},
    "ops": {"top", "rounds", "ops"},
    "island": {"top", "rounds", "home", "ops", "island"},
    "cli": {"top", "rounds", "home", "ops", "island"},
}
ROOMS = {"island", "rounds", "ops", "home"}


def imports(path: Path, package: list[str]):
    """(line, absolute dotted module) for every import in ``path``, a module of package ``package``."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            names = [module] if node.module else [f"{module}.{a.name}" for a in node.names]
            for name in names:
                yield node.lineno, name


def room_of(dotted: str) -> str | None:
    """The room of an ``atoll.node`` module (``top`` for node/'s own), None outside atoll.node."""
    parts = dotted.split(".")
    if parts[:2] != ["atoll", "node"]:
        return None
    return parts[2] if len(parts) > 3 and parts[2] in ROOMS else "top"


def package_of(path: Path) -> list[str]:
    rel = path.relative_to(ROOT).with_suffix("").parts
    top = {"node": "atoll.node", "protocols": "atoll.protocols", "models": "atoll.models"}[rel[0]]
    return [*top.split("."), *rel[1:-1]]


def test_models_and_protocols_never_import_node():
    offenders = [f"{p.relative_to(ROOT)}:{line} imports {name}"
                 for d in ("models", "protocols") for p in sorted((ROOT / d).rglob("*.py"))
                 for line, name in imports(p, package_of(p)) if name.startswith("atoll.node")]
    assert offenders == []


def test_the_rooms_of_node_import_only_downwards():
    offenders = []
    for p in sorted((ROOT / "node").rglob("*.py")):
        rel = p.relative_to(ROOT / "node").parts
        room = "cli" if rel == ("cli.py",) else rel[0] if len(rel) > 1 else "top"
        for line, name in imports(p, package_of(p)):
            target = room_of(name)
            if target is not None and target not in ALLOWED[room]:
                offenders.append(f"node/{'/'.join(rel)}:{line} ({room}) imports {name} ({target})")
    assert offenders == []


def test_the_checker_sees_an_upward_import(tmp_path):
    """The checks above can fail: a relative import out of rounds/ into island/ resolves to the island room."""
    module = tmp_path / "x.py"
    module.write_text("from ..island.island import Island\nfrom . import peers\n")
    found = [(room_of(name), name) for _, name in imports(module, ["atoll", "node", "rounds"])]
    assert found == [("island", "atoll.node.island.island"), ("rounds", "atoll.node.rounds.peers")]
