"""Mixed precision policy: which dtype parameters, activations and logits have, and what is kept.

A policy is written as jmp / Levanter write theirs, `'params=bfloat16,compute=bfloat16,
output=float32'` (short keys `p`, `c`, `o`, `m` and short dtypes `f32`, `bf16`, `f16` too; a
single dtype such as `'bfloat16'` sets params, compute and output at once), plus one key of its
own, `master`:

- `master`: the dtype the train state keeps the parameters in. Checkpoints store them, and the
  optimizer state, which is born from them, has it too. Default float32: bf16 parameters still
  get an fp32 master copy and fp32 optimizer state, so small updates are not rounded away.
- `params`: the dtype the forward pass sees the parameters in (the masters are cast to it at
  the start of every loss, score or decode; with `params == master` nothing is cast).
- `compute`: the dtype of activations and matmul inputs. Softmax, norms and the loss are fp32
  whatever it is.
- `output`: the dtype of the logits.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

_KEYS = {"p": "params", "c": "compute", "o": "output", "m": "master"}
_DTYPES = {
    "f32": "float32",
    "float32": "float32",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "f16": "float16",
    "float16": "float16",
}


@dataclasses.dataclass(frozen=True)
class Precision:
    """A parsed policy; `str(policy)` is its canonical spelling (what configs record)."""

    params: str = "float32"
    compute: str = "float32"
    output: str = "float32"
    master: str = "float32"

    @classmethod
    def parse(cls, spec: str) -> Precision:
        """Reads `'params=bfloat16,compute=bfloat16,output=float32'` or a single dtype."""
        spec = str(spec).strip()
        if "=" not in spec:
            d = _dtype(spec, spec)
            return cls(params=d, compute=d, output=d)
        fields: dict[str, str] = {}
        for part in spec.split(","):
            key, _, value = part.partition("=")
            key = _KEYS.get(key.strip(), key.strip())
            if key not in _KEYS.values() or not value.strip():
                raise ValueError(
                    f"precision {spec!r}: {part.strip()!r} is not one of "
                    "params=, compute=, output=, master= followed by a dtype"
                )
            fields[key] = _dtype(value.strip(), spec)
        return cls(**fields)

    def __str__(self) -> str:
        return ",".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))

    def replace(self, **changes: str | None) -> Precision:
        """A copy with the given (non-None) fields changed, dtypes checked."""
        given = {k: _dtype(v, f"{k}={v}") for k, v in changes.items() if v is not None}
        return dataclasses.replace(self, **given)

    def cast_params(self, params: Any) -> Any:
        """The master parameters as the forward pass sees them (`params` dtype, floats only).

        Inside `jax.grad` the cast is part of the differentiated function, so gradients come
        back in the master dtype.
        """
        if self.params == self.master:
            return params
        dtype = jnp.dtype(self.params)

        def cast(x: Any) -> Any:
            return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x

        return jax.tree_util.tree_map(cast, params)


def _dtype(name: str, spec: str) -> str:
    if name not in _DTYPES:
        raise ValueError(
            f"precision {spec!r}: unknown dtype {name!r}; use one of {sorted(set(_DTYPES))}"
        )
    return _DTYPES[name]
