"""LoRA (Hu et al. 2021): low-rank adapters on chosen kernels, trained while the base is frozen.

An adapted kernel W [in..., out...] gets two factors beside it in the parameter tree,
`lora_a` [in..., r] and `lora_b` [r, out...], and the network computes with
W + (alpha / r) * A @ B. The factors carry the kernel's logical axes plus `lora_rank`
(replicated by every rules table), so they shard with the rules like the kernel they adapt:
A follows the kernel's input dims, B its output dims. B starts at zero, so an adapted model
starts as its base. `merge` folds the factors into the kernels (what export writes).

NOTE: the adapted kernel is formed in the forward pass (one transient kernel-sized array per
adapted kernel) rather than as x @ W + (x @ A) @ B: one code path for training, decoding and
export, at the cost of that transient memory.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

PyTree = Any
RANK_AXIS = "lora_rank"
FACTORS = ("lora_a", "lora_b")


@dataclasses.dataclass(frozen=True)
class LoRA:
    """Which kernels get adapters, and their size."""

    rank: int = 8
    """r, the inner width of the factors."""
    alpha: float = 16.0
    """The update is scaled by alpha / r (so changing r keeps the learning rate's meaning)."""
    targets: str = r".*/(query|value)/kernel"
    """Regular expression matched in full against '/'-joined parameter paths (the default
    adapts attention's query and value projections, as the LoRA paper does)."""

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"LoRA.rank must be >= 1, got {self.rank}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def _path(keys: tuple[Any, ...]) -> str:
    return "/".join(str(getattr(k, "key", k)) for k in keys)


def _split(names: tuple[str, ...], path: str) -> int:
    """How many leading kernel dims are inputs: `embed` is on the input or the output side."""
    if names and names[0] == "embed":
        return 1
    if names and names[-1] == "embed":
        return len(names) - 1
    raise ValueError(
        f"LoRA.targets: {path} has axes {names}; adapters go on dense kernels that map from or "
        "to 'embed' (attention and MLP projections)"
    )


def add_adapters(lora: LoRA, boxed_params: PyTree, rng: jax.Array) -> PyTree:
    """`boxed_params` (logically partitioned, as `init` returns them) with factors added
    beside every kernel `lora.targets` matches; an error when it matches none."""
    rx = re.compile(lora.targets)
    matched: list[str] = []

    def walk(node: Any, keys: tuple[str, ...]) -> Any:
        if not isinstance(node, dict):
            return node
        out = {k: walk(v, (*keys, k)) for k, v in node.items()}
        for name, leaf in node.items():
            path = _path((*keys, name))
            if not rx.fullmatch(path):
                continue
            if not isinstance(leaf, nn.LogicallyPartitioned) or "layers" in leaf.names:
                raise ValueError(
                    f"LoRA.targets: {path} is not an unscanned kernel with logical axes "
                    "(LoRA needs scan_layers=False)"
                )
            names, kernel = tuple(leaf.names), leaf.value
            n_in = _split(names, path)
            fan_in = int(np.prod(kernel.shape[:n_in]))
            key = jax.random.fold_in(rng, len(matched))
            a = jax.random.normal(key, (*kernel.shape[:n_in], lora.rank), kernel.dtype)
            a = a / np.sqrt(fan_in)
            b = jnp.zeros((lora.rank, *kernel.shape[n_in:]), kernel.dtype)
            out[f"{name}_lora_a"] = nn.LogicallyPartitioned(a, (*names[:n_in], RANK_AXIS))
            out[f"{name}_lora_b"] = nn.LogicallyPartitioned(b, (RANK_AXIS, *names[n_in:]))
            matched.append(path)
        return out

    params = walk(boxed_params, ())
    if not matched:
        raise ValueError(f"LoRA.targets: {lora.targets!r} matches no parameter")
    return params


def is_factor(path: str) -> bool:
    """Whether a '/'-joined parameter path names a LoRA factor."""
    return path.endswith(("_lora_a", "_lora_b"))


FACTOR_PATTERN = r".*_lora_[ab]"
BASE_PATTERN = r"(?!.*_lora_[ab]$).*"
"""Every parameter but the factors: what `FrozenParams` freezes under LoRA."""


def without_factors(params: PyTree) -> PyTree:
    """`params` (nested dicts) without the LoRA factors."""
    if not isinstance(params, dict):
        return params
    return {k: without_factors(v) for k, v in params.items() if not is_factor(k)}


def merge(lora: LoRA, params: PyTree) -> PyTree:
    """The plain parameter tree: each adapted kernel W + (alpha / r) * A @ B, factors dropped.

    Computed in fp32 and returned in the kernel's dtype; a tree without factors comes back
    unchanged.
    """
    if not isinstance(params, dict):
        return params
    out = {k: merge(lora, v) for k, v in params.items() if not is_factor(k)}
    for name in list(out):
        a, b = params.get(f"{name}_lora_a"), params.get(f"{name}_lora_b")
        if a is None or b is None:
            continue
        kernel = out[name]
        a2 = jnp.reshape(a, (-1, a.shape[-1])).astype(jnp.float32)
        b2 = jnp.reshape(b, (b.shape[0], -1)).astype(jnp.float32)
        delta = jnp.reshape(a2 @ b2, kernel.shape) * lora.scale
        out[name] = (jnp.asarray(kernel, jnp.float32) + delta).astype(kernel.dtype)
    return out
