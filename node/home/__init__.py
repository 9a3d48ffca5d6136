"""The model kept and taken home: ``checkpoint.py`` and ``persist.py`` (crash-safe checkpoints and what they
hold), ``export.py``, ``evaluate.py`` and ``model_commands.py`` (``atoll export``, ``atoll sample``, ``atoll
eval``). Imports the rounds and node/'s shared modules."""
