"""How a harness task's `generation_kwargs` decode, read as lm-eval's `hf` model reads them.

lm-eval normalises the kwargs (`normalize_gen_kwargs`: `do_sample` false, or absent with no
positive temperature, means greedy at temperature 0) and its `hf` model hands the rest to
transformers' `generate`, which then samples with temperature, then top-k (default 50), then
top-p (default 1.0), and ignores them all when not sampling. t5lite decodes the same settings
with its own `decoding.temperature_sample`; a setting it cannot honour is an error naming it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from lm_eval.models.utils import normalize_gen_kwargs

# transformers' `GenerationConfig` default, used by `hf` when a sampling task sets no top_k.
HF_DEFAULT_TOP_K = 50
HONOURED = ("until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p")


@dataclasses.dataclass(frozen=True)
class Generation:
    """One task's decoding: greedy where `temperature` is 0."""

    until: tuple[str, ...]
    """Stop strings (the continuation is cut before the first of them)."""
    max_gen_toks: int
    """Tokens generated at most."""
    temperature: float = 0.0
    """Logits are divided by it before sampling; 0: greedy (top_k and top_p unused)."""
    top_k: int = 0
    """Sample from the k most likely tokens (0: all of them)."""
    top_p: float = 1.0
    """Sample from the smallest nucleus of this probability mass (1.0: all of it)."""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def generation(gen_kwargs: Mapping[str, Any], default_max_gen_toks: int) -> Generation:
    """`generation_kwargs` -> `Generation`, as `hf` decodes them (the `until` strings as given,
    without the EOS string lm-eval adds). ValueError naming a setting t5lite cannot honour."""
    kwargs = dict(normalize_gen_kwargs(dict(gen_kwargs), default_max_gen_toks))
    until = kwargs.pop("until")
    max_gen = int(kwargs.pop("max_gen_toks"))
    do_sample = kwargs.pop("do_sample")
    temperature = float(kwargs.pop("temperature", 0.0))  # normalize_gen_kwargs float()s it too
    top_k, top_p = kwargs.pop("top_k", None), kwargs.pop("top_p", None)
    if kwargs:
        name, value = sorted(kwargs.items())[0]
        raise ValueError(
            f"generation_kwargs {name}={value!r}: t5lite's harness model cannot honour it "
            f"(it decodes {', '.join(HONOURED)} and the aliases of max_gen_toks)"
        )
    if not do_sample:  # transformers ignores the sampling settings when not sampling
        return Generation(tuple(until), max_gen)
    if not temperature > 0:
        raise ValueError(
            f"generation_kwargs temperature={temperature!r} with do_sample=True: sampling needs "
            "a temperature > 0 (lm-eval's hf model refuses it too); do_sample: false is greedy"
        )
    if top_k is None:
        top_k = HF_DEFAULT_TOP_K
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"generation_kwargs top_k={top_k!r}: must be an integer >= 0 (0: all)")
    top_p = 1.0 if top_p is None else top_p
    if not isinstance(top_p, int | float) or not 0.0 <= top_p <= 1.0:
        raise ValueError(f"generation_kwargs top_p={top_p!r}: must be in [0, 1]")
    return Generation(tuple(until), max_gen, float(temperature), top_k, float(top_p))
