"""How a learner takes rounds and adopted replicas into its own θ (``node/rounds/rounds.py``, ``--local-merge``): the
delta rule keeps every step trained while a round is in flight and carries it into the next contribution; overwriting
drops them. Driven through ``Rounds`` with a syncer stand-in that lands each round a set number of steps late."""

import concurrent.futures
import threading

import pytest
import torch

from atoll.models.data import Corpus, load_corpus
from atoll.models.configs import MODELS
from atoll.models.fragments import make_fragments
from atoll.models.outer import NesterovOuter, tensor_hash
from atoll.node.algorithm import algorithm
from atoll.node.config import NodeConfig, RunConfig
from atoll.node.device import resolve_device
from atoll.node.island.learner import Learner
from atoll.node.rounds.local_state import LocalFragmentState
from atoll.node.metrics import Counters, HeldOut, MetricsLog
from atoll.node.rounds.replica import Replica
from atoll.node.rounds.round_protocol import Outcome, RoundOutcome
from atoll.node.rounds.rounds import CARRY_PERIODS, Rounds, _Pending
from atoll.protocols.state_sync import ReplicaState
from atoll.protocols.stats import TrafficStats

H, P = 8, 2


@pytest.fixture(scope="module")
def corpus():
    tokens, _ = load_corpus("builtin")
    return Corpus(tokens, MODELS["nano"].seq_len, 16)


class LateSyncer:
    """One member's rounds, as plain averaging of one contribution would merge them (Θ_new = θ_snapshot exactly):
    a round's group forms ``form`` steps after it was submitted (it then asks for the contribution, which the
    learner gives at that step's boundary), and it lands ``delay`` steps after the snapshot. Rounds listed in
    ``fail`` (by submission order) fail."""

    def __init__(self, replica: Replica, delay: int, fail=(), form: int = 0) -> None:
        self.replica, self.delay, self.fail, self.form = replica, delay, set(fail), form
        self.adopted, self.submitted, self.stats, self.inflight, self.merged = [], [], TrafficStats(), [], []

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
        future = concurrent.futures.Future()
        step = self.replica.schedule_step
        self.inflight.append({"p": p, "contribution": contribution, "base": base, "future": future,
                              "form_at": step + self.form, "land_at": None,
                              "fails": len(self.submitted) in self.fail})
        self.submitted.append((p, contribution, base))
        self._form()
        return future

    def form_all(self) -> None:
        """Every round in flight forms its group now (and asks for its contribution)."""
        for r in self.inflight:
            r["contribution"].ask()

    def _form(self) -> None:
        for r in self.inflight:
            if self.replica.schedule_step >= r["form_at"]:
                r["contribution"].ask()

    def land(self) -> None:
        """Land the rounds due at this step (before the learner's next boundary reads them)."""
        step = self.replica.schedule_step
        for r in list(self.inflight):
            contribution = r["contribution"]
            if r["land_at"] is None and contribution.settled():
                r["land_at"] = r["form_at"] + self.delay  # the reduce starts once the group formed
            if contribution.settled() and contribution.given() is None:  # refused: the replica moved meanwhile
                self.inflight.remove(r)
                r["future"].set_result(RoundOutcome(Outcome.FAILED, r["base"][0]))
                continue
            if r["land_at"] is None or r["land_at"] > step:
                continue
            self.inflight.remove(r)
            p, base, future = r["p"], r["base"], r["future"]
            if r["fails"]:
                future.set_result(RoundOutcome(Outcome.FAILED, base[0]))
                continue
            delta, weight = contribution.given()
            version, total, digest = self.replica.apply_outer_step(p, base[0], delta, weight, NesterovOuter(1.0, 0.0))
            self.merged.append((p, weight))
            future.set_result(RoundOutcome(Outcome.MERGED, base[0], digest=digest, weight=total))
        self._form()


