"""One envelope for every benchmark's result file, and one way to save a plot (``scripts/results.py``): the keys a
result opens with, an earlier invocation kept when a benchmark writes to its file again, and every script under
scripts/ writing its JSON and its PNG through them."""

import ast
import json
import sys
from pathlib import Path

import pytest

from scripts import results

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def argv(monkeypatch):
    def set_argv(*args):
        monkeypatch.setattr(sys, "argv", [str(ROOT / "scripts" / "bench_x.py"), *args])

    return set_argv


def test_a_result_opens_with_the_envelope_and_keeps_its_figures(tmp_path, argv):
    argv("--seeds", "1", "2", "--out", "a b")
    path = results.write_result(tmp_path / "deep" / "x.json", {"rows": [1, 2], "seeds": [1, 2]})
    doc = json.loads(path.read_text())
    assert list(doc)[: len(results.ENVELOPE)] == list(results.ENVELOPE)
    assert doc["schema"] == 1 and doc["bench"] == "bench_x" and doc["seeds"] == [1, 2] and doc["rows"] == [1, 2]
    assert doc["command"] == "python -m scripts.bench_x --seeds 1 2 --out 'a b'"
    assert doc["git_rev"] is None or doc["git_rev"].split("+")[0].isalnum()
    assert doc["machine"]["cores"] >= 1 and "invocations" not in doc
    assert not list(tmp_path.glob("deep/*.tmp"))  # written through a temporary file, then renamed


def test_explicit_seeds_win_and_a_later_invocation_keeps_the_earlier_one(tmp_path, argv):
    argv("--seed", "3")
    path = results.write_result(tmp_path / "x.json", {"runs": ["first"]}, seeds=[3])
    assert json.loads(path.read_text())["seeds"] == [3]
    doc = json.loads(path.read_text())
    doc["runs"].append("second")
    argv("--seed", "4", "--append")
    results.write_result(path, doc, seeds=[4])
    again = json.loads(path.read_text())
    assert again["runs"] == ["first", "second"] and again["seeds"] == [4]
    assert again["command"] == "python -m scripts.bench_x --seed 4 --append"
    assert [i["command"] for i in again["invocations"]] == ["python -m scripts.bench_x --seed 3"]
    results.write_result(path, again, seeds=[4])  # the same command again: nothing new to keep
    assert len(json.loads(path.read_text())["invocations"]) == 1


def test_a_command_a_benchmark_spelt_itself_is_the_one_that_ran(tmp_path, argv):
    argv("--mib", "4")
    path = results.write_result(tmp_path / "x.json", {"command": "python -m scripts.bench_x --mib 4 --reps 9"})
    doc = json.loads(path.read_text())
    assert doc["command"] == "python -m scripts.bench_x --mib 4" and "invocations" not in doc


def test_a_figure_is_saved_with_its_command_and_closed(tmp_path, argv):
    argv("--plot")
    plt = results.pyplot()
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    path = results.save_figure(fig, tmp_path / "x.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert any("python -m scripts.bench_x --plot" in t.get_text() for t in fig.texts)
    assert not plt.fignum_exists(fig.number)


def calls(tree: ast.AST) -> list[str]:
    """The dotted names of every call in ``tree`` (``json.dump``, ``fig.savefig``, ``write_result``)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            out.append(f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", ""))
    return out


def test_every_benchmark_writes_through_the_envelope():
    """A bench (and the simulator, chaos, swarm_cpu) that writes JSON or a PNG does it through ``write_result`` and
    ``save_figure``; none calls ``savefig`` or ``json.dump``, or writes ``json.dumps`` output itself."""
    scripts = ROOT / "scripts"
    offenders, writers = [], 0
    others = [scripts / name for name in ("chaos.py", "simulate.py", "swarm_cpu.py", "sim/plots.py")]
    for path in sorted(scripts.glob("bench_*.py")) + others:
        tree = ast.parse(path.read_text())
        names = calls(tree)
        writers += "write_result" in names
        for bad in ("savefig", "dump"):
            if bad in names:
                offenders.append(f"{path.name}: {bad}")
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "write_text"
                    and node.args and "json.dumps" in ast.unparse(node.args[0])):
                offenders.append(f"{path.name}:{node.lineno}: write_text(json.dumps(...))")
    assert offenders == []
    assert writers >= 25  # the check above reads the benches it means to
