"""The command line: `main.py` (flags, the one-line error policy), `gin_config.py` (finding and
parsing gin files) and `registry.py` (the one place library objects become gin configurables)."""
