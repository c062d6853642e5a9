"""Feature converters: task features (`inputs`, `targets`) -> model features, packed or padded.

Model feature names follow t5x/seqio:

- `EncDecFeatureConverter`: encoder_input_tokens, decoder_target_tokens, decoder_input_tokens,
  decoder_loss_weights (+ encoder/decoder_segment_ids, encoder/decoder_positions when packed);
- `LMFeatureConverter`: decoder_target_tokens, decoder_input_tokens, decoder_loss_weights
  (+ decoder_segment_ids, decoder_positions when packed);
- `PrefixLMFeatureConverter`: the LM features + decoder_causal_attention; loss on targets only
  (or, with `loss_on_targets_only=False`, on the inputs too).

Options shared with seqio: `bos_id` (the decoder start token written at each segment start of
`decoder_input_tokens`, 0 by default as in T5) and `passthrough_features` (extra 1-D task features
carried into the batch under their own name and length, packed alongside their example).

A converter works in two steps so the loader can pack greedily: `convert_example` turns one task
example into its unpadded 1-D stored features (`GROUPS`), and `make_batch` lays rows of such
examples out into `[batch, length]` arrays and derives the rest on the whole batch at once:
`decoder_input_tokens` is the targets shifted right with `bos_id` at *every segment start*, so
packing cannot leak a token across a segment boundary, and 0 on padding (NOTE: seqio writes the
shifted EOS into the first padding slot of an unpacked row, and `bos_id` into the first padding
slot after the last segment of a packed one; both sit where the loss weight is 0);
`decoder_loss_weights` marks non-padding targets. (Deriving per batch keeps the per-example
objects, which cross process boundaries when grain workers are used, small.) With packing,
segment ids count from 1 per row (0 is padding) and positions restart at 0 in each segment.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

Example = dict[str, Any]
# Feature group -> model length; packing fills each group of a row independently.
GroupLengths = dict[str, int]

_OVERLONG = ("trim", "drop", "error")


class FeatureConverter(abc.ABC):
    """Base class. Subclasses set `TASK_FEATURES`, `GROUPS` and implement `_convert`.

    Args:
      pack: pack several examples per row (segment ids, positions) instead of one padded row.
      overlong: what to do with a task feature longer than its length: "trim" (default, as the
        feature spec says), "drop" (skip the example; counted by the loader) or "error".
      bos_id: the decoder start token, written at position 0 of every segment of
        `decoder_input_tokens` (seqio's `bos_id`; T5: 0, the padding id).
      passthrough_features: names of extra 1-D task features (seqio's `passthrough_features`)
        carried into the batch unchanged, each at its own length from `task_feature_lengths`,
        padded with 0 and, when packing, placed in the row of their example (with
        `<name>_segment_ids` and `<name>_positions`). Their dtype is kept.
    """

    TASK_FEATURES: tuple[str, ...] = ()
    GROUPS: ClassVar[dict[str, tuple[str, ...]]] = {}  # group -> model features sharing its length

    def __init__(
        self,
        pack: bool = True,
        overlong: str = "trim",
        *,
        bos_id: int = 0,
        passthrough_features: Sequence[str] = (),
    ):
        if overlong not in _OVERLONG:
            raise ValueError(f"overlong must be one of {_OVERLONG}, got {overlong!r}")
        self.pack = pack
        self.overlong = overlong
        self.bos_id = int(bos_id)
        self.passthrough_features = tuple(passthrough_features)
        model_features = {n for names in self.GROUPS.values() for n in names}
        clash = sorted(set(self.passthrough_features) & (set(self.TASK_FEATURES) | model_features))
        if clash or len(set(self.passthrough_features)) != len(self.passthrough_features):
            raise ValueError(
                f"passthrough_features {list(self.passthrough_features)} must be distinct and "
                f"not task or model features of {type(self).__name__} (clash: {clash})"
            )
        # Each passthrough feature is a group of its own: its own length, packed independently.
        self.groups: dict[str, tuple[str, ...]] = {
            **self.GROUPS,
            **{n: (n,) for n in self.passthrough_features},
        }

    def _options(self) -> str:
        """Non-default options, so default converters keep their pre-existing fingerprint."""
        extra = ""
        if self.bos_id:
            extra += f", bos_id={self.bos_id}"
        if self.passthrough_features:
            extra += f", passthrough_features={list(self.passthrough_features)}"
        return extra

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(pack={self.pack}, overlong={self.overlong!r}{self._options()})"
        )

    @property
    def name(self) -> str:
        """Identity used in iterator-state fingerprints."""
        return repr(self)

    def group_lengths(self, task_feature_lengths: Mapping[str, int]) -> GroupLengths:
        """Model length of each feature group (passthrough features: their own length)."""
        lengths = self._group_lengths(task_feature_lengths)
        missing = [n for n in self.passthrough_features if n not in task_feature_lengths]
        if missing:
            raise ValueError(
                f"{type(self).__name__}: sequence_length lacks passthrough features {missing}"
            )
        return {**lengths, **{n: task_feature_lengths[n] for n in self.passthrough_features}}

    @abc.abstractmethod
    def _group_lengths(self, task_feature_lengths: Mapping[str, int]) -> GroupLengths:
        """Model length of each of the converter's own feature groups."""

    @abc.abstractmethod
    def _convert(self, ex: Mapping[str, np.ndarray]) -> Example:
        """One trimmed task example -> its model features (unpacked)."""

    def convert_example(self, example: Example, task_feature_lengths: Mapping[str, int]) -> Example:
        """Trims (per `overlong`) and converts one example; `{}` means "dropped"."""
        features = (*self.TASK_FEATURES, *self.passthrough_features)
        # One subset test per example; the messages only when it fails (this runs for every
        # example on the thread that feeds the devices).
        if not task_feature_lengths.keys() >= set(features):
            missing = [k for k in self.TASK_FEATURES if k not in task_feature_lengths]
            if missing:
                raise ValueError(f"{type(self).__name__}: sequence_length lacks {missing}")
            missing = [k for k in self.passthrough_features if k not in task_feature_lengths]
            raise ValueError(
                f"{type(self).__name__}: sequence_length lacks passthrough features {missing}"
            )
        ex = {}
        for k in features:
            if k not in example:
                raise ValueError(
                    f"{type(self).__name__} needs task feature {k!r}; example has {sorted(example)}"
                )
            ids = example[k]
            if k in self.passthrough_features:  # e.g. float weights: their dtype is kept
                ids = np.asarray(ids).reshape(-1)
            elif not (type(ids) is np.ndarray and ids.dtype == np.int32 and ids.ndim == 1):
                ids = np.asarray(ids, dtype=np.int32).reshape(-1)  # task features are ids
            limit = task_feature_lengths[k]
            if ids.size > limit:
                if self.overlong == "drop":
                    return {}
                if self.overlong == "error":
                    raise ValueError(
                        f"Feature {k!r} has length {ids.size} > sequence_length {limit} "
                        "(set overlong='trim' or 'drop' to allow)"
                    )
                ids = ids[:limit]
            ex[k] = ids
        out = self._convert(ex)
        for k in self.passthrough_features:
            out[k] = ex[k]
        return out

    def example_lengths(self, converted: Example) -> dict[str, int]:
        """Length of each group in one converted example."""
        return {g: len(converted[names[0]]) for g, names in self.groups.items()}

    def make_batch(
        self, rows: Sequence[Sequence[Example]], batch_size: int, lengths: GroupLengths
    ) -> dict[str, np.ndarray]:
        """Lays `rows` (each a list of converted examples) out as `[batch_size, length]` arrays.

        Rows beyond `len(rows)` are all padding. Without packing each row holds one example.
        """
        out: dict[str, np.ndarray] = {}
        if not self.pack and any(len(row) > 1 for row in rows):
            raise ValueError("unpacked rows hold one example each")
        examples = [ex for row in rows for ex in row]
        for group, names in self.groups.items():
            length = lengths[group]
            arrays = {n: np.zeros((batch_size, length), self._dtype(rows, n)) for n in names}
            seg = np.zeros((batch_size, length), np.int32)
            pos = np.zeros((batch_size, length), np.int32)
            # Every example of the batch in one scatter per feature (a Python loop of slice
            # assignments per example and feature cost more than the rest of the pipeline):
            # segment s of row r starts where the row's earlier segments end.
            sizes, starts, segments = [], [], []
            for r, row in enumerate(rows):
                start = r * length
                for s, ex in enumerate(row, start=1):
                    n = len(ex[names[0]])
                    sizes.append(n)
                    starts.append(start)
                    segments.append(s)
                    start += n
                if start > (r + 1) * length:  # the scatter would run into the next row
                    raise ValueError(
                        f"row {r} holds {start - r * length} {group} positions; the length is "
                        f"{length}"
                    )
            if examples:
                n_arr = np.asarray(sizes, np.int64)
                first = np.cumsum(n_arr) - n_arr  # each example's offset in the concatenation
                within = np.arange(int(n_arr.sum())) - np.repeat(first, n_arr)
                flat = np.repeat(np.asarray(starts, np.int64), n_arr) + within
                for name in names:
                    arrays[name].reshape(-1)[flat] = np.concatenate(
                        [np.asarray(ex[name]) for ex in examples]
                    )
                seg.reshape(-1)[flat] = np.repeat(np.asarray(segments, np.int32), n_arr)
                pos.reshape(-1)[flat] = within
            out.update(arrays)
            if self.pack:
                out[f"{group}_segment_ids"] = seg
                out[f"{group}_positions"] = pos
            if group == "decoder":
                targets = out["decoder_target_tokens"]
                inputs = np.zeros_like(targets)
                inputs[:, 1:] = targets[:, :-1]
                # Each segment starts afresh with BOS at position 0; padding stays 0.
                inputs[pos == 0] = 0
                inputs[(pos == 0) & (seg > 0)] = self.bos_id
                out["decoder_input_tokens"] = inputs
                if "decoder_loss_weights" not in out:
                    out["decoder_loss_weights"] = (targets != 0).astype(np.int32)
        return out

    def _dtype(self, rows: Sequence[Sequence[Example]], name: str) -> np.dtype:
        """int32 for model features; a passthrough feature's own dtype."""
        if name in self.passthrough_features:
            for row in rows:
                for ex in row:
                    return np.asarray(ex[name]).dtype
        return np.dtype(np.int32)

    def unpack(self, batch: Mapping[str, np.ndarray]) -> list[Example]:
        """Inverse of `make_batch`: the converted examples, row by row, segment by segment."""
        examples: list[Example] = []
        first = next(iter(self.groups))
        nrows = batch[self.groups[first][0]].shape[0]
        for r in range(nrows):
            if self.pack:
                segs = {g: batch[f"{g}_segment_ids"][r] for g in self.groups}
                nseg = int(segs[first].max())
                for s in range(1, nseg + 1):
                    ex = {}
                    for g, names in self.groups.items():
                        sel = segs[g] == s
                        ex.update({n: batch[n][r][sel] for n in names})
                    examples.append(ex)
            else:
                ex = {}
                for names in self.groups.values():
                    # A row's length is up to its last non-pad target/input token.
                    key = batch[names[0]][r]
                    n = int(np.max(np.nonzero(key)[0]) + 1) if key.any() else 0
                    ex.update({name: batch[name][r][:n] for name in names})
                if any(len(v) for v in ex.values()):
                    examples.append(ex)
        return examples


def complete_features(
    batch: Mapping[str, np.ndarray], features: Sequence[str]
) -> dict[str, np.ndarray]:
    """`batch` plus the `features` it lacks, with what they mean for an unpacked batch.

    A model reads a fixed feature set; an unpacked batch (or a converter without a feature,
    e.g. `decoder_causal_attention` from the LM converter) omits some. One example per row:
    segment id 1 on tokens and 0 on padding, positions counting from 0, loss on every
    non-padding target, no bidirectional prefix.
    """
    out = dict(batch)
    for name in features:
        if name in out:
            continue
        group = "encoder" if name.startswith("encoder") else "decoder"
        tokens = out["encoder_input_tokens" if group == "encoder" else "decoder_target_tokens"]
        if name == "decoder_loss_weights":
            out[name] = (out["decoder_target_tokens"] != 0).astype(np.int32)
        elif name.endswith("_segment_ids"):
            out[name] = (tokens != 0).astype(np.int32)
        elif name.endswith("_positions"):
            out[name] = np.where(tokens != 0, np.arange(tokens.shape[1], dtype=np.int32), 0)
            out[name] = out[name].astype(np.int32)
        elif name == "decoder_causal_attention":
            out[name] = np.zeros_like(tokens, np.int32)
        else:
            raise ValueError(f"no converter feature {name!r} (batch has {sorted(batch)})")
    return out


class EncDecFeatureConverter(FeatureConverter):
    """Encoder-decoder (T5): inputs -> encoder, targets -> decoder."""

    TASK_FEATURES = ("inputs", "targets")
    GROUPS: ClassVar[dict[str, tuple[str, ...]]] = {
        "encoder": ("encoder_input_tokens",),
        "decoder": ("decoder_target_tokens",),
    }

    def _group_lengths(self, task_feature_lengths: Mapping[str, int]) -> GroupLengths:
        return {
            "encoder": task_feature_lengths["inputs"],
            "decoder": task_feature_lengths["targets"],
        }

    def _convert(self, ex: Mapping[str, np.ndarray]) -> Example:
        return {"encoder_input_tokens": ex["inputs"], "decoder_target_tokens": ex["targets"]}


class LMFeatureConverter(FeatureConverter):
    """Decoder-only language model on `targets`."""

    TASK_FEATURES = ("targets",)
    GROUPS: ClassVar[dict[str, tuple[str, ...]]] = {"decoder": ("decoder_target_tokens",)}

    def _group_lengths(self, task_feature_lengths: Mapping[str, int]) -> GroupLengths:
        return {"decoder": task_feature_lengths["targets"]}

    def _convert(self, ex: Mapping[str, np.ndarray]) -> Example:
        return {"decoder_target_tokens": ex["targets"]}


class PrefixLMFeatureConverter(FeatureConverter):
    """Decoder-only on `inputs ++ targets`: full attention over the prefix, loss on the targets.

    `decoder_causal_attention` is 1 on the inputs and on the first target position (which reads
    the last input token through the shifted `decoder_input_tokens`), as in seqio. Unpacked, an
    example with empty targets gets one padding target (seqio's), so that position is still
    there: it is where decoding from the prompt starts. Packed, it is dropped, as seqio's
    packing drops it (see docs/differences.md).

    Args:
      loss_on_targets_only: True (default): loss weights only on the targets part; False: on
        every non-padding token, inputs included (seqio's `loss_on_targets_only=False`).
      **kwargs: see `FeatureConverter`.
    """

    def __init__(self, *args: Any, loss_on_targets_only: bool = True, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.loss_on_targets_only = bool(loss_on_targets_only)

    def _options(self) -> str:
        extra = "" if self.loss_on_targets_only else ", loss_on_targets_only=False"
        return super()._options() + extra

    TASK_FEATURES = ("inputs", "targets")
    GROUPS: ClassVar[dict[str, tuple[str, ...]]] = {
        "decoder": (
            "decoder_target_tokens",
            "decoder_loss_weights",
            "decoder_causal_attention",
        )
    }

    def _group_lengths(self, task_feature_lengths: Mapping[str, int]) -> GroupLengths:
        return {"decoder": task_feature_lengths["inputs"] + task_feature_lengths["targets"]}

    def _convert(self, ex: Mapping[str, np.ndarray]) -> Example:
        inputs, targets = ex["inputs"], ex["targets"]
        if targets.size == 0 and not self.pack:
            # NOTE: without it the position after the inputs would be padding, with
            # decoder_causal_attention 0 and decoder_input_tokens 0 there, and a decode would
            # start one token early (without the last input, usually EOS).
            targets = np.zeros(1, np.int32)
        seq = np.concatenate([inputs, targets]).astype(np.int32)
        positions = np.arange(seq.size)
        return {
            "decoder_target_tokens": seq,
            "decoder_loss_weights": (
                ((positions >= inputs.size) | (not self.loss_on_targets_only)) & (seq != 0)
            ).astype(np.int32),
            "decoder_causal_attention": (positions < inputs.size + 1).astype(np.int32),
        }


class RowPacker:
    """Greedy first-fit packing of converted examples into the rows of one batch.

    `add` places an example in the first row with room in every group; it returns False when no
    row has room (the batch is full; the example should start the next batch). Without packing
    each row takes one example.
    """

    def __init__(self, converter: FeatureConverter, batch_size: int, lengths: GroupLengths):
        self._conv = converter
        self._batch_size = batch_size
        self._lengths = lengths
        self.rows: list[list[Example]] = []
        # The feature whose length is each group's length, in the order of `converter.groups`.
        self._keys = tuple(names[0] for names in converter.groups.values())
        # Room left in each row, one list per group: plain ints compared in a Python loop cost
        # a third of a numpy comparison over all rows at these sizes (tens of rows, a few
        # groups), for every example on the thread that feeds the devices.
        self._free = [[lengths[g]] * batch_size for g in converter.groups]

    def add(self, example: Example) -> bool:
        """Places `example`; False if the batch has no room for it."""
        need = [len(example[k]) for k in self._keys]
        free, nrows = self._free, len(self.rows)
        if self._conv.pack and nrows:
            r = _first_fit(free, need, nrows)
            if r is not None:
                self.rows[r].append(example)
                for f, n in zip(free, need):
                    f[r] -= n
                return True
        if nrows < self._batch_size:
            for f, n in zip(free, need):
                f[nrows] -= n
            self.rows.append([example])
            return True
        return False

    def __len__(self) -> int:
        return len(self.rows)

    def batch(self) -> dict[str, np.ndarray]:
        """The arrays for the rows placed so far."""
        return self._conv.make_batch(self.rows, self._batch_size, self._lengths)


def _first_fit(free: list[list[int]], need: list[int], nrows: int) -> int | None:
    """The first of rows `0..nrows-1` with `free[g][row] >= need[g]` in every group g."""
    if len(need) == 2:  # encoder-decoder: the common case, unrolled
        f0, f1 = free
        n0, n1 = need
        for r in range(nrows):
            if f0[r] >= n0 and f1[r] >= n1:
                return r
        return None
    if len(need) == 1:
        (f0,), (n0,) = free, need
        for r in range(nrows):
            if f0[r] >= n0:
                return r
        return None
    for r in range(nrows):
        if all(f[r] >= n for f, n in zip(free, need)):
            return r
    return None
