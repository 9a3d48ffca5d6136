import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # shared helpers live in test_swarm
