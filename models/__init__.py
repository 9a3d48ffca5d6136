"""atoll.models."""
