"""atoll.node: the daemon and the island, in rooms that import downwards only (tests/unit/test_layers.py).

Here, the vocabulary every room shares: ``config.py`` (typed, validated settings), ``algorithm.py``, ``faults.py``
and ``harness.py`` (what runs differ by), ``pause_specs.py``, ``device.py`` and ``spmd.py``, ``trainee.py`` (what
rounds and checkpoints need of a model in training), ``metrics.py``, ``log.py`` and ``progress.py``; and ``cli.py``,
the front door. Then ``rounds/`` (between islands), ``home/`` (checkpoints and exports), ``ops/`` (operators' views)
and ``island/`` (a member and its loop), each described in its ``__init__.py``.
"""
