"""One HF tensor <-> one t5lite leaf (or one expert's slice of it): the mapping entries and the
layout changes between PyTorch and t5lite.

PyTorch `Linear.weight` is [out, in]; t5lite kernels are [in, out] with heads split out, e.g.
`q.weight` [H*K, D] <-> `query/kernel` [D, H, K] and `o.weight` [D, H*K] <-> `out/kernel` [H, K, D].
Hugging Face stores each expert of a mixture-of-experts layer as its own `Linear`
(`experts.3.w1.weight` [F, D]); t5lite stacks them on a leading expert axis (`mlp/wi_0`
[E, D, F]), so an expert entry names its slice of the stacked leaf.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from t5lite.model.config import AnyConfig


@dataclasses.dataclass(frozen=True)
class Entry:
    """One HF tensor <-> one t5lite leaf, or slice `expert[0]` of a leaf of `expert[1]` experts."""

    hf_key: str
    path: tuple[str, ...]  # path in the unscanned t5lite `params` tree
    shape: tuple[int, ...]  # t5lite shape (of one expert's slice for an expert entry)
    kind: str  # 'copy' | 'linear' | 'q' (in->heads) | 'o' (heads->out) | 't' (transpose)
    expert: tuple[int, int] | None = None  # (index, number of experts) of a stacked leaf

    @property
    def leaf_shape(self) -> tuple[int, ...]:
        """The shape of the whole t5lite leaf."""
        return self.shape if self.expert is None else (self.expert[1], *self.shape)


def to_t5lite(x: np.ndarray, e: Entry) -> np.ndarray:
    """HF tensor -> t5lite layout (of the entry's slice)."""
    if e.kind == "copy":
        return x
    if e.kind in ("linear", "t", "q", "o"):
        return x.T.reshape(e.shape)
    raise AssertionError(e.kind)


def to_hf(x: np.ndarray, e: Entry) -> np.ndarray:
    """t5lite leaf (an expert entry's slice) -> HF tensor layout (inverse of `to_t5lite`)."""
    if e.kind == "copy":
        return x
    if e.kind == "q":  # [D, H, K] -> [H*K, D]
        return x.reshape(x.shape[0], -1).T
    if e.kind == "o":  # [H, K, D] -> [D, H*K]
        return x.reshape(-1, x.shape[-1]).T
    return x.T


def hf_shape(e: Entry) -> tuple[int, ...]:
    return tuple(to_hf(np.empty(e.shape, np.int8), e).shape)


def attention_entries(
    hf: str, ours: tuple[str, ...], d: int, h: int, g: int, k: int, names: tuple[str, ...]
) -> Iterator[Entry]:
    q, kk, v, o = names
    yield Entry(f"{hf}.{q}.weight", (*ours, "query", "kernel"), (d, h, k), "q")
    yield Entry(f"{hf}.{kk}.weight", (*ours, "key", "kernel"), (d, g, k), "q")
    yield Entry(f"{hf}.{v}.weight", (*ours, "value", "kernel"), (d, g, k), "q")
    yield Entry(f"{hf}.{o}.weight", (*ours, "out", "kernel"), (h, k, d), "o")


def _our_mlp_names(n_inputs: int) -> list[str]:
    return ["wi"] if n_inputs == 1 else [f"wi_{i}" for i in range(n_inputs)]


def mlp_entries(
    hf: str, ours: tuple[str, ...], d: int, f: int, names: tuple[str, ...]
) -> Iterator[Entry]:
    """A dense MLP: HF names (inputs..., output) under `hf`, t5lite's under `ours/mlp`."""
    *wis, wo = names
    for hf_name, our_name in zip(wis, _our_mlp_names(len(wis))):
        yield Entry(f"{hf}.{hf_name}.weight", (*ours, "mlp", our_name, "kernel"), (d, f), "t")
    yield Entry(f"{hf}.{wo}.weight", (*ours, "mlp", "wo", "kernel"), (f, d), "t")


def moe_entries(
    router: str,
    expert: str,
    ours: tuple[str, ...],
    d: int,
    f: int,
    e: int,
    names: tuple[str, ...],
) -> Iterator[Entry]:
    """A mixture-of-experts MLP (model/moe.py's `MoeBlock` at `ours/mlp`).

    Args:
      router: the HF key of the router's [E, D] weight.
      expert: the HF prefix of expert j, with `{j}` where its index goes.
      names: the HF names of an expert's input kernels then its output kernel.
    """
    yield Entry(router, (*ours, "mlp", "router", "kernel"), (d, e), "t")
    *wis, wo = names
    for hf_name, our_name in zip(wis, _our_mlp_names(len(wis))):
        for j in range(e):
            key = f"{expert.format(j=j)}.{hf_name}.weight"
            yield Entry(key, (*ours, "mlp", our_name), (d, f), "t", (j, e))
    for j in range(e):
        yield Entry(f"{expert.format(j=j)}.{wo}.weight", (*ours, "mlp", "wo"), (f, d), "t", (j, e))


def check_moe_export(cfg: AnyConfig, want: Mapping[str, Any], architecture: str) -> None:
    """One line naming the first of `want`'s fields on which `cfg` (a network config with
    experts) differs: the settings `architecture` has no way to express."""
    for field, value in want.items():
        if getattr(cfg, field) != value:
            raise ValueError(
                f"export_hf: a {type(cfg).__name__} with experts maps to {architecture} only "
                f"with {field}={value!r}, got {getattr(cfg, field)!r}"
            )
