"""atoll.node."""
