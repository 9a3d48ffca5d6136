"""Helpers shared by test modules (no test module imports another): records that pass the run's schemas, the checks
of a live swarm, and readers of the files daemons write. ``tests/conftest.py`` puts ``tests/`` on the path."""
