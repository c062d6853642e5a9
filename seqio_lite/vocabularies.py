"""Vocabularies: map text to token ids and back.

All vocabularies share seqio's conventions: id 0 is padding, id 1 is end-of-sequence, and `decode`
stops at the first EOS. Sentinel ("extra") ids follow seqio's order: `extra_id_0` is the *last* id
of the vocabulary (`vocab_size - 1`), `extra_id_1` the one before it, and so on.
"""

from __future__ import annotations

import abc
import hashlib
import os
import re
from collections.abc import Iterable, Sequence

import numpy as np

PAD_ID = 0
EOS_ID = 1

_EXTRA_ID_RE = re.compile(r"<extra_id_(\d+)>")


class Vocabulary(abc.ABC):
    """Base class: `encode` text to ids, `decode` ids to text, and a stable `fingerprint`."""

    pad_id: int = PAD_ID
    eos_id: int = EOS_ID
    unk_id: int | None = 2

    def __init__(self, extra_ids: int = 0):
        self._extra_ids = extra_ids

    @property
    def extra_ids(self) -> int:
        """Number of sentinel ids at the top of the vocabulary."""
        return self._extra_ids

    @property
    @abc.abstractmethod
    def _base_vocab_size(self) -> int:
        """Size of the vocabulary without the extra ids."""

    @property
    def vocab_size(self) -> int:
        """Total number of ids, extra ids included."""
        return self._base_vocab_size + self._extra_ids

    def sentinel_id(self, k: int) -> int:
        """Id of `<extra_id_k>`: counts down from the last id, as seqio does."""
        return self.vocab_size - 1 - k

    @abc.abstractmethod
    def encode(self, s: str) -> list[int]:
        """Encodes text to ids (no EOS added)."""

    @abc.abstractmethod
    def _decode(self, ids: Sequence[int]) -> str:
        """Decodes ids that contain neither padding nor EOS."""

    def decode(self, ids: Iterable[int]) -> str:
        """Decodes ids to text, stopping at the first EOS and dropping padding."""
        return self._decode(_clean_ids(ids, self.eos_id, self.pad_id))

    def encode_np(self, s: str) -> np.ndarray:
        """Encodes text to an int32 array."""
        return np.asarray(self.encode(s), dtype=np.int32)

    @property
    @abc.abstractmethod
    def fingerprint(self) -> str:
        """A short string that changes whenever the id mapping changes."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Vocabulary) and self.fingerprint == other.fingerprint

    def __hash__(self) -> int:
        return hash(self.fingerprint)


def _clean_ids(ids: Iterable[int], eos_id: int, pad_id: int) -> list[int]:
    """Truncates after the first EOS and drops padding."""
    out = []
    for i in np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids).reshape(-1):
        i = int(i)
        if i == eos_id:
            break
        if i != pad_id:
            out.append(i)
    return out


class ByteVocabulary(Vocabulary):
    """ByT5's byte vocabulary: 0 pad, 1 eos, 2 unk, byte b -> b + 3; extra ids above 258."""

    _OFFSET = 3
    _OFFSET_INT32 = np.int32(_OFFSET)  # the scalar that widens bytes to int32

    @property
    def _base_vocab_size(self) -> int:
        return 256 + self._OFFSET

    def encode(self, s: str) -> list[int]:
        return [b + self._OFFSET for b in s.encode("utf-8")]

    def encode_np(self, s: str) -> np.ndarray:
        # Vectorised path: tokenisation is the hot loop of the byte-level tasks. One ufunc: the
        # bytes plus an int32 scalar are int32 (NumPy 2 promotion; no uint8 overflow), a third
        # cheaper than the same addition with an explicit `dtype=`.
        return np.frombuffer(s.encode("utf-8"), dtype=np.uint8) + self._OFFSET_INT32

    def _decode(self, ids: Sequence[int]) -> str:
        # Special and extra ids have no byte; ByT5 drops them, as do we.
        data = bytes(i - self._OFFSET for i in ids if self._OFFSET <= i < self._base_vocab_size)
        return data.decode("utf-8", errors="ignore")

    @property
    def fingerprint(self) -> str:
        return f"byte:extra_ids={self._extra_ids}"


class PassThroughVocabulary(Vocabulary):
    """Ids in, ids out: `encode` takes a sequence of ints (or a string of space-separated ints).

    `decode` returns the ids (up to EOS, padding dropped) joined by spaces, so `decode(encode(x))`
    round-trips `" ".join(map(str, x))`.
    """

    unk_id = None

    def __init__(self, size: int, eos_id: int = EOS_ID):
        super().__init__(extra_ids=0)
        self._size = size
        self.eos_id = eos_id

    @property
    def _base_vocab_size(self) -> int:
        return self._size

    def encode(self, s: str | Sequence[int]) -> list[int]:  # type: ignore[override]
        ids = [int(t) for t in s.split()] if isinstance(s, str) else [int(t) for t in s]
        bad = [i for i in ids if not 0 <= i < self._size]
        if bad:
            raise ValueError(
                f"PassThroughVocabulary(size={self._size}): ids out of range: {bad[:5]}"
            )
        return ids

    def _decode(self, ids: Sequence[int]) -> str:
        return " ".join(str(i) for i in ids)

    @property
    def fingerprint(self) -> str:
        return f"passthrough:size={self._size}:eos={self.eos_id}"