def island(corpus, local_merge="delta", delay=3, fail=(), form=0, snapshot_at="formation", algo="decoupled"):
    run = RunConfig(model="nano", sync_every=H, fragments=P, overlap=1, warmup_steps=3, local_merge=local_merge)
    learner = Learner(run, resolve_device("cpu"), corpus, shard=0, batch_size=2)
    fragments = make_fragments(learner.params, P, H)
    replica = Replica([learner.gather(f) for f in fragments])
    local = [LocalFragmentState(learner.gather(f), (replica.identity(p)[0], replica.identity(p)[2]))
             for p, f in enumerate(fragments)]
    counters, syncer = Counters(), LateSyncer(replica, delay, fail, form)
    rounds = Rounds(NodeConfig(run=run, snapshot_at=snapshot_at), algorithm(algo), learner, fragments, replica,
                    local, syncer, counters, MetricsLog(None), HeldOut(1e9, counters), threading.Event())
    return learner, fragments, replica, local, counters, syncer, rounds


def train(learner, replica, local, syncer, rounds, steps):
    for _ in range(steps):
        rounds.before_step()
        learner.train_step()
        replica.schedule_step += 1
        for state in local:
            state.add_step(learner.tokens_per_step)
        syncer.land()
        rounds.after_step()


def plain(corpus, steps):
    learner = island(corpus)[0]
    for _ in range(steps):
        learner.train_step()
    return learner.flat_params()


@pytest.mark.parametrize("delay", [1, 3, 7, 11])  # 11 > H: the round due meanwhile is skipped, 11 steps carried
def test_one_member_through_the_delta_rule_is_plain_training_bit_for_bit(corpus, delay):
    learner, fragments, replica, local, counters, syncer, rounds = island(corpus, delay=delay, fail={2})
    train(learner, replica, local, syncer, rounds, 33)
    assert torch.equal(learner.flat_params(), plain(corpus, 33))
    assert counters.tokens_lost == 0
    merged = len(syncer.submitted) - 1 - len(syncer.inflight)  # one failed
    assert replica.identity(0)[0] + replica.identity(1)[0] == merged > (3 if delay < H else 1)
    # Every step is in exactly one merged contribution or still in θ − base: the steps behind the merged
    # contributions (a token weight c_tok²/c_steps is per²·steps) and those unmerged add up to every step trained.
    per = learner.tokens_per_step
    for p in range(P):
        merged_steps = sum(round(w / per**2) for q, w in syncer.merged if q == p)
        assert merged_steps + local[p].steps == 33, p
    assert counters.tokens_carried > 0


@pytest.mark.parametrize("snapshot_at", ["formation", "due"])
def test_a_round_snapshots_when_its_group_has_formed(corpus, snapshot_at):
    """Groups form 4 steps after a round is submitted and reduce in 2. Snapshotting at formation, those 4 steps go
    into the round's own contribution and only the 2 of the reduce are in flight (carried); at the due step, all 6
    are in flight. Either way one member trains exactly as plain training and every step lands in exactly one
    merged contribution or is still unmerged."""
    learner, fragments, replica, local, counters, syncer, rounds = island(corpus, delay=2, form=4,
                                                                          snapshot_at=snapshot_at)
    train(learner, replica, local, syncer, rounds, 33)
    assert torch.equal(learner.flat_params(), plain(corpus, 33))
    assert counters.tokens_lost == 0 and counters.in_flight_steps
    assert set(counters.in_flight_steps) == ({2} if snapshot_at == "formation" else {6})
    per = learner.tokens_per_step
    for p in range(P):
        merged_steps = sum(round(w / per**2) for q, w in syncer.merged if q == p)
        assert merged_steps + local[p].steps == 33, p


