"""Hugging Face checkpoint interop: local safetensors directories <-> t5lite parameter trees.

Supported architectures (both directions, scanned or unscanned t5lite trees):
  - `T5ForConditionalGeneration` with `feed_forward_proj="gated-gelu"` (T5.1.1, untied logits) or
    `"relu"` with tied embeddings (T5.1.0)  <->  `network.EncoderDecoder` / `T5Config`.
  - `SwitchTransformersForConditionalGeneration` (T5.1.0 layers, top-1 capacity-based experts in
    every layer or every other one)  <->  `T5Config` with `num_experts > 0`.
  - `LlamaForCausalLM` (RoPE, SwiGLU, GQA, tied or untied)  <->  `network.DecoderOnly` /
    `DecoderOnlyConfig`.
  - `MixtralForCausalLM` (Llama layers, top-k dropless SwiGLU experts)  <->  `DecoderOnlyConfig`
    with `num_experts > 0`.
The mappings live in `t5_family` and `llama_family`, the tensor layouts in `layout`.

The output layer is read as the installed transformers (5.x) reads it: tied to the input
embedding where the config asks for it (T5: always) unless the file holds an `lm_head.weight`
that differs from the embedding. Export writes a head that transformers 4.x and 5.x both read
back as the same logits.

Only `config.json` and `*.safetensors` (optionally sharded with `model.safetensors.index.json`) are
read or written; no hub access, no torch, no pickle. Mistakes raise ValueError with one line naming
the file or the parameter.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from t5lite.hf import llama_family, t5_family, tokens
from t5lite.hf.layout import Entry, hf_shape, to_hf, to_t5lite
from t5lite.model import network

Params = dict[str, Any]
_CONFIG = "config.json"
_WEIGHTS = "model.safetensors"
_INDEX = "model.safetensors.index.json"
_HEAD = "lm_head.weight"
_t5_config_to_hf = t5_family.config_to_hf  # benchmarks/decode.py reads a T5 config.json's fields


@dataclasses.dataclass(frozen=True)
class _Arch:
    """One supported HF architecture: its config and tensor mapping, and how it ties."""

    config_from_hf: Callable[[dict[str, Any], str, bool], Any]
    entries: Callable[[Any], list[Entry]]
    embedding_keys: tuple[str, ...]
    """Where the input embedding may be stored, in the order transformers looks for it."""
    always_tied: bool
    """transformers 5.x ties this architecture whatever `tie_word_embeddings` says."""


_T5_EMBEDDINGS = ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
_ARCHITECTURES: dict[str, _Arch] = {
    # NOTE: 5.x's T5Config sets tie_word_embeddings=True whatever the file says.
    "T5ForConditionalGeneration": _Arch(
        t5_family.config_from_hf, t5_family.entries, _T5_EMBEDDINGS, always_tied=True
    ),
    t5_family.SWITCH: _Arch(
        t5_family.switch_config_from_hf, t5_family.entries, _T5_EMBEDDINGS, always_tied=False
    ),
    "LlamaForCausalLM": _Arch(
        llama_family.config_from_hf,
        llama_family.entries,
        ("model.embed_tokens.weight",),
        always_tied=False,
    ),
    llama_family.MIXTRAL: _Arch(
        llama_family.mixtral_config_from_hf,
        llama_family.entries,
        ("model.embed_tokens.weight",),
        always_tied=False,
    ),
}


def _head_is_tied(raw: dict[str, Any], arch: _Arch, get: Callable[[str], Any]) -> bool:
    """transformers 5.x's `tie_weights` on load: where the config asks for tying, the head is
    tied to the input embedding unless both tensors are in the file with different values
    (then 5.x warns and keeps the file's head). 4.x tied whenever the config asked, dropping
    a saved head; its own files never hold a different one."""
    if not (arch.always_tied or raw.get("tie_word_embeddings", False)):
        return False
    head = get(_HEAD)
    if head is None:
        return True
    embedding = next((x for x in map(get, arch.embedding_keys) if x is not None), None)
    return embedding is None or (head.shape == embedding.shape and np.array_equal(head, embedding))


# --- safetensors I/O ----------------------------------------------------------------------------


def _read_tensors(hf_dir: Path) -> Callable[[str], np.ndarray | None]:
    """Returns a lookup `hf_key -> array (or None)` over the (possibly sharded) safetensors."""
    from safetensors import safe_open

    index = hf_dir / _INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    elif (hf_dir / _WEIGHTS).is_file():
        files = [_WEIGHTS]
    else:
        raise ValueError(f"{hf_dir}: no {_WEIGHTS} or {_INDEX} (only safetensors are read)")
    key_to_file: dict[str, Path] = {}
    for name in files:
        path = hf_dir / name
        if not path.is_file():
            raise ValueError(f"{path}: listed in {_INDEX} but missing")
        with safe_open(str(path), framework="flax") as fh:
            for key in fh.keys():  # noqa: SIM118  (safe_open is not a mapping)
                key_to_file[key] = path

    def get(key: str) -> np.ndarray | None:
        if key not in key_to_file:
            return None
        with safe_open(str(key_to_file[key]), framework="flax") as fh:
            return np.asarray(fh.get_tensor(key).astype(jnp.float32))

    return get


def _set(tree: Params, path: tuple[str, ...], value: Any) -> None:
    for p in path[:-1]:
        tree = tree.setdefault(p, {})
    tree[path[-1]] = value


def _get(tree: Params, path: tuple[str, ...]) -> Any:
    for p in path:
        if not isinstance(tree, dict) or p not in tree:
            raise ValueError(f"export_hf: parameter {'/'.join(path)} missing from the params tree")
        tree = tree[p]
    return tree


# --- public API ---------------------------------------------------------------------------------


def import_hf(
    hf_dir: str | Path,
    *,
    scan_layers: bool = False,
    precision: str = "float32",
) -> tuple[network.T5Config | network.DecoderOnlyConfig, Params]:
    """Reads a local Hugging Face checkpoint directory into a t5lite config and parameter tree.

    Args:
      hf_dir: directory with `config.json` and `model.safetensors` (or a sharded index).
      scan_layers: return the stacked `layers` tree for a `scan_layers=True` network.
      precision: the returned config's precision policy; the parameters come back in its
        `master` dtype (what a train state stores).

    Returns:
      `(config, params)`: `network.T5Config` or `network.DecoderOnlyConfig`, and the `params`
      collection (nested dicts of jax arrays) for `model.apply({'params': params}, ...)`.

    Raises:
      ValueError: missing files, an unsupported architecture, or a missing or misshaped tensor.
    """
    hf_dir = Path(hf_dir)
    cfg_path = hf_dir / _CONFIG
    if not cfg_path.is_file():
        raise ValueError(f"{cfg_path}: not found (expected a Hugging Face checkpoint directory)")
    raw = json.loads(cfg_path.read_text())
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in _ARCHITECTURES), None)
    if arch is None:
        raise ValueError(
            f"{cfg_path}: unsupported architectures {archs}; supported: {sorted(_ARCHITECTURES)}"
        )
    spec = _ARCHITECTURES[arch]
    get = _read_tensors(hf_dir)
    tied = _head_is_tied(raw, spec, get)
    cfg = spec.config_from_hf(raw, str(cfg_path), tied)
    cfg = dataclasses.replace(cfg, scan_layers=scan_layers, precision=precision)
    # A tied head may be the only copy of the embedding (5.x then ties the other way round).
    embedding_keys = [*spec.embedding_keys, *([_HEAD] if tied else [])]
    params: Params = {}
    experts: dict[tuple[str, ...], dict[int, np.ndarray]] = {}  # stacked leaves, by expert
    for e in spec.entries(cfg):
        keys = embedding_keys if e.hf_key == spec.embedding_keys[0] else [e.hf_key]
        x = next((x for x in map(get, keys) if x is not None), None)
        if x is None:
            raise ValueError(f"{hf_dir}: tensor {e.hf_key!r} missing from the checkpoint")
        if tuple(x.shape) != hf_shape(e):
            raise ValueError(
                f"{hf_dir}: tensor {e.hf_key!r} has shape {tuple(x.shape)}, config.json implies "
                f"{hf_shape(e)}"
            )
        if e.expert is None:
            _set(params, e.path, jnp.asarray(to_t5lite(x, e), dtype=cfg.policy.master))
        else:
            experts.setdefault(e.path, {})[e.expert[0]] = to_t5lite(x, e)
    for path, by_expert in experts.items():
        stacked = np.stack([by_expert[j] for j in sorted(by_expert)])
        _set(params, path, jnp.asarray(stacked, dtype=cfg.policy.master))
    if spec.embedding_keys == _T5_EMBEDDINGS:
        shared = np.asarray(params["token_embedder"]["embedding"])
        for key in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight"):
            x = get(key)
            if x is not None and not np.array_equal(x, shared):
                raise ValueError(
                    f"{hf_dir}: tensor {key!r} differs from 'shared.weight' (T5 "
                    "shares one input embedding)"
                )
    return cfg, (network.scan_params(params) if scan_layers else params)


def export_hf(
    config: network.T5Config | network.DecoderOnlyConfig,
    params: Params,
    out_dir: str | Path,
    ids: tokens.ModelIds = tokens.ModelIds(),  # noqa: B008  (frozen)
    hf_ids: Mapping[str, Any] | None = None,
) -> None:
    """Writes `params` as a Hugging Face checkpoint (`config.json` + `model.safetensors`).

    Args:
      config: the network config; T5Config -> T5ForConditionalGeneration (with experts:
        SwitchTransformersForConditionalGeneration), DecoderOnlyConfig -> LlamaForCausalLM (with
        experts: MixtralForCausalLM; RoPE + SiLU only).
      params: the `params` collection, scanned or unscanned (unboxed arrays).
      out_dir: created if needed; existing `config.json` / `model.safetensors` are replaced.
      ids: the model's pad / EOS / decoder-start (BOS) ids, written to `config.json`.
      hf_ids: the HF ids the model was imported with, written back as they were (an unset
        pad, a list of EOS ids) while `ids` still follow from them.

    Raises:
      ValueError: a config with no HF equivalent, or a missing or misshaped parameter.
    """
    from safetensors.numpy import save_file

    moe = getattr(config, "num_experts", 0) > 0
    if isinstance(config, network.T5Config):
        to_config = t5_family.switch_config_to_hf if moe else t5_family.config_to_hf
        hf_config, entries = to_config(config), t5_family.entries(config)
    elif isinstance(config, network.DecoderOnlyConfig):
        to_config = llama_family.mixtral_config_to_hf if moe else llama_family.config_to_hf
        hf_config, entries = to_config(config), llama_family.entries(config)
    else:
        raise ValueError(f"export_hf: unsupported config type {type(config).__name__}")
    hf_config.update(tokens.hf_config_ids(ids, isinstance(config, network.T5Config), hf_ids))
    params = network.unscan_params(params)
    tensors: dict[str, np.ndarray] = {}
    for e in entries:
        x = _get(params, e.path)
        if tuple(x.shape) != e.leaf_shape:
            raise ValueError(
                f"export_hf: parameter {'/'.join(e.path)} has shape {tuple(x.shape)}, the config "
                f"implies {e.leaf_shape}"
            )
        x = np.asarray(x if e.expert is None else x[e.expert[0]], np.float32)
        # NOTE: written as fp32 (numpy has no bfloat16); `torch_dtype` records the model's dtype.
        tensors[e.hf_key] = np.ascontiguousarray(to_hf(x, e))
    if isinstance(config, network.T5Config):
        # Written out as well so that loaders which do not re-tie them still share one table.
        for key in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight"):
            tensors[key] = tensors["shared.weight"].copy()
        if config.logits_via_embedding and not config.scale_tied_logits:
            tensors[_HEAD] = tensors["shared.weight"].copy()  # see `t5_family.config_to_hf`
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / _WEIGHTS), metadata={"format": "pt"})
    (out_dir / _CONFIG).write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
