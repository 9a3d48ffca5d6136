"""House figures: the shape of an atoll source tree, measured so that one checkout can be compared with another.

Library (node/, protocols/, models/, every *.py): the largest file and those over 450 lines; the largest class (lines,
methods, distinct ``self.X`` attributes its methods assign, those ``__init__`` never assigns); the longest def and the
def with most parameters (``self``/``cls`` left out). Every folder of node/, protocols/, models/, scripts/, tests/: its
*.py files. scripts/ and tests/: files editing ``sys.path``, lines suppressing flake8's E402. scripts/: files importing
a bench (bench_*.py) as a library. tests/ (every *.py, helpers and conftest too): files importing a module of scripts/,
files importing another tests/ module. build/test-durations.json, if there: ``make test`` minutes, slowest modules.

    python -m scripts.house_figures [--root PATH] [--json OUT]      (or: python scripts/house_figures.py ...)

Stdlib only: it parses the tree it measures and imports nothing from it.
"""
from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
from collections import Counter
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator, NoReturn

LIBRARY = ("node", "protocols", "models")
FOLDERS = LIBRARY + ("scripts", "tests")
BIG_FILE = 450
E402 = "noqa: " + "E402"  # spelt in two so that this file does not count itself
FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef)


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line on stderr and exit status 2, never the usage block."""

    def error(self, message: str) -> NoReturn:
        """Print ``house_figures: error: message`` and exit 2."""
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def py_files(base: Path) -> list[Path]:
    """Every *.py under base, recursively and sorted; none when base is not a folder."""
    found = base.rglob("*.py") if base.is_dir() else iter(())
    return sorted(p for p in found if p.is_file() and "__pycache__" not in p.parts)


@lru_cache(maxsize=None)
def parse(path: Path) -> tuple[str, ast.Module | None]:
    """The file's text and syntax tree (None when it does not parse)."""
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        return text, ast.parse(text, filename=str(path))
    except (SyntaxError, ValueError):
        return text, None


def definitions(node: ast.AST, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Every class and def under node with its qualified name (Outer.method.inner), nested ones included."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.ClassDef, *FUNCS)):
            name = f"{prefix}.{child.name}" if prefix else child.name
            yield name, child
            yield from definitions(child, name)
        else:
            yield from definitions(child, prefix)


def lines_of(node: Any) -> int:
    """A definition's line count, end_lineno - lineno + 1 (decorators not counted)."""
    return node.end_lineno - node.lineno + 1


def unpack(target: Any) -> Iterator[Any]:
    """The single targets of an assignment target: tuples, lists and starred ones unpacked."""
    if isinstance(target, (ast.Tuple, ast.List)):
        for element in target.elts:
            yield from unpack(element)
    else:
        yield target.value if isinstance(target, ast.Starred) else target


def self_attributes(fn: ast.AST) -> set[str]:
    """Names assigned as ``self.X = ...`` or ``self.X: T = ...`` in fn (its nested defs too, nested classes not)."""
    names, stack = set(), list(ast.iter_child_nodes(fn))
    while stack:
        node = stack.pop()
        if isinstance(node, ast.ClassDef):
            continue
        tops = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AnnAssign) and node.value is not None else []
        names.update(t.attr for top in tops for t in unpack(top)
                     if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self")
        stack.extend(ast.iter_child_nodes(node))
    return names


def parameters(fn: Any) -> int:
    """Parameters of a def: args, posonlyargs, kwonlyargs, *vararg and **kwarg, without ``self``/``cls``."""
    a = fn.args
    return sum(p.arg not in ("self", "cls") for p in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg] if p)


