"""atoll: decentralized pre-training of language models with Decoupled DiLoCo, peer to peer.

``atoll.Island`` makes your own training loop a member of a run: it wraps your model and inner optimizer, and
rounds start and merge at your ``optimizer.step()`` (docs/api.md). ``atoll start`` is the daemon, the same island
around atoll's own loop. The subpackages are imported on first use: ``import atoll`` alone costs nothing.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["ConfigError", "Island"]

# In a source checkout the subpackages (node/, protocols/, models/) sit beside this folder, not in it: imported from
# the checkout itself (``python -m pytest`` puts it first on sys.path, ahead of an installed atoll), this package
# must still find them. An installed atoll holds them in this folder, and nothing is added.
_here = os.path.dirname(os.path.abspath(__file__))
if not os.path.isdir(os.path.join(_here, "node")):
    __path__.append(os.path.dirname(_here))


def __getattr__(name: str) -> Any:
    if name == "Island":
        from atoll.node.island.island import Island

        return Island
    if name == "ConfigError":
        from atoll.node.config import ConfigError

        return ConfigError
    raise AttributeError(f"module 'atoll' has no attribute {name!r}")
