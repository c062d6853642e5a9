"""The text <-> token ids of a model under lm-evaluation-harness: its own vocabulary.

Two kinds, one interface (`Tokens`): a seqio_lite vocabulary (SentencePiece or bytes, what
t5lite models are trained with) and the Hugging Face tokenizer an imported model carries
(`t5lite convert` copies its files beside the checkpoint). `find_tokens` picks one.
"""

from __future__ import annotations

import dataclasses
import glob
import os
from collections.abc import Sequence
from typing import Any

HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclasses.dataclass(frozen=True)
class Tokens:
    """Encoding as lm-eval's `hf` model does it, for one model.

    `encode(s)` adds the special tokens the model's inputs carry (its tokenizer's own rule for a
    Hugging Face tokenizer: Llama's BOS in front, T5's EOS behind; for a seqio_lite vocabulary
    the model's start token in front of a decoder-only prompt, EOS behind an encoder input, as
    its feature converters build them); `encode(s, False)` adds none.
    """

    backend: Any
    """A seqio_lite `Vocabulary` or a transformers tokenizer."""
    eos_id: int
    bos_id: int
    """lm-eval's `prefix_token_id`: the context of an empty prompt, a rolling window's start."""
    special: str
    """Where the special tokens go for a seqio_lite vocabulary: 'bos', 'eos' or 'none'."""

    @property
    def is_hf(self) -> bool:
        return not hasattr(self.backend, "encode_np")

    def encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        if self.is_hf:
            kw = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
            bos = self.backend.bos_token
            if add_special_tokens is None and bos and text.startswith(bos):
                kw = {"add_special_tokens": False}  # lm-eval: the text already has its BOS
            return list(self.backend.encode(text, **kw))
        ids = list(self.backend.encode(text))
        if add_special_tokens is False:
            return ids
        if self.special == "bos":
            return [self.bos_id, *ids]
        return [*ids, self.eos_id] if self.special == "eos" else ids

    def decode(self, ids: Sequence[int]) -> str:
        if self.is_hf:
            return self.backend.decode(list(ids), skip_special_tokens=True)
        return self.backend.decode([i for i in ids if i != self.eos_id])


def find_tokens(
    model: Any,
    checkpoint_dir: str,
    *,
    tokenizer: str | None = None,
    vocabulary: Any = None,
) -> Tokens:
    """The model's tokens: an explicit HF `tokenizer` folder or seqio_lite `vocabulary`, else the
    HF tokenizer files beside the checkpoint (an import), else the SentencePiece model its run
    directory keeps under `vocabulary/`. ValueError naming where it looked when none is found."""
    encoder_decoder = model.feature_converter_name == "enc_dec"
    if vocabulary is not None:
        return _seqio_tokens(vocabulary, model, encoder_decoder)
    run_dir = os.path.dirname(os.path.abspath(checkpoint_dir.rstrip("/")))
    where = [tokenizer] if tokenizer else [run_dir]
    for folder in where:
        if not os.path.isdir(folder):
            raise ValueError(f"tokenizer folder {folder} does not exist")
        if any(os.path.isfile(os.path.join(folder, f)) for f in HF_TOKENIZER_FILES):
            return _hf_tokens(folder, model)
    models = sorted(glob.glob(os.path.join(run_dir, "vocabulary", "*.model")))
    if not tokenizer and len(models) == 1:
        import seqio_lite

        vocab = seqio_lite.SentencePieceVocabulary(models[0])
        return _seqio_tokens(vocab, model, encoder_decoder)
    raise ValueError(
        f"no vocabulary for {checkpoint_dir}: no Hugging Face tokenizer files "
        f"({', '.join(HF_TOKENIZER_FILES)}) in {where[0]} and "
        f"{'several' if models else 'no'} SentencePiece models in {run_dir}/vocabulary; set "
        "HarnessConfig.tokenizer (a folder of HF tokenizer files) or HarnessConfig.vocabulary"
    )


def _seqio_tokens(vocab: Any, model: Any, encoder_decoder: bool) -> Tokens:
    special = "eos" if encoder_decoder else "bos"
    return Tokens(vocab, model.eos_id, model.decoder_start_token_id, special)


def _hf_tokens(folder: str, model: Any) -> Tokens:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    eos = tok.eos_token_id if tok.eos_token_id is not None else model.eos_id
    # lm-eval's `hf` model: BOS when the tokenizer has one, else EOS.
    bos = tok.bos_token_id if tok.bos_token_id is not None else eos
    return Tokens(tok, int(eos), int(bos), "none")