def library_figures(root: Path) -> dict[str, Any]:
    """Figures 1-3: largest file, files over 450 lines, largest class, longest def, def with most parameters."""
    files = [p for folder in LIBRARY for p in py_files(root / folder)]
    sizes = {p.relative_to(root).as_posix(): len(parse(p)[0].splitlines()) for p in files}
    big = sorted((n for n in sizes if sizes[n] > BIG_FILE), key=lambda n: (-sizes[n], n))
    top = max(sizes, key=lambda n: sizes[n], default=None)
    defs = [(f"{p.relative_to(root).as_posix()}::{name}", node) for p in files if parse(p)[1]
            for name, node in definitions(parse(p)[1])]  # type: ignore[arg-type]
    classes = [d for d in defs if isinstance(d[1], ast.ClassDef)]
    funcs = [d for d in defs if not isinstance(d[1], ast.ClassDef)]
    largest = None
    if classes:
        name, cls = max(classes, key=lambda c: lines_of(c[1]))
        methods = [m for m in cls.body if isinstance(m, FUNCS)]
        attrs = set().union(*(self_attributes(m) for m in methods))
        in_init = set().union(*(self_attributes(m) for m in methods if m.name == "__init__"))
        largest = {"name": name, "lines": lines_of(cls), "methods": len(methods), "attributes": len(attrs),
                   "attributes_outside_init": sorted(attrs - in_init)}
    longest = max(funcs, key=lambda f: lines_of(f[1]), default=None)
    widest = max(funcs, key=lambda f: parameters(f[1]), default=None)
    return {"library_files": len(files), "largest_file": {"path": top, "lines": sizes[top]} if top else None,
            f"files_over_{BIG_FILE}": [{"path": n, "lines": sizes[n]} for n in big], "largest_class": largest,
            "longest_function": {"name": longest[0], "lines": lines_of(longest[1])} if longest else None,
            "most_parameters": {"name": widest[0], "parameters": parameters(widest[1])} if widest else None}


def files_per_folder(root: Path) -> dict[str, int]:
    """Figure 4: for every folder under node/, protocols/, models/, scripts/, tests/, its *.py files directly in it."""
    counts = Counter(p.parent.relative_to(root).as_posix() for folder in FOLDERS for p in py_files(root / folder))
    return dict(sorted(counts.items()))


def edits_sys_path(tree: ast.AST) -> bool:
    """Whether tree calls sys.path.insert/append/extend or assigns to sys.path (or a slice of it)."""
    for node in ast.walk(tree):
        call = ast.unparse(node.func) if isinstance(node, ast.Call) else ""
        if call in ("sys.path.insert", "sys.path.append", "sys.path.extend"):
            return True
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        if any(ast.unparse(t.value if isinstance(t, ast.Subscript) else t) == "sys.path" for t in targets):
            return True
    return False


@lru_cache(maxsize=None)
def module_names(base: Path) -> frozenset[str]:
    """Dotted names importable with base on sys.path: a/b.py -> a.b, a/__init__.py -> a, each folder above one."""
    names = set()
    for path in py_files(base):
        parts = list(path.relative_to(base).with_suffix("").parts)
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        names.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return frozenset(names)


