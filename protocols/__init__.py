"""atoll.protocols."""
