"""Rounds and replicas: what happens between islands. ``rounds.py`` (a round on the training loop's side),
``syncer.py`` and ``context.py`` (the protocol's event loop and what its parts share), ``round_protocol.py``
(matchmaking, all-reduce, outer step) and ``waits.py`` (how long a round waits, for whom), ``peers.py`` (progress
records and the table of live peers), ``replica.py`` and ``local_state.py`` (the global replica and our unmerged
work), ``catchup.py``, ``donors.py``, ``vetting.py`` and ``rejoin.py`` (keeping up with the swarm),
``contribution.py`` (the hand-over from the loop), ``join.py`` (membership, the DHT, the run's configuration).
Imports only node/'s shared modules."""