def test_a_round_whose_replica_moved_while_its_group_formed_contributes_nothing(corpus):
    """An adoption lands between a round's registration and its group's formation: the round's replica is no
    longer θ_p's base, so the contribution is refused (the round fails) and the work stays unmerged, carried."""
    learner, fragments, replica, local, counters, syncer, rounds = island(corpus, delay=1, form=3)
    train(learner, replica, local, syncer, rounds, H // P + 1)  # fragment 1's round submitted at 4, forms at 7
    own = replica.identity(1)[2]
    adopt(replica, learner, syncer, rounds, 1, 2, (own,))
    train(learner, replica, local, syncer, rounds, 4)
    assert replica.identity(1)[0] == 2  # the adopted version; our round did not merge
    assert counters.tokens_lost == 0 and local[1].steps == H // P + 5
    assert syncer.submitted[0][1].settled() and syncer.submitted[0][1].given() is None


def test_a_round_landing_as_its_fragment_falls_due_again_merges_before_the_next_one_starts(corpus):
    """delay = H: each round lands at the very boundary where its fragment is due again. It merges there, and the
    next round starts, instead of being skipped because the previous one was still pending."""
    learner, fragments, replica, local, counters, syncer, rounds = island(corpus, delay=H)
    train(learner, replica, local, syncer, rounds, 33)
    assert counters.rounds_skipped == 0 and len(syncer.merged) >= 4
    assert torch.equal(learner.flat_params(), plain(corpus, 33)) and counters.tokens_lost == 0


def test_a_pause_snapshots_the_rounds_whose_groups_form_while_it_drains(corpus):
    """A round registered before a pause whose group forms while the loop drains still gets its contribution."""
    learner, fragments, replica, local, counters, syncer, rounds = island(corpus, delay=1, form=3)
    train(learner, replica, local, syncer, rounds, H // P + 1)  # fragment 1's round registered at 4, forms at 7
    ((p, contribution, _),) = syncer.submitted
    assert not contribution.settled()
    syncer.form_all()
    rounds.drain(0.2)
    delta, weight = contribution.given()
    assert weight == algorithm("decoupled").weight(5 * learner.tokens_per_step, 5)  # the 5 steps trained so far


def test_overwriting_a_late_round_loses_the_steps_since_its_snapshot(corpus):
    learner, fragments, replica, local, counters, syncer, rounds = island(corpus, local_merge="overwrite", delay=3)
    train(learner, replica, local, syncer, rounds, 33)
    assert not torch.equal(learner.flat_params(), plain(corpus, 33))
    merged = replica.identity(0)[0] + replica.identity(1)[0]
    assert counters.tokens_lost == merged * 3 * learner.tokens_per_step // P and counters.tokens_carried == 0


def test_a_contribution_weighs_the_steps_it_carries_and_the_gates_count_from_the_snapshot(corpus):
    """After a round of fragment 0 lands 3 steps late, fragment 0's next contribution carries those 3 steps plus
    the H − 3 trained since: H in all, the same as a round that landed at once."""
    learner, fragments, replica, local, counters, syncer, rounds = island(corpus, delay=3)
    train(learner, replica, local, syncer, rounds, 2 * H + 1)
    algo, per = algorithm("decoupled"), learner.tokens_per_step
    weights = [c.weight for p, c, _ in syncer.submitted if p == 0]
    assert weights[:2] == [algo.weight(H * per, H)] * 2
    # 3 carried + 5 contributed at 2H (in flight) + 1 since: the gates count the 1.
    assert local[0].fresh_steps == 1 and local[0].steps == H + 1


def test_a_failed_round_keeps_its_work_for_the_next_one(corpus):
    learner, fragments, replica, local, counters, syncer, rounds = island(corpus, delay=2, fail={0})
    train(learner, replica, local, syncer, rounds, H + 1)
    assert replica.identity(0)[0] == 0 and local[0].steps == H + 1  # fragment 0's first round failed
    assert counters.tokens_lost == 0


def adopt(replica, learner, syncer, rounds, p, version, ancestors, shift=0.01, schedule_step=0):
    params = replica.params_and_id(p)[0] + shift
    momentum = torch.zeros_like(params)
    digest = tensor_hash(params, momentum)
    state = ReplicaState(version, float(version), digest, params, momentum, schedule_step, donor="peer", fragment=p,
                         ancestors=(*ancestors, digest), donors=("peer",))
    assert replica.adopt(state)
    syncer.adopted.append(state)
    rounds.before_step()
    return params, state


def test_an_adopted_descendant_carries_the_unmerged_work(corpus):
    learner, fragments, replica, local, counters, syncer, rounds = island(corpus)
    train(learner, replica, local, syncer, rounds, 3)  # no round yet: fragment 1 is due at 4
    theta, base = learner.gather(fragments[1]), local[1].base
    own = replica.identity(1)[2]
    params, state = adopt(replica, learner, syncer, rounds, 1, 2, (own, "x"))
    assert not state.forked
    assert torch.equal(learner.gather(fragments[1]), (params.double() + theta.double() - base.double()).float())
    assert counters.tokens_lost == 0 and counters.tokens_carried == 3 * learner.tokens_per_step // P
    assert local[1].steps == 3 and local[1].base_id == (2, state.digest)


def test_a_forks_loser_counts_its_lost_round_and_carries_what_no_round_merged(corpus):
    learner, fragments, replica, local, counters, syncer, rounds = island(corpus, delay=1)
    train(learner, replica, local, syncer, rounds, H // P + 3)  # fragment 1's round at 4 merged at 5
    assert replica.identity(1)[0] == 1
    per, unmerged = learner.tokens_per_step, local[1].tokens
    assert unmerged == 3 * per  # 1 carried from the merge, 2 since
    params, state = adopt(replica, learner, syncer, rounds, 1, 2, ("other",))
    assert state.forked
    assert counters.tokens_lost == 4 * per // P  # our part of the lost round: the 4 steps before its snapshot
    assert local[1].tokens == unmerged


@pytest.mark.parametrize("steps", [CARRY_PERIODS * H, CARRY_PERIODS * H + 2])
def test_carried_work_past_the_bound_is_dropped_and_counted(corpus, steps):
    learner, fragments, replica, local, counters, syncer, rounds = island(corpus, delay=1, fail=set(range(99)))
    train(learner, replica, local, syncer, rounds, steps)  # every round failed: work piles up
    assert local[1].steps == steps
    own = replica.identity(1)[2]
    theta, base = learner.gather(fragments[1]), local[1].base
    params, _ = adopt(replica, learner, syncer, rounds, 1, 3, (own,))
    per = learner.tokens_per_step
    if steps <= CARRY_PERIODS * H:  # at the bound: carried
        assert torch.equal(learner.gather(fragments[1]), (params.double() + theta.double() - base.double()).float())
        assert counters.tokens_lost == 0 and local[1].steps == steps
    else:
        assert torch.equal(learner.gather(fragments[1]), params)
        assert counters.tokens_lost == steps * per // P and local[1].steps == 0


def test_back_from_a_stall_the_next_adoption_brings_the_donors_schedule(corpus):
    """After a stall the syncer asks for realignment once: the next adopted replica's schedule step becomes ours and
    a round in flight keeps its place relative to it; without the request an adoption leaves the schedule alone."""
    learner, fragments, replica, local, counters, syncer, rounds = island(corpus, delay=5)
    train(learner, replica, local, syncer, rounds, 5)  # fragment 1's round (due at 4) lands at 9: in flight
    assert list(rounds.pending) == [1] and rounds.pending[1].merge_at == 5
    adopt(replica, learner, syncer, rounds, 0, 1, (replica.identity(0)[2],), schedule_step=40)
    assert replica.schedule_step == 5  # no stall: our schedule is ours
    syncer.realign = True
    adopt(replica, learner, syncer, rounds, 0, 2, (replica.identity(0)[2],), schedule_step=43)
    assert replica.schedule_step == 43 and rounds.pending[1].merge_at == 43
    adopt(replica, learner, syncer, rounds, 0, 3, (replica.identity(0)[2],), schedule_step=90)
    assert replica.schedule_step == 43  # once per stall
    assert counters.tokens_lost == 0


def test_a_synchronous_round_behind_stops_waiting_once_a_replica_waits_for_vetting(corpus):
    """A synchronous round abandoned as behind waits for the replica to change (the catch-up's download), up to two
    heartbeats and two round timeouts. A replica unlike ours is not adopted by the download: the learner vets it
    first, at its next step, and the wait held the learner; a daemon back from an old checkpoint sat out the whole
    deadline. The wait ends once a replica waits for vetting."""
    learner, fragments, replica, local, counters, syncer, rounds = island(corpus, algo="diloco")
    waits = []
    rounds._wait = lambda done, deadline=None: waits.append(done) or True
    candidates = []
    syncer.candidates_waiting = lambda: bool(candidates)
    syncer.replica_changed = lambda p, version: replica.identity(p)[0] != version
    future = concurrent.futures.Future()
    version, _, digest = replica.identity(0)
    future.set_result(RoundOutcome(Outcome.BEHIND, version))
    assert rounds._finish(0, _Pending(future, 0, version, None, None, (version, digest))) is False
    (done,) = waits
    assert not done()  # nothing adopted, nothing to vet: wait
    candidates.append("a state to vet")
    assert done()
