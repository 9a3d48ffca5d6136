"""Models behind ``scripts/simulate.py``, for planning a run at internet scale.

``goodput`` simulates chip failures (Decoupled DiLoCo's Table 1 and its extension),
``bandwidth`` times synchronization schedules over a WAN (Streaming DiLoCo's headline),
``paper`` holds the values the papers report, and ``plots`` draws the results. Only numpy,
matplotlib (for the plots) and the standard library are used. The models are pure
functions of their arguments (randomness comes from an explicit seed), so tests import
them and call them directly; printing and writing files is left to the CLI.
"""
