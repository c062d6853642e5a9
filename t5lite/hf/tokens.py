"""Special token ids and tokenizer files of Hugging Face checkpoints.

HF keeps the ids in `config.json` (and `generation_config.json`) as `pad_token_id`,
`eos_token_id`, `bos_token_id`, `decoder_start_token_id`; a t5lite model holds them as
`BaseModel.pad_id`, `eos_id`, `decoder_start_token_id` (the first decoder input: T5's start token,
a decoder-only LM's BOS). `t5lite convert` carries them both ways and copies the tokenizer files.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

HF_ID_KEYS = ("pad_token_id", "eos_token_id", "bos_token_id", "decoder_start_token_id")
TOKENIZER_FILES = (
    "spiece.model",  # T5's SentencePiece model
    "tokenizer.model",  # Llama 1/2's SentencePiece model
    "tokenizer.json",  # the `tokenizers` serialization (any model)
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
)
_T5_EXTRA_IDS = 100  # HF's T5Tokenizer default: <extra_id_0..99> above the pieces


@dataclasses.dataclass(frozen=True)
class ModelIds:
    """The ids a t5lite model decodes with (defaults: t5x/T5's)."""

    pad_id: int = 0
    eos_id: int = 1
    decoder_start_token_id: int = 0


def read_hf_ids(hf_dir: str | Path) -> dict[str, Any]:
    """The HF special ids: `config.json`, else `generation_config.json` (transformers 5.x keeps
    T5's `decoder_start_token_id` only there, if anywhere). Missing ids are None."""
    hf_dir = Path(hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    gen_path = hf_dir / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    return {k: config[k] if config.get(k) is not None else gen.get(k) for k in HF_ID_KEYS}


def model_ids(hf_ids: Mapping[str, Any], encoder_decoder: bool) -> tuple[ModelIds, list[str]]:
    """t5lite ids for HF ids, and notes (gin comments) on what could not be kept as is."""
    notes: list[str] = []
    eos = hf_ids.get("eos_token_id")
    if isinstance(eos, list):
        if len(eos) > 1:
            notes.append(f"HF eos_token_id is {eos}: t5lite stops at one id, the first")
        eos = eos[0] if eos else None
    if eos is None:
        notes.append("HF eos_token_id is not set: t5lite's default 1 is used")
        eos = ModelIds.eos_id
    pad = hf_ids.get("pad_token_id")
    if pad is None:
        notes.append("HF pad_token_id is not set: t5lite pads (and fills after EOS) with 0")
        pad = ModelIds.pad_id
    # T5 starts decoding from decoder_start_token_id (HF: "usually the pad token"); a causal LM
    # from BOS, which HF's tokenizer puts in front of the prompt.
    order = ("decoder_start_token_id", "bos_token_id")
    start = next(
        (
            hf_ids.get(k)
            for k in (order if encoder_decoder else order[::-1])
            if hf_ids.get(k) is not None
        ),
        pad,
    )
    return ModelIds(int(pad), int(eos), int(start)), notes


def hf_config_ids(
    ids: ModelIds, encoder_decoder: bool, original: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The `config.json` id fields for a t5lite model's ids (inverse of `model_ids`).

    `original`: the HF ids the model was imported with (`read_hf_ids`). While the model's ids
    are still the ones imported from them, they are written back as they were: an unset pad
    stays unset (not 0) and a list of EOS ids stays a list (not its first).
    """
    out: dict[str, Any] = {"pad_token_id": ids.pad_id, "eos_token_id": ids.eos_id}
    start = "decoder_start_token_id" if encoder_decoder else "bos_token_id"
    out[start] = ids.decoder_start_token_id
    if original is not None and model_ids(original, encoder_decoder)[0] == ids:
        out = {k: original.get(k, v) for k, v in out.items()}
    return out


def copy_tokenizer_files(hf_dir: str | Path, out_dir: str | Path) -> list[str]:
    """Copies the tokenizer files present in `hf_dir` into `out_dir`; returns their names."""
    copied = []
    for name in TOKENIZER_FILES:
        src = Path(hf_dir) / name
        if src.is_file():
            shutil.copyfile(src, Path(out_dir) / name)
            copied.append(name)
    return copied


def vocabulary_gin(out_dir: str | Path, copied: list[str], encoder_decoder: bool) -> list[str]:
    """Gin lines (bindings or comments) that say how to use the copied tokenizer in a task."""
    out_dir = Path(out_dir).resolve()
    if not copied:
        return ["# No tokenizer files in the Hugging Face directory: bring your own vocabulary."]
    lines = [f"# Tokenizer files copied from the Hugging Face directory: {', '.join(copied)}."]
    sp_name = next((n for n in ("spiece.model", "tokenizer.model") if n in copied), None)
    if sp_name is None:
        return [
            *lines,
            "# seqio_lite reads SentencePiece models only; tokenizer.json is kept "
            "for transformers.",
        ]
    why_not = _sentencepiece_incompatible(out_dir / sp_name)
    if why_not:
        return [*lines, f"# {sp_name} is not usable as a seqio_lite vocabulary: {why_not}."]
    extra_ids = _extra_ids(out_dir, encoder_decoder)
    return [
        *lines,
        f"# {sp_name} + {extra_ids} sentinels gives the ids of the HF tokenizer; as a task's",
        "# vocabulary: `JsonlTask.vocabulary = %HF_VOCABULARY` (any task kind).",
        # Module-qualified: a process that also read a t5x gin file (`import seqio`, the
        # stand-in) knows the short name twice, and gin refuses an ambiguous selector.
        "HF_VOCABULARY = @hf/seqio_lite.SentencePieceVocabulary()",
        f"hf/seqio_lite.SentencePieceVocabulary.model_file = {str(out_dir / sp_name)!r}",
        f"hf/seqio_lite.SentencePieceVocabulary.extra_ids = {extra_ids}",
    ]


def _extra_ids(out_dir: Path, encoder_decoder: bool) -> int:
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    return int(cfg.get("extra_ids", _T5_EXTRA_IDS if encoder_decoder else 0))


def _sentencepiece_incompatible(model_file: Path) -> str | None:
    """Why seqio_lite's SentencePieceVocabulary would refuse `model_file` (None: it would not)."""
    try:
        import sentencepiece as spm
    except ImportError:
        return "the sentencepiece package is not installed"
    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    if (sp.pad_id(), sp.eos_id()) != (0, 1):
        # NOTE: seqio_lite (as seqio) fixes pad 0 / eos 1; Llama's model has eos 2 and no pad.
        return f"it has pad_id={sp.pad_id()}, eos_id={sp.eos_id()} (seqio_lite needs 0 and 1)"
    return None