class SentencePieceVocabulary(Vocabulary):
    """A SentencePiece model file plus `extra_ids` sentinels appended at the top of the ids.

    The model must use T5's special ids (pad 0, eos 1, unk 2); `train_sentencepiece` makes such
    models. Sentinels appear as `<extra_id_k>` in text, on both `encode` and `decode`.
    """

    def __init__(self, model_file: str | os.PathLike, extra_ids: int = 0):
        super().__init__(extra_ids=extra_ids)
        import sentencepiece as spm

        self._model_file = os.fspath(model_file)
        if not os.path.exists(self._model_file):
            raise FileNotFoundError(f"SentencePiece model file not found: {self._model_file}")
        with open(self._model_file, "rb") as f:
            self._model_bytes = f.read()
        self._sp = spm.SentencePieceProcessor(model_proto=self._model_bytes)
        if self._sp.pad_id() != PAD_ID or self._sp.eos_id() != EOS_ID:
            raise ValueError(
                f"{self._model_file}: SentencePiece model must have pad_id=0 and eos_id=1 "
                f"(has pad_id={self._sp.pad_id()}, eos_id={self._sp.eos_id()})"
            )
        self.unk_id = self._sp.unk_id()

    def __getstate__(self) -> dict:
        # SentencePieceProcessor does not pickle; worker processes rebuild it from the bytes.
        return {
            "model_file": self._model_file,
            "bytes": self._model_bytes,
            "extra": self._extra_ids,
        }

    def __setstate__(self, state: dict) -> None:
        import sentencepiece as spm

        self._model_file, self._model_bytes = state["model_file"], state["bytes"]
        self._extra_ids = state["extra"]
        self._sp = spm.SentencePieceProcessor(model_proto=self._model_bytes)
        self.unk_id = self._sp.unk_id()

    @property
    def model_file(self) -> str:
        """The SentencePiece model file this vocabulary was read from."""
        return self._model_file

    @property
    def model_bytes(self) -> bytes:
        """The serialized model, as read (what a copy beside a trained model must hold)."""
        return self._model_bytes

    @property
    def _base_vocab_size(self) -> int:
        return self._sp.get_piece_size()

    def encode(self, s: str) -> list[int]:
        if "<extra_id_" not in s:
            return self._sp.encode(s)
        ids: list[int] = []
        pos = 0
        for m in _EXTRA_ID_RE.finditer(s):
            ids.extend(self._sp.encode(s[pos : m.start()]))
            ids.append(self.sentinel_id(int(m.group(1))))
            pos = m.end()
        ids.extend(self._sp.encode(s[pos:]))
        return ids

    def _decode(self, ids: Sequence[int]) -> str:
        base = self._base_vocab_size
        parts: list[str] = []
        ids = list(ids)
        if ids and ids[0] < base and self._sp.id_to_piece(ids[0]).startswith("\u2581"):
            # The first run's leading space is SentencePiece's word marker, not text.
            parts.append(self._sp.decode([ids[0]]))
            ids = ids[1:]
        run: list[int] = []
        for i in ids:
            if i >= base:
                parts.append(self._decode_run(run))
                parts.append(f"<extra_id_{self.vocab_size - 1 - i}>")
                run = []
            else:
                run.append(i)
        parts.append(self._decode_run(run))
        return "".join(parts)

    def _decode_run(self, run: list[int]) -> str:
        # SentencePiece drops the leading space of a decoded sequence; after a sentinel that
        # space is real ("<extra_id_0> fox"), so put it back to keep encode(decode(x)) == x.
        text = self._sp.decode(run)
        if run and self._sp.id_to_piece(run[0]).startswith("\u2581"):
            text = " " + text
        return text

    @property
    def fingerprint(self) -> str:
        digest = hashlib.sha256(self._model_bytes).hexdigest()[:16]
        return f"spm:{digest}:extra_ids={self._extra_ids}"


def train_sentencepiece(
    text_files: Sequence[str | os.PathLike],
    model_prefix: str | os.PathLike,
    vocab_size: int,
    model_type: str = "unigram",
    character_coverage: float = 1.0,
    seed_sentencepiece_size: int = 100_000,
    normalization_rule_name: str = "nmt_nfkc",
) -> str:
    """Trains a SentencePiece model with T5's special ids on local text files.

    Args:
      text_files: plain-text files, one sentence or paragraph per line.
      model_prefix: output path without extension; writes `<prefix>.model` and `<prefix>.vocab`.
      vocab_size: number of pieces, special ids included (extra ids come on top of this).
      model_type: "unigram" (T5's choice) or "bpe".
      character_coverage: fraction of characters covered by the model.
      seed_sentencepiece_size: size of the initial unigram seed vocabulary.
      normalization_rule_name: "nmt_nfkc" (T5's) or "identity" (a ~200 KB smaller model file).

    Returns:
      The path of the `.model` file.
    """
    import sentencepiece as spm

    missing = [os.fspath(f) for f in text_files if not os.path.exists(f)]
    if missing:
        raise FileNotFoundError(f"train_sentencepiece: no such text file(s): {missing}")
    spm.SentencePieceTrainer.train(
        input=",".join(os.fspath(f) for f in text_files),
        model_prefix=os.fspath(model_prefix),
        vocab_size=vocab_size,
        model_type=model_type,
        character_coverage=character_coverage,
        seed_sentencepiece_size=seed_sentencepiece_size,
        pad_id=PAD_ID,
        eos_id=EOS_ID,
        unk_id=2,
        bos_id=-1,
        # Deterministic output: one thread and no sentence shuffling / sampling.
        num_threads=1,
        shuffle_input_sentence=False,
        normalization_rule_name=normalization_rule_name,
        minloglevel=2,
    )
    return os.fspath(model_prefix) + ".model"
