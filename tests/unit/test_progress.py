"""Progress of long work (``node/progress.py``): the meter's rate and time left against a hand count; log lines at
their cadence and only for long work; bars on a terminal, one display for several at once; and the checkpoint's
write and check reporting through it (no sockets)."""

import io
import logging
import time

import pytest
import torch

from atoll.node import progress
from atoll.node.home.checkpoint import load_checkpoint, save_checkpoint
from atoll.node.progress import LOG_EVERY, QUIET_FOR, Bars, Meter, Tracker


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_meter_rate_and_time_left():
    m = Meter(1000, now=10.0)
    assert m.rate() is None and m.eta() is None
    m.update(250, now=15.0)
    assert m.rate() == 50.0 and m.eta() == 15.0  # 750 bytes left at 50 bytes/s
    m.update(5000, now=20.0)  # never past the total
    assert m.done == 1000 and m.eta() == 0.0
    assert Meter(2_000_000_000, 0.0).line().startswith("0.0 MB of 2.00 GB (0%)")
    with pytest.raises(ValueError):
        Meter(0, 0.0)


def test_log_lines_come_at_their_cadence_and_only_for_long_work(caplog):
    caplog.set_level(logging.INFO, "atoll")
    clock = Clock()
    with Tracker("quick", 100, clock=clock) as t:
        clock.t += QUIET_FOR / 2
        t.update(100)
    assert not caplog.records  # over before anything was worth a line

    t = Tracker("fragment 0: downloading the replica", 10_000_000, clock=clock)
    for _ in range(25):  # 25 s at 0.2 MB/s
        clock.t += 1.0
        t.update(t.meter.done + 200_000)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == int(25 // LOG_EVERY)  # one every LOG_EVERY seconds
    assert lines[0] == "fragment 0: downloading the replica: 2.0 MB of 10.0 MB (20%), 0.2 MB/s, 40 s left"
    t.close(ok=False)
    t.close()  # once only
    t.update(10_000_000)  # a late call after the end: nothing
    assert caplog.records[-1].getMessage() == (
        "fragment 0: downloading the replica: stopped after 25.0 s at 5.0 MB of 10.0 MB (0.2 MB/s)")
    assert len(caplog.records) == len(lines) + 1

    t = Tracker("checkpoint 3: writing ckpt-00000003.safetensors", 4_000_000, clock=clock)
    clock.t += LOG_EVERY
    t.update(1_000_000)
    clock.t += LOG_EVERY
    t.update(4_000_000)
    t.close()
    assert caplog.records[-1].getMessage() == (
        "checkpoint 3: writing ckpt-00000003.safetensors: done, 4.0 MB in 20.0 s (0.2 MB/s)")


def test_bars_on_a_terminal_share_one_display():
    out = io.StringIO()
    from rich.console import Console

    bars = Bars(Console(file=out, force_terminal=True, width=120))
    clock = Clock()
    a, b = Tracker("fragment 0", 1000, clock=clock, bars=bars), Tracker("fragment 1", 1000, clock=clock, bars=bars)
    clock.t += QUIET_FOR
    a.update(500)
    b.update(250)  # a second live display on one console would raise: they share one
    assert bars._tasks == 2
    a.close()
    b.close()
    assert bars._tasks == 0 and bars._progress is None  # stopped with the last bar
    assert "fragment 0" in out.getvalue() and "fragment 1" in out.getvalue()


def test_a_checkpoint_reports_its_write_and_its_check(tmp_path, monkeypatch):
    seen = []

    class Recording(Tracker):
        def update(self, done):
            seen.append((self.what, done, self.meter.total))
            super().update(done)

    def slow_save_file(tensors, path):  # safetensors' writer, made slow enough for the size watcher to see it grow
        from safetensors.torch import save

        data = save(tensors)
        with open(path, "wb") as f:
            for i in range(0, len(data), len(data) // 8):
                f.write(data[i:i + len(data) // 8])
                f.flush()
                time.sleep(0.05)

    monkeypatch.setattr("atoll.node.home.checkpoint.track", lambda what, total: Recording(what, total))
    monkeypatch.setattr("atoll.node.home.checkpoint.save_file", slow_save_file)
    monkeypatch.setattr("atoll.node.home.checkpoint.GROW_EVERY", 0.01)
    tensors = {"w": torch.randn(300_000), "b": torch.randn(1000)}
    save_checkpoint(tmp_path, tensors, {"step": 1})
    file_size = (tmp_path / "ckpt-00000001.safetensors").stat().st_size
    assert 4 * 301_000 < file_size < 4 * 301_000 + 1024  # the tensors and a header
    writes = [(done, total) for what, done, total in seen if "writing" in what]
    assert any(0 < done < file_size for done, _ in writes)  # the file seen growing while it was written
    assert writes[-1] == (2 * file_size, 2 * file_size)  # written, then read back for its hash: all of it
    assert [d for d, _ in writes] == sorted(d for d, _ in writes)
    seen.clear()
    loaded, _ = load_checkpoint(tmp_path)
    checks = [(done, total) for what, done, total in seen if "checking" in what]
    assert checks[-1] == (file_size, file_size) and torch.equal(loaded["w"], tensors["w"])


def test_track_draws_bars_only_when_logging_to_a_terminal(monkeypatch):
    monkeypatch.setattr(progress.log, "terminal", None)
    assert progress.track("x", 10).bars is None
    from rich.console import Console

    console = Console(file=io.StringIO(), force_terminal=True)
    monkeypatch.setattr(progress.log, "terminal", console)
    assert progress.track("x", 10).bars.console is console


def test_a_failing_bar_never_fails_the_work(caplog):
    """The tracker runs inside a state download and a checkpoint write: a display error is logged once, the bar is
    given back to the shared display, and progress goes on as log lines."""
    from rich.console import Console

    caplog.set_level(logging.INFO, "atoll")
    bars = Bars(Console(file=io.StringIO(), force_terminal=True))

    def broken(task, done, total=None):
        raise RuntimeError("terminal gone")

    bars.update = broken
    clock = Clock()
    t = Tracker("fragment 0: downloading the replica", 1000, clock=clock, bars=bars)
    for _ in range(3):
        clock.t += LOG_EVERY
        t.update(t.meter.done + 100)  # raises nothing
    t.close()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "terminal gone" in warnings[0].getMessage()
    assert bars._tasks == 0 and bars._progress is None  # its display stopped
    assert [r.getMessage() for r in caplog.records][-1].startswith("fragment 0: downloading the replica: done")
