"""What operators see of a run: ``status.py``, ``dashboard.py``, ``dashboard_page.py`` and ``history.py`` (a run
from the outside), ``exporter.py`` and ``trackers.py`` (a daemon's figures in Prometheus, TensorBoard or W&B),
``curves.py`` (how curves are drawn). Imports the rounds and node/'s shared modules."""
