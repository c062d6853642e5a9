"""Key paths as text: the one spelling of a parameter's name (`encoder/layers_0/mlp/wi/kernel`).

Checkpoints name their arrays with it and every error message and report names parameters with
it, so a path read in a message can be looked up in `metadata.json` as it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def key_str(k: Any) -> str:
    """One component of a JAX key path as text (dict key, attribute name or list index)."""
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def path_str(path: Sequence[Any]) -> str:
    """A JAX key path as a '/'-joined string, e.g. `params/mlp/wi/kernel`."""
    return "/".join(key_str(k) for k in path)
