"""The demo's loss plot (``scripts/swarm.py``): the smoothed training loss against a naive reference, and
held-out points only where an evaluation ran."""

import random

import pytest
from scripts.swarm import plot_loss, smoothed


def test_smoothing_is_a_debiased_exponential_average():
    rng = random.Random(0)
    values = [rng.uniform(1, 5) for _ in range(50)]
    for w in (0.0, 0.5, 0.9):
        naive = [sum((1 - w) * w ** (i - k) * values[k] for k in range(i + 1)) / (1 - w ** (i + 1))
                 for i in range(len(values))]
        assert smoothed(values, w) == pytest.approx(naive, rel=1e-12)
    assert smoothed([3.0] * 10) == pytest.approx([3.0] * 10)  # the first points are not pulled toward zero


class _Daemon:
    def __init__(self, steps, rounds):
        self._steps, self._rounds = steps, rounds

    def metrics(self):
        return self._steps

    def rounds(self):
        return self._rounds


def test_held_out_points_are_the_evaluations_only(tmp_path, monkeypatch):
    import matplotlib.axes

    steps = [{"step": i, "tokens": 100 * i, "loss": 5.0 - i / 100} for i in range(1, 101)]
    # Rounds at steps 20, 40, 60, 80, 100; evaluations ran at 20 and 60 only (the others repeat the last figure).
    rounds = [{"event": "round", "step": s, "tokens": 100 * s, "held_out_loss": {20: 4.5, 40: 4.5, 60: 4.1,
                                                                                   80: 4.1, 100: 4.1}[s],
               "held_out_step": {20: 20, 40: 20, 60: 60, 80: 60, 100: 60}[s]} for s in (20, 40, 60, 80, 100)]
    plotted = []
    original = matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot",
                        lambda ax, *a, **k: plotted.append((a, k)) or original(ax, *a, **k))
    plot_loss(type("S", (), {"daemons": {"a": _Daemon(steps, rounds)}})(), tmp_path / "loss.png")
    held_out = [(a, k) for a, k in plotted if k.get("label") == "a held-out"]
    assert len(held_out) == 1 and list(held_out[0][0][0]) == [2000, 6000] and list(held_out[0][0][1]) == [4.5, 4.1]
    assert sum(1 for _, k in plotted if k.get("label") == "a train (smoothed)") == 1
    assert (tmp_path / "loss.png").stat().st_size > 0
