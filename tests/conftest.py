"""Shared test set-up: one torch thread per process (the machine has 2 cores shared by daemons)."""

import os
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))  # the swarm launcher doubles as the integration harness
os.environ.setdefault("PYTHONUNBUFFERED", "1")
