"""Attacks on live daemons, for the adversarial tests: each function plays one hostile peer and returns what it saw."""
