"""The island: one member of a run and its training loop. ``member.py`` (a member's lifetime and step boundaries),
``island.py`` (``atoll.Island``: a member around a user's model and optimizer), ``arrival.py`` (restore, join or
catch up, wait for peers), ``pausing.py``, ``pause.py`` and ``control.py`` (lending the machine, and the local
socket ``atoll pause`` speaks to), ``ranks.py``, ``sharded.py`` and ``launch.py`` (islands of several ranks, sharded
or not), ``ddp.py`` and ``learner.py`` (the baseline's step and atoll's own loop), ``daemon.py`` (``atoll start``'s
loop). Imports every other room; only ``cli.py`` imports it."""
