"""Lending the machine (node/island/pause.py): each policy triggers and releases, with an injected clock and readings
(and once against a real busy process); the pause state's hysteresis; --until and --max-hours; a trainee frees its
memory and gets back exactly the θ and optimizer state it had."""

import datetime as dt
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from atoll.node.config import ConfigError, NodeConfig, RunConfig
from atoll.node.island.pause import (OPERATOR, SAMPLE_EVERY, FilePresent, GpuBusy, HostLoad, PauseState, Schedule,
                                     in_window, tree_of)
from atoll.node.pause_specs import PolicyError, check_spec, deadline_of, parse_until, parse_window


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def at(hh: int, mm: int) -> dt.datetime:
    return dt.datetime(2026, 12, 4, hh, mm)


# ---- the time window ------------------------------------------------------------------------------------------
def test_window_crossing_midnight_against_a_minute_by_minute_reference():
    start, end = parse_window("22:00-06:00")
    for minute in range(0, 24 * 60):
        t = dt.time(minute // 60, minute % 60)
        assert in_window(t, start, end) == (minute >= 22 * 60 or minute < 6 * 60), t
    start, end = parse_window("09:30-17:00")
    for minute in range(0, 24 * 60):
        t = dt.time(minute // 60, minute % 60)
        assert in_window(t, start, end) == (9 * 60 + 30 <= minute < 17 * 60), t


@pytest.mark.parametrize("bad", ["22-06", "25:00-06:00", "10:00-10:00", "10:61-11:00", ""])
def test_bad_windows_are_refused(bad):
    with pytest.raises(PolicyError):
        parse_window(bad)


def test_schedule_pauses_outside_its_window_and_releases_inside():
    now = {"t": at(21, 59)}
    policy = Schedule("22:00-06:00", now=lambda: now["t"])
    assert policy.holds()  # before the window: paused
    now["t"] = at(22, 0)
    assert not policy.holds()
    now["t"] = at(5, 59)
    assert not policy.holds()
    now["t"] = at(6, 0)
    assert policy.holds()


# ---- a file ---------------------------------------------------------------------------------------------------
def test_file_policy_holds_while_the_file_exists(tmp_path):
    flag = tmp_path / "wanted"
    policy = FilePresent(str(flag))
    assert not policy.holds()
    flag.touch()
    assert policy.holds()
    flag.unlink()
    assert not policy.holds()


# ---- the host's load ------------------------------------------------------------------------------------------
def test_tree_of_finds_descendants_only():
    procs = {1: (0, 0), 10: (1, 0), 11: (10, 0), 12: (11, 0), 20: (1, 0), 21: (20, 0)}
    assert tree_of(10, procs) == {10, 11, 12}
    assert tree_of(20, procs) == {20, 21}


def test_host_load_counts_other_processes_only():
    """Two cores busy on the host, of which our tree (the daemon and its child) used 1.5: others used 0.5."""
    clock, host = Clock(), {"ticks": 0}
    procs = {100: (1, 0), 101: (100, 0), 200: (1, 0)}
    policy = HostLoad(cores=0.4, pid=100, read_host=lambda: host["ticks"], read_processes=lambda: dict(procs),
                      clock=clock, ticks_per_s=100)
    assert not policy.holds()  # the first sample starts the clock
    clock.t += 2.0
    host["ticks"] += 400  # 2 cores for 2 s
    procs[100], procs[101] = (1, 200), (100, 100)  # ours: 1 core + 0.5 core
    assert policy.holds() and policy.last_cores == pytest.approx(0.5)
    clock.t += 2.0
    host["ticks"] += 300  # ours only (1.5 cores)
    procs[100], procs[101] = (1, 400), (100, 200)
    assert not policy.holds() and policy.last_cores == pytest.approx(0.0)


def spin_outside_our_tree() -> int:
    """A process that spins one core, orphaned at once (its shell exits), so that it is not our descendant: the
    other user's job. Its pid."""
    out = subprocess.run(["sh", "-c", f"{sys.executable} -c 'while True: pass' >/dev/null 2>&1 & echo $!"],
                         capture_output=True, text=True, check=True)
    return int(out.stdout)


def test_host_load_sees_a_real_busy_process():
    """Another user's process that spins one core triggers ``busy:0.5``; once it ends, the policy releases.
    Sampled over 1 s."""
    policy = HostLoad(cores=0.5)
    policy.holds()
    time.sleep(1.0)
    idle = not policy.holds()
    pid = spin_outside_our_tree()
    try:
        time.sleep(0.5)  # the interpreter's start-up
        policy.holds()
        time.sleep(1.0)
        assert policy.holds(), policy.last_cores
    finally:
        os.kill(pid, 9)
    time.sleep(0.2)
    policy.holds()
    time.sleep(1.0)
    released = not policy.holds()
    assert released or not idle, f"others used {policy.last_cores:.2f} cores once the spinner ended"


def test_our_own_children_count_as_ours():
    """A spinning child of this process (as the DHT process and p2pd are the daemon's) is in our tree: its CPU
    time is subtracted from the host's, not counted as another's."""
    policy = HostLoad(cores=0.5, pid=os.getpid())
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        # Poll rather than sleep a fixed second: on a loaded machine the spinner may get little CPU in one second.
        # The check is unchanged: the child's CPU time is in our tree's reading, and it grows by half a second.
        first = second = None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            time.sleep(0.2)
            policy.holds()
            second = policy._last[2].get(spinner.pid)
            first = second if first is None else first
            if first is not None and second - first >= 0.5 * policy.ticks_per_s:
                break
    finally:
        spinner.kill()
        spinner.wait()
    assert first is not None and second is not None and second - first >= 0.5 * policy.ticks_per_s, (first, second)


def test_gpu_busy_by_nvml_sees_processes_outside_our_tree():
    running = [SimpleNamespace(pid=100)]  # our own context
    nvml = SimpleNamespace(nvmlDeviceGetComputeRunningProcesses=lambda h: list(running), nvmlShutdown=lambda: None)
    procs = {100: (1, 0), 101: (100, 0), 300: (1, 0)}
    policy = GpuBusy(nvml, "gpu0", pid=100, read_processes=lambda: procs)
    assert not policy.holds() and policy.unmapped is False
    running.append(SimpleNamespace(pid=101))  # our own DHT child, say
    assert not policy.holds()
    running.append(SimpleNamespace(pid=300))
    assert policy.holds()
    running[:] = running[:2]
    assert not policy.holds()


def test_gpu_busy_in_another_pid_namespace_counts_contexts_beyond_ours():
    running = [SimpleNamespace(pid=7001)]  # the host's pid of our own context: not one we know
    nvml = SimpleNamespace(nvmlDeviceGetComputeRunningProcesses=lambda h: list(running), nvmlShutdown=lambda: None)
    said = []
    policy = GpuBusy(nvml, "gpu0", pid=100, read_processes=lambda: {100: (1, 0)}, log=said.append)
    assert not policy.holds() and policy.unmapped and said
    running.append(SimpleNamespace(pid=7002))
    assert policy.holds()


def test_a_failing_nvml_reads_as_not_busy_and_says_so_once():
    def fail(_handle):
        raise RuntimeError("driver gone")

    said = []
    policy = GpuBusy(SimpleNamespace(nvmlDeviceGetComputeRunningProcesses=fail), "gpu0", pid=1, log=said.append)
    assert not policy.holds() and not policy.holds()
    assert len(said) == 1 and "driver gone" in said[0]


@pytest.mark.parametrize("spec,ok", [("busy", True), ("busy:0.5", True), ("file:/tmp/x", True), ("busy:x", False),
                                     ("busy:-1", False), ("file:", False), ("idle", False)])
def test_policy_specs(spec, ok):
    if ok:
        check_spec(spec)
    else:
        with pytest.raises(PolicyError):
            check_spec(spec)


# ---- the state: hysteresis and the operator ------------------------------------------------------------------------
class Toggle:
    name = "toggle"

    def __init__(self) -> None:
        self.on = False

    def holds(self) -> bool:
        return self.on

    def close(self) -> None:
        pass


def test_a_policy_pauses_at_once_and_releases_after_resume_after():
    clock, toggle = Clock(), Toggle()
    state = PauseState([toggle], resume_after=30.0, clock=clock)
    assert state.reasons() == []
    toggle.on = True
    clock.t += SAMPLE_EVERY
    assert state.reasons() == ["toggle"]
    toggle.on = False
    for _ in range(14):  # 28 s clear: not yet
        clock.t += SAMPLE_EVERY
        assert state.reasons() == ["toggle"]
    toggle.on = True  # it came back: the clear time starts over
    clock.t += SAMPLE_EVERY
    assert state.reasons() == ["toggle"]
    toggle.on = False
    clock.t += SAMPLE_EVERY
    state.reasons()
    clock.t += 30.0
    assert state.reasons() == []


def test_policies_are_sampled_at_most_every_sample_every():
    clock, calls = Clock(), []
    policy = SimpleNamespace(name="p", holds=lambda: calls.append(1) or False, close=lambda: None)
    state = PauseState([policy], clock=clock)
    for _ in range(5):
        state.reasons()
    clock.t += SAMPLE_EVERY
    state.reasons()
    assert len(calls) == 2


def test_operator_pause_and_resume():
    state = PauseState([], clock=Clock())
    state.request(True)
    assert state.reasons() == [OPERATOR] and state.changed.is_set()
    state.request(False)
    assert state.reasons() == []


# ---- leaving at a time ------------------------------------------------------------------------------------------
def test_until_and_max_hours():
    now = at(22, 0)
    assert parse_until("06:00", now) == dt.datetime(2026, 12, 5, 6, 0)
    assert parse_until("23:30", now) == dt.datetime(2026, 12, 4, 23, 30)
    assert parse_until("2026-12-05T06:00", now) == dt.datetime(2026, 12, 5, 6, 0)
    with pytest.raises(PolicyError, match="passed"):
        parse_until("2026-12-01T06:00", now)
    with pytest.raises(PolicyError):
        parse_until("tomorrow", now)
    mono = Clock(50.0)
    assert deadline_of(0, "", now, mono) is None
    assert deadline_of(2, "", now, mono) == 50.0 + 7200
    assert deadline_of(10, "23:00", now, mono) == 50.0 + 3600  # the earlier of the two
    state = PauseState([], deadline=60.0, clock=mono)
    assert not state.expired()
    mono.t = 60.0
    assert state.expired()


def test_config_refuses_bad_lending_options(tmp_path):
    base = dict(run=RunConfig())
    for fields, message in [({"pause_when": ("idle",)}, "pause_when: unknown policy"),
                            ({"schedule": "9-5"}, "schedule: expected HH:MM-HH:MM"),
                            ({"until": "2020-01-01T00:00"}, "until: 2020-01-01T00:00 has passed"),
                            ({"pause_to": "checkpoint"}, "pause_to: checkpoint"),
                            ({"max_hours": -1.0}, "max_hours"),
                            ({"pause_when": ("busy",), "nproc_per_node": 2}, "several ranks"),
                            ({"control_socket": "/" + "x" * 200}, "control_socket")]:
        with pytest.raises(ConfigError, match=message):
            NodeConfig(**base, **fields).validate()
    NodeConfig(**base, pause_when=("busy", f"file:{tmp_path}/f"), schedule="22:00-06:00", until="06:00",
               max_hours=8.0).validate()


# ---- the trainee lets go of its memory and gets it back ---------------------------------------------------------------
def trained_learner(device_name="cpu"):
    from atoll.models.configs import MODELS
    from atoll.models.data import Corpus, load_corpus
    from atoll.node.device import resolve_device
    from atoll.node.island.learner import Learner

    run = RunConfig(model="nano")
    tokens, _ = load_corpus("builtin")
    learner = Learner(run, resolve_device(device_name), Corpus(tokens, MODELS["nano"].seq_len, run.num_shards),
                      shard=0, batch_size=2)
    for _ in range(3):
        learner.train_step()
    return learner


@pytest.mark.parametrize("keep", [True, False])
def test_release_frees_every_tensor_and_reclaim_restores_them_exactly(keep, device_name):
    learner = trained_learner(device_name)
    before = {k: v.clone() for k, v in learner.state_tensors().items()}
    held = learner.held_bytes()
    assert held >= 3 * sum(p.numel() * 4 for p in learner.params)  # θ and AdamW's two moments
    allocated = torch.cuda.memory_allocated() if device_name == "cuda" else 0
    kept = learner.release(keep=keep)
    assert learner.held_bytes() == 0
    if device_name == "cuda":  # the device's memory, not only the trainee's tensors: nothing else still holds it
        assert torch.cuda.memory_allocated() <= allocated - held
    learner.reclaim(kept if keep else before)  # the checkpoint's copy stands in for a checkpoint
    after = learner.state_tensors()
    assert before.keys() == after.keys()
    for name in before:
        assert torch.equal(before[name], after[name]), name
    # And it trains on as if never paused: the same step as an uninterrupted twin.
    twin = trained_learner(device_name)
    assert learner.train_step() == twin.train_step()
    assert all(torch.equal(a, b) for a, b in zip(learner.params, twin.params))


# ---- the token weights and lost work across a pause ------------------------------------------------------------
class FakeSyncer:
    """What ``Rounds`` asks of the syncer: adoptions queued by the test, rounds recorded (and failed)."""

    def __init__(self) -> None:
        from atoll.protocols.stats import TrafficStats

        self.adopted, self.submitted, self.stats = [], [], TrafficStats()

    def take_candidates(self):
        return []

    def take_realign(self):
        realign, self.realign = getattr(self, "realign", False), False
        return realign

    def take_adopted(self):
        out, self.adopted = self.adopted, []
        return out

    def take_open_rounds(self):
        return set()

    def submit_round(self, p, contribution, base):
        import concurrent.futures

        from atoll.node.rounds.round_protocol import Outcome, RoundOutcome

        self.submitted.append((p, contribution.weight, base))
        done = concurrent.futures.Future()
        done.set_result(RoundOutcome(Outcome.FAILED, base[0]))
        return done


@pytest.mark.parametrize("local_merge", ["delta", "overwrite"])
def test_across_a_pause_unmerged_work_moves_onto_the_replica_the_swarm_moved_to(local_merge):
    """Trained k steps, paused, resumed: the fragment the swarm moved past during the pause is adopted. Under the
    delta rule its unmerged k steps ride along onto the new replica (θ_0 ← Θ_new + θ_0 − base) and the next
    contribution weighs k + m steps; overwriting drops them, counted lost, and the next contribution weighs only
    the m steps since. A fragment the swarm did not move keeps its k steps either way."""
    import threading

    from atoll.models.fragments import make_fragments
    from atoll.models.outer import tensor_hash
    from atoll.node.algorithm import algorithm
    from atoll.node.rounds.local_state import LocalFragmentState
    from atoll.node.metrics import Counters, HeldOut, MetricsLog
    from atoll.node.rounds.replica import Replica
    from atoll.node.rounds.rounds import Rounds
    from atoll.protocols.state_sync import ReplicaState

    learner = trained_learner()
    cfg = NodeConfig(run=RunConfig(model="nano", sync_every=40, fragments=2, local_merge=local_merge))
    algo = algorithm("decoupled")
    fragments = make_fragments(learner.params, 2, 40)
    replica = Replica([learner.gather(f) for f in fragments])
    local = [LocalFragmentState(learner.gather(f), (replica.identity(p)[0], replica.identity(p)[2]))
             for p, f in enumerate(fragments)]
    counters, syncer = Counters(), FakeSyncer()
    rounds = Rounds(cfg, algo, learner, fragments, replica, local, syncer, counters, MetricsLog(None),
                    HeldOut(1.0, counters), threading.Event())

    def train(steps):
        for _ in range(steps):
            learner.train_step()
            for state in local:
                state.add_step(learner.tokens_per_step)

    k, m, tokens = 7, 25, learner.tokens_per_step
    train(k)
    assert rounds.drain(1.0) == 0
    theta, base = learner.gather(fragments[0]), local[0].base
    kept = learner.release()
    # Meanwhile the swarm merged three rounds of fragment 0; the catch-up at resume adopts them.
    params = replica.params_and_id(0)[0] + 0.01
    momentum = torch.zeros_like(params)
    digest = tensor_hash(params, momentum)
    state = ReplicaState(3, 3.0, digest, params, momentum, 0, donor="peer", fragment=0, ancestors=(digest,),
                         donors=("peer",))
    assert replica.adopt(state)
    learner.reclaim(kept)
    syncer.adopted.append(state)
    rounds.before_step()
    if local_merge == "delta":
        assert counters.tokens_lost == 0 and counters.tokens_carried == k * tokens // 2  # fragment 0's half
        assert torch.equal(learner.gather(fragments[0]), (params.double() + theta.double() - base.double()).float())
    else:
        assert counters.tokens_lost == k * tokens // 2  # fragment 0's half of the k steps
        assert torch.equal(learner.gather(fragments[0]), params)  # θ_0 is the swarm's
    train(m)
    for p in (0, 1):
        rounds._start(p, own_schedule=True)
    weights = {p: w for p, w, _ in syncer.submitted}
    carried = k if local_merge == "delta" else 0
    assert weights[0] == algo.weight((carried + m) * tokens, carried + m)
    assert weights[1] == algo.weight((k + m) * tokens, k + m)
    assert syncer.submitted[0][2] == (3, digest)  # taken against the adopted replica


def test_a_failed_reclaim_leaves_the_trainee_released_to_try_again(device_name):
    learner = trained_learner(device_name)
    before = {k: v.clone() for k, v in learner.state_tensors().items()}
    kept = learner.release()
    with pytest.raises(KeyError):
        learner.reclaim({})  # stands in for a device that cannot hold θ again
    assert learner.held_bytes() == 0
    learner.reclaim(kept)
    assert all(torch.equal(before[k], v) for k, v in learner.state_tensors().items())


def test_donors_are_the_training_peers_else_the_paused_ones():
    from atoll.node.rounds.donors import donors
    from atoll.protocols.records import Status

    def peer(name, status):
        return SimpleNamespace(peer_id=name, status=status)

    mixed = {"a": peer("a", Status.TRAINING), "b": peer("b", Status.PAUSED), "c": peer("c", Status.JOINING)}
    assert [p.peer_id for p in donors(mixed)] == ["a"]
    asleep = {"b": peer("b", Status.PAUSED), "c": peer("c", Status.LEAVING)}
    assert [p.peer_id for p in donors(asleep)] == ["b"]
