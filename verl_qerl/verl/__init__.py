"""verl integration: config, trainer hook, FSDP engine hook, CPU platform (see plugin.py)."""