def imported(tree: ast.AST, package: list[str]) -> Iterator[tuple[str, bool]]:
    """(dotted name, relative?) for each module an import in tree may load: ``import a.b`` -> a.b; ``from a import b``
    -> a and a.b; relative imports resolved against package (the file's folder, as parts below the scanned base)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((alias.name, False) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level - 1 <= len(package):
            stem = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(stem + ([node.module] if node.module else []))
            yield from [(module, bool(node.level))] if module else []
            yield from ((f"{module}.{a.name}".lstrip("."), bool(node.level)) for a in node.names if a.name != "*")


def resolve(name: str, relative: bool, prefix: str, names: frozenset[str]) -> str:
    """name as a module of the folder whose module names are given ('scripts.x' and 'x' alike), or ''."""
    explicit = relative or name.startswith(prefix + ".")
    name = name[len(prefix) + 1:] if name.startswith(prefix + ".") else name
    if not explicit and name.split(".")[0] in sys.stdlib_module_names:
        return ""
    return name if name in names else ""


def import_figures(root: Path) -> dict[str, Any]:
    """Figures 5-7: sys.path edits, E402 suppressions, benches imported as libraries, tests importing scripts/tests."""
    scripts, tests = root / "scripts", root / "tests"
    editors, e402, bench_users, on_scripts, on_tests = [], 0, [], [], []
    for base, path in ((base, p) for base in (scripts, tests) for p in py_files(base)):
        rel, (text, tree) = path.relative_to(root).as_posix(), parse(path)
        e402 += sum(E402 in line for line in text.splitlines())
        if tree is None:
            continue
        editors += [rel] if edits_sys_path(tree) else []
        package = list(path.parent.relative_to(base).parts)
        found, own = list(imported(tree, package)), {".".join(package + [path.stem]), path.stem, ""}
        from_scripts = {resolve(n, r, "scripts", module_names(scripts)) for n, r in found} - own
        if base == scripts:
            bench_users += [rel] if any(h.split(".")[-1].startswith("bench_") for h in from_scripts) else []
            continue
        on_scripts += [rel] if from_scripts else []
        local = module_names(tests) | module_names(path.parent)
        on_tests += [rel] if {resolve(n, r, "tests", local) for n, r in found} - own else []
    return {"sys_path_editors": editors, "noqa_e402_lines": e402, "scripts_importing_benches": bench_users,
            "tests_importing_scripts": on_scripts, "tests_importing_tests": on_tests}


def durations(root: Path) -> dict[str, Any] | None:
    """Figure 8: total minutes of build/test-durations.json and its ten slowest modules; None when it is absent."""
    path = root / "build" / "test-durations.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        total, per_module = float(data["total_seconds"]), Counter()
        for node_id, seconds in data["seconds"].items():
            per_module[node_id.split("::")[0]] += float(seconds)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return {"error": f"{path}: {type(exc).__name__}: {exc}"}
    slowest = sorted(per_module.items(), key=lambda kv: (-kv[1], kv[0]))[:10]
    return {"total_minutes": round(total / 60, 2), "slowest_modules": [{"path": p, "seconds": round(s, 1)}
                                                                        for p, s in slowest]}


def git_rev(root: Path) -> str | None:
    """``git -C root rev-parse --short HEAD``, or None outside git."""
    try:
        done = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return (done.stdout.strip() if done.returncode == 0 else "") or None


def table(f: dict[str, Any]) -> str:
    """The figures as plain text, one figure per line or small block."""
    big, cls, fn, wide, d = (f[k] for k in (f"files_over_{BIG_FILE}", "largest_class", "longest_function",
                                            "most_parameters", "test_durations"))
    out = [f"root                  {f['root']} (git {f['git_rev'] or '-'})",
           f"library files         {f['library_files']} in {', '.join(LIBRARY)}"]
    out += [f"largest file          {f['largest_file']['path']} ({f['largest_file']['lines']} lines)"] \
        if f["largest_file"] else []
    out += [f"files over {BIG_FILE} lines  {len(big)}"] + [f"    {b['lines']:6d}  {b['path']}" for b in big]
    out += [f"largest class         {cls['name']}: {cls['lines']} lines, {cls['methods']} methods, {cls['attributes']} "
            f"attributes ({len(cls['attributes_outside_init'])} first set outside __init__)"] if cls else []
    out += [f"longest function      {fn['name']} ({fn['lines']} lines)"] if fn else []
    out += [f"most parameters       {wide['name']} ({wide['parameters']})"] if wide else []
    out += ["files per folder"] + [f"    {n:6d}  {folder}/" for folder, n in f["files_per_folder"].items()]
    out += [f"sys.path editors      {len(f['sys_path_editors'])} files in scripts/ and tests/",
            f"E402 suppressions     {f['noqa_e402_lines']} lines in scripts/ and tests/",
            f"benches as libraries  {len(f['scripts_importing_benches'])} scripts/ files import a bench_* module",
            f"tests on scripts/     {len(f['tests_importing_scripts'])} tests/ files import a scripts/ module",
            f"tests on tests/       {len(f['tests_importing_tests'])} tests/ files import another tests/ module"]
    if d is None or "error" in d:
        out.append(f"make test             - ({d['error'] if d else 'no build/test-durations.json'})")
    else:
        out += [f"make test             {d['total_minutes']} min; slowest modules:"]
        out += [f"    {m['seconds']:6.1f}s {m['path']}" for m in d["slowest_modules"]]
    out += [f"not parsed            {', '.join(f['unparsed'])}"] if f["unparsed"] else []
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Measure --root, print the table, write --json; a bad argument is one line on stderr and exit status 2."""
    parser = Parser(prog="house_figures", description="Measure the shape of an atoll source tree.")
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent,
                        help="checkout to measure (default: the one holding this script)")
    parser.add_argument("--json", type=Path, metavar="OUT", help="also write the figures to OUT as JSON")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    if not root.is_dir():
        parser.error(f"--root {args.root}: not a directory")
    if not (root / "node").is_dir():
        parser.error(f"--root {args.root}: no node/ folder, not an atoll checkout")
    if args.json and not args.json.resolve().parent.is_dir():
        parser.error(f"--json {args.json}: its folder does not exist")
    try:
        figures: dict[str, Any] = {"root": str(root), "git_rev": git_rev(root), **library_figures(root),
                                   "files_per_folder": files_per_folder(root), **import_figures(root),
                                   "test_durations": durations(root)}
        figures["unparsed"] = [p.relative_to(root).as_posix() for folder in FOLDERS for p in py_files(root / folder)
                               if parse(p)[1] is None]
        print(table(figures))
        if args.json:
            args.json.write_text(json.dumps(figures, indent=1) + "\n", encoding="utf-8")
    except OSError as exc:
        parser.error(str(exc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
