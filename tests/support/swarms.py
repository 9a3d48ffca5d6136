"""Checks of a live local swarm (``scripts/swarm.py``'s ``LocalSwarm``) shared by the integration tests."""

from __future__ import annotations

import re

from scripts.swarm import group_alive, peer_id, wait_for  # noqa: F401 (the tests take them from here with the checks)

# The model tests' swarm (test_models_swarm, test_hf_swarm). Synchronous DiLoCo: every round waits for every live
# daemon, so "3-member rounds" holds on a loaded machine too (decoupled at H=10 merged mostly alone there; the
# model is what these tests are about, not the algorithm).
MODELS_COMMON = ["--batch-size", "4", "--algorithm", "diloco", "--sync-every", "20",
                 "--gather-timeout", "8", "--round-timeout", "8", "--heartbeat", "1", "--eval-budget", "1",
                 "--harness", "step_delay=0.05"]


def events(d, kind):
    """A daemon's metrics events of ``kind``."""
    return [m for m in d.metrics() if m.get("event") == kind]


def last_step(d):
    """The step of a daemon's newest progress line (0 before its first)."""
    steps = [m["step"] for m in d.metrics() if "step" in m and "event" not in m]
    return steps[-1] if steps else 0


def _paired_rounds(swarm, names):
    """Per daemon of ``names``, how many of its rounds another of them recorded too (same fragment, version and
    group), checking that each such pair ended with the same Θ and the same contributors."""
    by_peer = {peer_id(swarm.daemons[n]): n for n in names}
    shared = {n: 0 for n in names}
    for name in names:
        me = peer_id(swarm.daemons[name])
        for r in swarm.daemons[name].rounds():
            group = set(r["members"])
            # Not against our own records: two of them for one fragment, version and group are two lives of this
            # daemon (a round it merged alone before a crash, lost with the crash, and the one after restart).
            for other in group & set(by_peer) - {me}:
                # The other daemon's record of the same round (a round's record holds its result, even if a
                # heavier replica was downloaded before the learner merged it).
                for o in swarm.daemons[by_peer[other]].rounds():
                    if o["version"] == r["version"] and o["fragment"] == r["fragment"] and set(o["members"]) == group:
                        shared[name] += 1
                        assert (o["hash"], sorted(o["contributors"])) == (r["hash"], sorted(r["contributors"])), (
                            f"round f{r['fragment']} v{r['version']}: {name} and {by_peer[other]} ended it apart")
    return shared


def assert_replicas_agree(swarm, names, settle=30):
    """Any two of ``names`` that recorded the same round (fragment, version and group) ended it with the same Θ
    and the same contributors, and every one of them shared at least one such round with another. A round's
    members write their records a moment apart: up to ``settle`` seconds for the others' records of a round one
    daemon already wrote."""
    try:
        wait_for(lambda: all(_paired_rounds(swarm, names).values()), settle, "rounds recorded by two daemons")
    except AssertionError:
        raise AssertionError(f"daemons that shared no round with another: {_paired_rounds(swarm, names)}") from None


def held_out_losses(daemon):
    return [r["held_out_loss"] for r in daemon.rounds() if r["held_out_loss"] is not None]


def assert_held_out_falls(swarm, names, founder, evaluations=4):
    """The founder's held-out loss falls from its first round's figure, which is near the untrained model's (under
    6), and every daemon of ``names`` ends below that first figure after at least ``evaluations`` evaluations.

    A joiner is not held to its own first figure: it joins the replica after the founder's first rounds, often on
    a plateau (a byte model's unigram plateau) where two successive one-batch estimates differ by noise alone."""
    first = held_out_losses(swarm.daemons[founder])
    assert first and first[0] < 6.0, (founder, first)
    for name in names:
        losses = held_out_losses(swarm.daemons[name])
        assert len(losses) >= evaluations and losses[-1] < first[0], (name, losses, founder, first[0])


def shared_rounds(daemon, members):
    """The rounds ``daemon`` merged with exactly ``members`` members."""
    return [r for r in daemon.rounds() if len(r["members"]) == members]


def wait_for_shared_rounds(swarm, names, count, timeout=240):
    """Until every daemon of ``names`` merged ``count`` rounds with all of them."""
    wait_for(lambda: all(len(shared_rounds(swarm.daemons[n], len(names))) >= count for n in names), timeout,
             f"{count} {len(names)}-member rounds on every daemon")


def stop_after_a_checkpoint(swarm, name):
    """Once ``name`` wrote a checkpoint, stop it cleanly; the step of its last checkpoint."""
    d = swarm.daemons[name]
    wait_for(lambda: list(d.workdir.glob("ckpt-*.json")), 120, f"{name} to write a checkpoint")
    assert swarm.stop(name) == 0, d.log()[-2000:]
    return max(m["step"] for m in d.metrics() if m.get("event") == "checkpoint")


def resumes_and_merges_again(swarm, name, step, *args, **kwargs):
    """Start ``name`` again (``swarm.start``'s arguments): it resumes from a checkpoint at ``step`` or later, and
    contributes to a round with another daemon. The rounds it merged since."""
    d = swarm.start(name, *args, **kwargs)
    resumed = wait_for(lambda: re.findall(r"resumed from checkpoint: version \d+, step (\d+)",
                                          d.log().split("stopped at step")[-1]), 120, f"{name} to resume")
    assert int(resumed[-1]) >= step, d.log()[-2000:]
    me, before = peer_id(d), len(d.rounds())
    return wait_for(lambda: [r for r in d.rounds()[before:] if me in r["contributors"] and len(r["members"]) >= 2],
                    180, f"{name} to merge with the others again")


def assert_refused_in_one_line(daemon, marker, message):
    """``daemon`` exits 2 with one log line holding ``marker``, which says ``message``, and no traceback."""
    assert daemon.proc.wait(120) == 2, daemon.log()[-2000:]
    lines = [line for line in daemon.log().splitlines() if marker in line]
    assert len(lines) == 1 and message in lines[0], daemon.log()[-2000:]
    assert "Traceback" not in daemon.log()
