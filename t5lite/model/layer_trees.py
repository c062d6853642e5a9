"""Scanned <-> unscanned parameter trees: `layers_0..n-1` groups and one stacked `layers` group.

A network with `scan_layers=True` keeps its layers' parameters stacked on a leading axis; the
checkpoint and Hugging Face code read and write either form through these two functions.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp

_LAYER_KEY = re.compile(r"^layers_(\d+)$")


def scan_params(params: Any) -> Any:
    """Stacks every `layers_{0..n-1}` group into one `layers` group with a leading axis.

    Args:
      params: unscanned parameter tree (nested dicts of arrays; boxes not allowed).

    Returns:
      The tree a `scan_layers=True` network expects.
    """
    if not isinstance(params, dict):
        return params
    idx = sorted(int(m.group(1)) for k in params if (m := _LAYER_KEY.match(k)))
    out = {k: scan_params(v) for k, v in params.items() if not _LAYER_KEY.match(k)}
    if idx:
        if idx != list(range(len(idx))):
            raise ValueError(f"layer groups are not contiguous from 0: {idx}")
        if "layers" in out:
            raise ValueError("tree has both 'layers' and 'layers_{i}' groups")
        stacked = [scan_params(params[f"layers_{i}"]) for i in idx]
        out["layers"] = jax.tree.map(lambda *xs: jnp.stack(xs), *stacked)
    return out


def unscan_params(params: Any) -> Any:
    """Inverse of `scan_params`: splits each `layers` group along axis 0 into `layers_{i}`."""
    if not isinstance(params, dict):
        return params
    out = {k: unscan_params(v) for k, v in params.items() if k != "layers"}
    if "layers" in params:
        stacked = params["layers"]
        n = jax.tree.leaves(stacked)[0].shape[0]
        for i in range(n):
            out[f"layers_{i}"] = jax.tree.map(lambda x, i=i: x[i], stacked)
    return out
