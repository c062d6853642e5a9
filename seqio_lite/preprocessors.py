"""Per-example preprocessors: rekey, tokenize, EOS handling, T5 span corruption.

Each preprocessor is `fn(example, **kwargs) -> example | None`; see `dataset_providers` for the
keyword arguments (`sequence_length`, `output_features`, `rng`) and how they are seeded. Those
that need configuration are factories returning such a function, or are bound with
`functools.partial`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import numpy as np

from seqio_lite.dataset_providers import Feature

Example = dict[str, Any]


def rekey(example: Example, key_map: Mapping[str, str | None]) -> Example:
    """Renames features: `{new_key: old_key}`; an `old_key` of None gives an empty string.

    Bind `key_map` with `functools.partial(rekey, key_map={...})`.
    """
    return {new: (example[old] if old is not None else "") for new, old in key_map.items()}


def tokenize(
    example: Example,
    output_features: Mapping[str, Feature],
    copy_pretokenized: bool = True,
    with_eos: bool = False,
) -> Example:
    """Encodes every string output feature with its vocabulary (to int32 arrays).

    Keeps the text as `<name>_pretokenized` when `copy_pretokenized`, as seqio does, so
    evaluation can compare against the original text.
    """
    out = dict(example)
    for name, feat in output_features.items():
        value = example.get(name)
        if isinstance(value, str):
            ids = feat.vocabulary.encode_np(value)
            if with_eos and feat.add_eos:
                ids = np.append(ids, np.int32(feat.vocabulary.eos_id))
            out[name] = ids.astype(feat.dtype, copy=False)
            if copy_pretokenized:
                out[f"{name}_pretokenized"] = value
        elif value is not None and not isinstance(value, np.ndarray):
            out[name] = np.asarray(feat.vocabulary.encode(value), dtype=feat.dtype)
    return out


def append_eos(example: Example, output_features: Mapping[str, Feature]) -> Example:
    """Appends EOS to every output feature whose `add_eos` is set."""
    out = dict(example)
    for name, feat in output_features.items():
        if feat.add_eos and name in example:
            out[name] = np.append(np.asarray(example[name]), feat.vocabulary.eos_id).astype(
                feat.dtype
            )
    return out


def append_eos_after_trim(
    example: Example,
    output_features: Mapping[str, Feature],
    sequence_length: Mapping[str, int] | None = None,
) -> Example:
    """Trims features to `sequence_length[name] - 1` then appends EOS, so EOS is never cut off."""
    out = dict(example)
    for name, feat in output_features.items():
        if name not in example:
            continue
        ids = np.asarray(example[name])
        if feat.add_eos:
            if sequence_length is not None and sequence_length.get(name) is not None:
                ids = ids[: sequence_length[name] - 1]
            if ids.ndim == 1:
                # The ids then EOS written straight into the output array: what appending and
                # casting give (the ids cast as `astype` casts them), in two numpy calls of five
                # (per feature of every example, on the thread that feeds the devices).
                out[name] = with_eos = np.empty(ids.size + 1, feat.dtype)
                with_eos[:-1] = ids
                with_eos[-1] = _cast_id(feat.vocabulary.eos_id, feat.dtype)
                continue
            # np.append's dtype (int64 for an int32 array and a Python int), without its
            # ravel / asanyarray overhead per example; cast below as before.
            ids = np.concatenate((ids, np.asarray([feat.vocabulary.eos_id])))
        elif sequence_length is not None and sequence_length.get(name) is not None:
            ids = ids[: sequence_length[name]]
        out[name] = ids.astype(feat.dtype)
    return out


@functools.lru_cache(maxsize=64)
def _cast_id(token_id: int, dtype: Any) -> np.generic:
    """`token_id` cast as `astype` casts it, once per id and dtype rather than per example."""
    return np.asarray(token_id).astype(dtype)[()]


def random_crop(
    example: Example,
    sequence_length: Mapping[str, int],
    output_features: Mapping[str, Feature],
    rng: np.random.Generator,
    feature: str = "targets",
) -> Example:
    """Keeps a random window of `feature` that fits its length (leaving room for EOS).

    For language modelling on documents longer than the sequence: each epoch sees a different
    window of each document, instead of always its first tokens.
    """
    ids = np.asarray(example[feature])
    room = sequence_length[feature] - int(output_features[feature].add_eos)
    if ids.size <= room:
        return example
    start = int(rng.integers(0, ids.size - room + 1))
    return {**example, feature: ids[start : start + room]}


def prefix_lm(
    example: Example,
    sequence_length: Mapping[str, int],
    output_features: Mapping[str, Feature],
    rng: np.random.Generator,
) -> Example | None:
    """T5's prefix-LM objective on the tokenized `targets` of one document.

    Takes a random window of up to `inputs + targets` tokens (leaving room for EOS on each) and
    splits it at a uniformly random point that leaves both parts non-empty and the prefix within
    the inputs length: the prefix becomes `inputs`, what follows (up to the targets length)
    `targets`. Documents shorter than two tokens are dropped. Seeded per example by `rng`, so
    each epoch sees a different window and split.
    """
    tokens = np.asarray(example["targets"])
    room_in = sequence_length["inputs"] - int(output_features["inputs"].add_eos)
    room_tgt = sequence_length["targets"] - int(output_features["targets"].add_eos)
    width = min(tokens.size, room_in + room_tgt)
    if width < 2 or room_in < 1 or room_tgt < 1:
        return None
    start = int(rng.integers(0, tokens.size - width + 1))
    window = tokens[start : start + width]
    cut = int(rng.integers(1, min(width - 1, room_in) + 1))
    # The document's text no longer describes either part: evaluation decodes the ids.
    return {"inputs": window[:cut], "targets": window[cut : cut + room_tgt]}


# --------------------------------------------------------------------------------------------
# T5 span corruption (numpy port of t5.data.preprocessors.span_corruption)
# --------------------------------------------------------------------------------------------


def random_spans_helper(
    inputs_length: int,
    noise_density: float,
    mean_noise_span_length: float,
    extra_tokens_per_span_inputs: int = 1,
    extra_tokens_per_span_targets: int = 1,
) -> tuple[int, int]:
    """Returns (tokens_length, targets_length): the longest raw span whose corrupted inputs
    (with one EOS) fit in `inputs_length`, and the length of the corresponding targets."""

    def lengths(tokens_length: int) -> tuple[int, int]:
        num_noise = round(tokens_length * noise_density)
        num_nonnoise = tokens_length - num_noise
        num_spans = round(num_noise / mean_noise_span_length)
        return (
            num_nonnoise + num_spans * extra_tokens_per_span_inputs + 1,
            num_noise + num_spans * extra_tokens_per_span_targets + 1,
        )

    tokens_length = inputs_length - 1
    while lengths(tokens_length + 1)[0] <= inputs_length:
        tokens_length += 1
    _, targets_length = lengths(tokens_length)
    return tokens_length, targets_length


def _random_segmentation(num_items: int, num_segments: int, rng: np.random.Generator) -> np.ndarray:
    """Splits `num_items` into `num_segments` random positive lengths."""
    first = np.zeros(num_items, dtype=bool)
    cuts = rng.permutation(num_items - 1)[: num_segments - 1] + 1
    first[cuts] = True
    segment_id = np.cumsum(first)
    return np.bincount(segment_id, minlength=num_segments)


def random_spans_noise_mask(
    length: int, noise_density: float, mean_noise_span_length: float, rng: np.random.Generator
) -> np.ndarray:
    """Boolean mask of noise positions: ~`noise_density` of them, in spans averaging
    `mean_noise_span_length`; the sequence starts with non-noise, as in T5."""
    orig_length = length
    length = max(length, 2)
    num_noise = round(length * noise_density)
    num_noise = min(max(num_noise, 1), length - 1)
    num_spans = max(round(num_noise / mean_noise_span_length), 1)
    num_spans = min(num_spans, num_noise, length - num_noise)
    noise_lengths = _random_segmentation(num_noise, num_spans, rng)
    nonnoise_lengths = _random_segmentation(length - num_noise, num_spans, rng)
    interleaved = np.stack([nonnoise_lengths, noise_lengths], axis=1).reshape(-1)
    span_starts = np.cumsum(interleaved)[:-1]
    indicator = np.zeros(length, dtype=np.int32)
    indicator[span_starts] = 1
    is_noise = np.cumsum(indicator) % 2 == 1
    return is_noise[:orig_length]


def _spans_to_sentinels(tokens: np.ndarray, mask: np.ndarray, vocab_size: int) -> np.ndarray:
    """Replaces each masked span by one sentinel (vocab_size-1, vocab_size-2, ...)."""
    prev = np.concatenate([[False], mask[:-1]])
    first = mask & ~prev
    subsequent = mask & prev
    sentinels = vocab_size - np.cumsum(first)
    return np.where(first, sentinels, tokens)[~subsequent].astype(tokens.dtype)


def span_corruption(
    example: Example,
    sequence_length: Mapping[str, int],
    output_features: Mapping[str, Feature],
    rng: np.random.Generator,
    noise_density: float = 0.15,
    mean_noise_span_length: float = 3.0,
    input_feature_key: str = "inputs",
) -> Example | None:
    """T5's span corruption on the tokenized `targets` of one example.

    Takes a random window of the document (seeded per example by `rng`) just long enough that
    the corrupted inputs fit `sequence_length[input_feature_key]` with EOS; noise spans become
    sentinels in the inputs, and the targets list each sentinel followed by its span.

    NOTE: T5 splits each document into consecutive windows (one example each); this per-example
    version takes one random window per document per epoch instead, keeping the pipeline 1:1.
    """
    tokens = np.asarray(example["targets"])
    if tokens.size == 0:
        return None
    tokens_length, _ = random_spans_helper(
        sequence_length[input_feature_key], noise_density, mean_noise_span_length
    )
    if tokens.size > tokens_length:
        start = int(rng.integers(0, tokens.size - tokens_length + 1))
        tokens = tokens[start : start + tokens_length]
    mask = random_spans_noise_mask(tokens.size, noise_density, mean_noise_span_length, rng)
    vocab_size = output_features["targets"].vocabulary.vocab_size
    return {
        input_feature_key: _spans_to_sentinels(tokens, mask, vocab_size),
        "targets": _spans_to_sentinels(tokens, ~mask, vocab_size),
    }


def span_corruption_fn(
    noise_density: float = 0.15, mean_noise_span_length: float = 3.0
) -> functools.partial:
    """`span_corruption` with its rates bound, ready for a Task's preprocessor list."""
    return functools.partial(
        span_corruption, noise_density=noise_density, mean_noise_span_length=mean_noise_span_length
    )
