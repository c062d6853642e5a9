"""Compatibility aliases for code and gin files written for t5x (`t5x.py`) and seqio (`seqio.py`).

A layer above `model/` (it builds model objects) and below `cli/` (which registers its names in
gin); see docs/differences.md for what is deliberately not the same.
"""
