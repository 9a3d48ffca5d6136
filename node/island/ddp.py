"""ddp, the synchronous baseline, on the training loop's side: every inner step's gradients are all-reduced with
every live peer before the optimizer step (the loop blocks on it), and the replica is the model itself.

ddp's membership is fixed: its daemons start together (``--quorum`` of them) and a daemon cannot join a ddp run
that has taken steps. Every H steps it evaluates, logs and records its state like a round, and checkpoints.
"""

from __future__ import annotations

import logging
import threading
import time

from ..metrics import Counters, HeldOut, MetricsLog
from ..rounds.local_state import LocalFragmentState
from ..rounds.replica import Replica
from ..rounds.syncer import Syncer
from .learner import Learner

logger = logging.getLogger("atoll")


class DDP:
    def __init__(self, learner: Learner, replica: Replica, local: LocalFragmentState, syncer: Syncer,
                 counters: Counters, metrics: MetricsLog, held_out: HeldOut, stop: threading.Event) -> None:
        self.learner, self.replica, self.local, self.syncer = learner, replica, local, syncer
        self.counters, self.metrics, self.held_out, self.stop = counters, metrics, held_out, stop

    def step(self) -> float:
        """One data-parallel step; returns its loss. When no group could average it, the step is dropped and the
        learner does not advance (the same batch comes next): stepping alone would fork the replica."""
        learner, counters = self.learner, self.counters
        loss = learner.backward()
        version = self.replica.identity(0)[0]
        t0 = time.monotonic()
        future = self.syncer.submit_gradient_allreduce(version, learner.flat_grads(), float(learner.tokens_per_step))
        while not future.done() and not self.stop.wait(0.001):
            pass
        counters.blocked_seconds += time.monotonic() - t0
        counters.train_seconds -= time.monotonic() - t0  # the caller times the whole step; waiting is not training
        averaged = future.result() if future.done() and future.exception() is None else None
        if averaged is None:
            learner.discard_step()
            counters.ddp_failed_steps += 1
            return loss
        learner.load_flat_grads(averaged)
        learner.apply_step()
        self.replica.replace_params(0, version, learner.flat_params(), learner.tokens_per_step)
        self.local.restart(*self.replica.params_and_id(0))
        return loss

    def report(self) -> None:
        """Every H steps: evaluate and record the state like a round."""
        learner, counters = self.learner, self.counters
        version, weight, digest = self.replica.identity(0)
        group = self.syncer.last_group() or [self.syncer.peer_id]
        self.held_out.evaluate(learner)
        logger.info("ddp step %d: version %d, %d members, held-out loss %.4f, hash %s", learner.step, version,
                    len(group), counters.held_out_loss, digest)
        stats = self.syncer.stats
        self.metrics.write(event="round", fragment=0, version=version, hash=digest, weight=weight, members=group,
                           contributors=group, step=learner.step, tokens=learner.tokens,
                           held_out_loss=counters.held_out_loss, held_out_step=counters.held_out_step, seconds=0.0,
                           bytes_sent=stats.bytes_sent, bytes_received=stats.bytes_received)
