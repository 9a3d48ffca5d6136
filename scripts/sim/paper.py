"""Reference values reported by the two papers the simulator is compared with.

Kept apart from the models so that every number taken from a paper can be checked against
it in one place. ``PAPER_TABLE1`` is only printed, plotted and used to score the
calibration search: the goodput simulation never reads it. ``STREAMING_HEADLINE`` is an
input of the bandwidth study, which infers the unstated step times from it.
"""

from __future__ import annotations

# Decoupled DiLoCo, arXiv 2604.21428, Table 1: goodput % per configuration and chip count.
PAPER_CHIPS: tuple[int, ...] = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
PAPER_TABLE1: dict[str, tuple[int, ...]] = {
    "dp": (72, 57, 38, 27, 18),
    "elastic": (88, 80, 69, 58, 40),
    "decoupled M=2": (94, 88, 80, 70, 54),
    "decoupled M=4": (96, 93, 89, 82, 73),
    "decoupled M=8": (98, 96, 94, 88, 80),
    "decoupled M=16": (99, 98, 96, 93, 86),
}

# Streaming DiLoCo, Figure 4 (as reported): bandwidth data-parallel needs for 95% compute
# utilization, and the range in which Streaming DiLoCo reaches it.
STREAMING_HEADLINE = {
    "params": [1e9, 10e9, 100e9],
    "ddp_gbps_for_95": [100.0, 200.0, 300.0],
    "streaming_gbps_for_95_range": [1.0, 5.0],
    # Assumed layer counts (not stated): fragments are 3 layers each, as in the paper.
    "layers": [24, 48, 96],
}
