"""The island's collectives between two real gloo ranks (``node/island/collectives.py``): an object arrives whole,
values are reduced and broadcast, every temporary is back to one reference when its call returns, and the ranks
exit cleanly afterwards with a DDP wrapper still holding the group (the shape of a follower's last boundary,
``scripts/bench_island_exit.py``, which also measures how often the same job aborts with ``torch.distributed``'s
own calls)."""

import pytest
from scripts.bench_island_exit import run_pair

pytestmark = [pytest.mark.integration, pytest.mark.waits]


def test_the_collectives_let_go_of_their_tensors_before_returning_and_the_ranks_exit_cleanly():
    for _ in range(3):
        outcome, outs = run_pair("settled", check=True, timeout=60)
        assert outcome == "ok", "\n".join(outs)
        assert [o.strip().splitlines()[-1] for o in outs] == ["rank 0: ok", "rank 1: ok"]
