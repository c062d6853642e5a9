"""Hugging Face checkpoint interop: local safetensors directories <-> t5lite parameter trees.

Supported architectures (both directions, scanned or unscanned t5lite trees):
  - `T5ForConditionalGeneration` with `feed_forward_proj="gated-gelu"` (T5.1.1, untied logits) or
    `"relu"` with tied embeddings (T5.1.0)  <->  `network.EncoderDecoder` / `T5Config`.
  - `LlamaForCausalLM` (RoPE, SwiGLU, GQA, tied or untied)  <->  `network.DecoderOnly` /
    `DecoderOnlyConfig`.

The output layer is read as the installed transformers (5.x) reads it: tied to the input
embedding where the config asks for it (T5: always) unless the file holds an `lm_head.weight`
that differs from the embedding. Export writes a head that transformers 4.x and 5.x both read
back as the same logits.

Only `config.json` and `*.safetensors` (optionally sharded with `model.safetensors.index.json`) are
read or written; no hub access, no torch, no pickle. Mistakes raise ValueError with one line naming
the file or the parameter.

PyTorch `Linear.weight` is [out, in]; t5lite kernels are [in, out] with heads split out, e.g.
`q.weight` [H*K, D] <-> `query/kernel` [D, H, K] and `o.weight` [D, H*K] <-> `out/kernel` [H, K, D].
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from t5lite.hf import tokens
from t5lite.model import network

Params = dict[str, Any]
_CONFIG = "config.json"
_WEIGHTS = "model.safetensors"
_INDEX = "model.safetensors.index.json"
_HEAD = "lm_head.weight"


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One HF tensor <-> one t5lite leaf."""

    hf_key: str
    path: tuple[str, ...]  # path in the unscanned t5lite `params` tree
    shape: tuple[int, ...]  # t5lite shape
    kind: str  # 'copy' | 'linear' | 'q' (in->heads) | 'o' (heads->out) | 't' (transpose)


def _to_t5lite(x: np.ndarray, e: _Entry) -> np.ndarray:
    """HF tensor -> t5lite layout."""
    if e.kind == "copy":
        return x
    if e.kind in ("linear", "t", "q", "o"):
        return x.T.reshape(e.shape)
    raise AssertionError(e.kind)


def _to_hf(x: np.ndarray, e: _Entry) -> np.ndarray:
    """t5lite leaf -> HF tensor layout (inverse of `_to_t5lite`)."""
    if e.kind == "copy":
        return x
    if e.kind == "q":  # [D, H, K] -> [H*K, D]
        return x.reshape(x.shape[0], -1).T
    if e.kind == "o":  # [H, K, D] -> [D, H*K]
        return x.reshape(-1, x.shape[-1]).T
    return x.T


def _hf_shape(e: _Entry) -> tuple[int, ...]:
    return tuple(_to_hf(np.empty(e.shape, np.int8), e).shape)


# --- T5 -----------------------------------------------------------------------------------------


def _t5_config_from_hf(c: dict[str, Any], where: str, tied: bool) -> network.T5Config:
    proj = c.get("feed_forward_proj", "relu")
    variants = {"relu": "t5.1.0", "gated-gelu": "t5.1.1"}
    if proj not in variants:
        raise ValueError(
            f"{where}: unsupported T5 variant feed_forward_proj={proj!r} (supported: "
            "'relu' = T5 v1.0, 'gated-gelu' = T5.1.1)"
        )
    # transformers 5.x's T5Config: `scale_decoder_outputs` as saved, else (a 4.x file) what 4.x
    # did, scale iff `tie_word_embeddings` is not false. Whether the head is tied follows from
    # the tensors (`_head_is_tied`), not from `tie_word_embeddings`.
    scaled = bool(c.get("scale_decoder_outputs", c.get("tie_word_embeddings", True) is not False))
    if scaled and not tied:
        raise ValueError(
            f"{where}: unsupported T5 variant: untied lm_head with scale_decoder_outputs=true "
            "(lm_head.weight differs from shared.weight while the decoder output is scaled by "
            "d_model**-0.5; supported: tied and scaled = T5 v1.0, tied or untied and unscaled "
            "= T5.1.1)"
        )
    return network.T5Config(
        vocab_size=c["vocab_size"],
        emb_dim=c["d_model"],
        num_heads=c["num_heads"],
        num_encoder_layers=c["num_layers"],
        num_decoder_layers=c.get("num_decoder_layers") or c["num_layers"],
        head_dim=c["d_kv"],
        mlp_dim=c["d_ff"],
        variant=variants[proj],
        tie_logits=tied,
        scale_logits=scaled,
        dropout_rate=c.get("dropout_rate", 0.0),
        relpos_num_buckets=c.get("relative_attention_num_buckets", 32),
        relpos_max_distance=c.get("relative_attention_max_distance", 128),
        layer_norm_epsilon=c.get("layer_norm_epsilon", 1e-6),
    )


def _t5_config_to_hf(cfg: network.T5Config) -> dict[str, Any]:
    return {
        "architectures": ["T5ForConditionalGeneration"],
        "model_type": "t5",
        "vocab_size": cfg.vocab_size,
        "d_model": cfg.emb_dim,
        "d_kv": cfg.head_dim,
        "d_ff": cfg.mlp_dim,
        "num_layers": cfg.num_encoder_layers,
        "num_decoder_layers": cfg.num_decoder_layers,
        "num_heads": cfg.num_heads,
        "relative_attention_num_buckets": cfg.relpos_num_buckets,
        "relative_attention_max_distance": cfg.relpos_max_distance,
        "dropout_rate": cfg.dropout_rate,
        "layer_norm_epsilon": cfg.layer_norm_epsilon,
        "feed_forward_proj": "relu" if cfg.variant == "t5.1.0" else "gated-gelu",
        # NOTE: transformers 4.x ignores `scale_decoder_outputs` and scales iff tied, so a tied
        # unscaled head (5.x's T5.1.1) is written untied, with the embedding as its lm_head:
        # 4.x reads an unscaled untied head, 5.x ties the two (they are equal).
        "tie_word_embeddings": cfg.scale_tied_logits,
        "scale_decoder_outputs": cfg.scale_tied_logits,
        "is_encoder_decoder": True,
        "torch_dtype": cfg.policy.params,
    }


def _attention_entries(
    hf: str, ours: tuple[str, ...], d: int, h: int, g: int, k: int, names: tuple[str, ...]
) -> Iterator[_Entry]:
    q, kk, v, o = names
    yield _Entry(f"{hf}.{q}.weight", (*ours, "query", "kernel"), (d, h, k), "q")
    yield _Entry(f"{hf}.{kk}.weight", (*ours, "key", "kernel"), (d, g, k), "q")
    yield _Entry(f"{hf}.{v}.weight", (*ours, "value", "kernel"), (d, g, k), "q")
    yield _Entry(f"{hf}.{o}.weight", (*ours, "out", "kernel"), (h, k, d), "o")


def _mlp_entries(
    hf: str, ours: tuple[str, ...], d: int, f: int, names: tuple[str, ...]
) -> Iterator[_Entry]:
    *wis, wo = names
    ours_wi = ["wi"] if len(wis) == 1 else [f"wi_{i}" for i in range(len(wis))]
    for hf_name, our_name in zip(wis, ours_wi):
        yield _Entry(f"{hf}.{hf_name}.weight", (*ours, "mlp", our_name, "kernel"), (d, f), "t")
    yield _Entry(f"{hf}.{wo}.weight", (*ours, "mlp", "wo", "kernel"), (f, d), "t")


def _t5_entries(cfg: network.T5Config) -> list[_Entry]:
    d, h, k, f, n = cfg.emb_dim, cfg.num_heads, cfg.head_dim, cfg.mlp_dim, cfg.relpos_num_buckets
    qkvo = ("q", "k", "v", "o")
    mlp = ("wi", "wo") if cfg.variant == "t5.1.0" else ("wi_0", "wi_1", "wo")
    out = [_Entry("shared.weight", ("token_embedder", "embedding"), (cfg.vocab_size, d), "copy")]
    for stack, n_layers in (
        ("encoder", cfg.num_encoder_layers),
        ("decoder", cfg.num_decoder_layers),
    ):
        out.append(
            _Entry(
                f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                (stack, "relpos_bias", "rel_embedding"),
                (h, n),
                "t",
            )
        )
        for i in range(n_layers):
            hf, ours = f"{stack}.block.{i}.layer", (stack, f"layers_{i}")
            self_attn = "attention" if stack == "encoder" else "self_attention"
            self_norm = f"pre_{self_attn}_layer_norm"
            out.append(
                _Entry(f"{hf}.0.layer_norm.weight", (*ours, self_norm, "scale"), (d,), "copy")
            )
            out += _attention_entries(f"{hf}.0.SelfAttention", (*ours, self_attn), d, h, h, k, qkvo)
            m = 1
            if stack == "decoder":
                out.append(
                    _Entry(
                        f"{hf}.1.layer_norm.weight",
                        (*ours, "pre_cross_attention_layer_norm", "scale"),
                        (d,),
                        "copy",
                    )
                )
                out += _attention_entries(
                    f"{hf}.1.EncDecAttention",
                    (*ours, "encoder_decoder_attention"),
                    d,
                    h,
                    h,
                    k,
                    qkvo,
                )
                m = 2
            out.append(
                _Entry(
                    f"{hf}.{m}.layer_norm.weight",
                    (*ours, "pre_mlp_layer_norm", "scale"),
                    (d,),
                    "copy",
                )
            )
            out += _mlp_entries(f"{hf}.{m}.DenseReluDense", ours, d, f, mlp)
        norm = f"{stack}_norm"
        out.append(_Entry(f"{stack}.final_layer_norm.weight", (stack, norm, "scale"), (d,), "copy"))
    if not cfg.logits_via_embedding:
        out.append(_Entry(_HEAD, ("decoder", "logits_dense", "kernel"), (d, cfg.vocab_size), "t"))
    return out


# --- Llama --------------------------------------------------------------------------------------


def _llama_config_from_hf(c: dict[str, Any], where: str, tied: bool) -> network.DecoderOnlyConfig:
    if c.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: unsupported Llama hidden_act={c['hidden_act']!r} (want 'silu')")
    if c.get("attention_bias") or c.get("mlp_bias"):
        raise ValueError(f"{where}: Llama attention_bias/mlp_bias are not supported")
    heads = c["num_attention_heads"]
    return network.DecoderOnlyConfig(
        vocab_size=c["vocab_size"],
        emb_dim=c["hidden_size"],
        num_heads=heads,
        num_kv_heads=c.get("num_key_value_heads") or heads,
        num_layers=c["num_hidden_layers"],
        head_dim=c.get("head_dim") or c["hidden_size"] // heads,
        mlp_dim=c["intermediate_size"],
        mlp_activation="silu",
        position_embedding="rope",
        **_rope_from_hf(c, where),
        logits_via_embedding=tied,
        scale_attn_logits=True,
        layer_norm_epsilon=c.get("rms_norm_eps", 1e-6),
    )


def _rope_from_hf(c: dict[str, Any], where: str) -> dict[str, Any]:
    """DecoderOnlyConfig RoPE fields from HF `rope_parameters` (5.x) or `rope_scaling` (4.x)."""
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    theta = rope.get("rope_theta") or c.get("rope_theta") or 10000.0  # 5.x: in rope_parameters
    out: dict[str, Any] = {"rope_theta": float(theta)}
    if rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"{where}: partial_rotary_factor != 1 is not supported")
    if kind == "dynamic":
        # NOTE: transformers recomputes dynamic-NTK frequencies from each call's length and
        # keeps them in module state, so cached decoding depends on the call history.
        raise ValueError(
            f"{where}: unsupported RoPE scaling type 'dynamic' (its frequencies depend on the "
            "length of each call; supported: default, linear, llama3)"
        )
    if kind not in ("default", "linear", "llama3"):
        raise ValueError(
            f"{where}: unsupported RoPE scaling type {kind!r} (supported: default, linear, llama3)"
        )
    if kind == "default":
        return out

    def need(key: str, default: Any = None) -> Any:
        if rope.get(key, default) is None:
            raise ValueError(f"{where}: RoPE scaling type {kind!r} needs {key!r}")
        return rope.get(key, default)

    out.update(rope_scaling=kind, rope_scaling_factor=float(need("factor")))
    if kind == "llama3":
        out.update(
            rope_low_freq_factor=float(need("low_freq_factor")),
            rope_high_freq_factor=float(need("high_freq_factor")),
            rope_original_max_position=int(
                need("original_max_position_embeddings", c.get("max_position_embeddings"))
            ),
        )
    return out


def _rope_to_hf(cfg: network.DecoderOnlyConfig) -> dict[str, Any]:
    kind = "default" if cfg.rope_scaling == "none" else cfg.rope_scaling
    rope: dict[str, Any] = {"rope_type": kind, "rope_theta": cfg.rope_theta}
    if kind != "default":
        rope["factor"] = cfg.rope_scaling_factor
    if kind == "llama3":
        rope.update(
            low_freq_factor=cfg.rope_low_freq_factor,
            high_freq_factor=cfg.rope_high_freq_factor,
            original_max_position_embeddings=cfg.rope_original_max_position,
        )
    # 5.x reads `rope_parameters`, 4.x `rope_scaling` (None when unscaled) and `rope_theta`.
    legacy = None if kind == "default" else {k: v for k, v in rope.items() if k != "rope_theta"}
    return {"rope_theta": cfg.rope_theta, "rope_parameters": rope, "rope_scaling": legacy}


def _llama_config_to_hf(cfg: network.DecoderOnlyConfig) -> dict[str, Any]:
    if not (cfg.use_rope and cfg.mlp_activation == "silu" and cfg.scale_attn_logits):
        raise ValueError(
            "export_hf: a DecoderOnlyConfig maps to LlamaForCausalLM only with "
            "position_embedding='rope', mlp_activation='silu', scale_attn_logits=True; got "
            f"{cfg.position_embedding!r}, {cfg.mlp_activation!r}, {cfg.scale_attn_logits}"
        )
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.emb_dim,
        "intermediate_size": cfg.mlp_dim,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.layer_norm_epsilon,
        **_rope_to_hf(cfg),
        "tie_word_embeddings": cfg.logits_via_embedding,
        "attention_bias": False,
        "mlp_bias": False,
        "max_position_embeddings": 4096,
        "torch_dtype": cfg.policy.params,
    }


def _llama_entries(cfg: network.DecoderOnlyConfig) -> list[_Entry]:
    d, h, g, k, f = cfg.emb_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
    out = [
        _Entry(
            "model.embed_tokens.weight",
            ("token_embedder", "embedding"),
            (cfg.vocab_size, d),
            "copy",
        )
    ]
    names = ("q_proj", "k_proj", "v_proj", "o_proj")
    for i in range(cfg.num_layers):
        hf, ours = f"model.layers.{i}", ("decoder", f"layers_{i}")
        out.append(
            _Entry(
                f"{hf}.input_layernorm.weight",
                (*ours, "pre_self_attention_layer_norm", "scale"),
                (d,),
                "copy",
            )
        )
        out += _attention_entries(f"{hf}.self_attn", (*ours, "self_attention"), d, h, g, k, names)
        out.append(
            _Entry(
                f"{hf}.post_attention_layernorm.weight",
                (*ours, "pre_mlp_layer_norm", "scale"),
                (d,),
                "copy",
            )
        )
        out += _mlp_entries(f"{hf}.mlp", ours, d, f, ("gate_proj", "up_proj", "down_proj"))
    out.append(_Entry("model.norm.weight", ("decoder", "decoder_norm", "scale"), (d,), "copy"))
    if not cfg.logits_via_embedding:
        out.append(_Entry(_HEAD, ("decoder", "logits_dense", "kernel"), (d, cfg.vocab_size), "t"))
    return out


@dataclasses.dataclass(frozen=True)
class _Arch:
    """One supported HF architecture: its config and tensor mapping, and how it ties."""

    config_from_hf: Callable[[dict[str, Any], str, bool], Any]
    entries: Callable[[Any], list[_Entry]]
    embedding_keys: tuple[str, ...]
    """Where the input embedding may be stored, in the order transformers looks for it."""
    always_tied: bool
    """transformers 5.x ties this architecture whatever `tie_word_embeddings` says."""


_ARCHITECTURES: dict[str, _Arch] = {
    "T5ForConditionalGeneration": _Arch(
        _t5_config_from_hf,
        _t5_entries,
        ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight"),
        # NOTE: 5.x's T5Config sets tie_word_embeddings=True whatever the file says.
        always_tied=True,
    ),
    "LlamaForCausalLM": _Arch(
        _llama_config_from_hf, _llama_entries, ("model.embed_tokens.weight",), always_tied=False
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
    for e in spec.entries(cfg):
        keys = embedding_keys if e.hf_key == spec.embedding_keys[0] else [e.hf_key]
        x = next((x for x in map(get, keys) if x is not None), None)
        if x is None:
            raise ValueError(f"{hf_dir}: tensor {e.hf_key!r} missing from the checkpoint")
        if tuple(x.shape) != _hf_shape(e):
            raise ValueError(
                f"{hf_dir}: tensor {e.hf_key!r} has shape {tuple(x.shape)}, config.json implies "
                f"{_hf_shape(e)}"
            )
        _set(params, e.path, jnp.asarray(_to_t5lite(x, e), dtype=cfg.policy.master))
    if arch == "T5ForConditionalGeneration":
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
      config: the network config; T5Config -> T5ForConditionalGeneration, DecoderOnlyConfig ->
        LlamaForCausalLM (RoPE + SiLU only).
      params: the `params` collection, scanned or unscanned (unboxed arrays).
      out_dir: created if needed; existing `config.json` / `model.safetensors` are replaced.
      ids: the model's pad / EOS / decoder-start (BOS) ids, written to `config.json`.
      hf_ids: the HF ids the model was imported with, written back as they were (an unset
        pad, a list of EOS ids) while `ids` still follow from them.

    Raises:
      ValueError: a config with no HF equivalent, or a missing or misshaped parameter.
    """
    from safetensors.numpy import save_file

    if isinstance(config, network.T5Config):
        hf_config, entries = _t5_config_to_hf(config), _t5_entries(config)
    elif isinstance(config, network.DecoderOnlyConfig):
        hf_config, entries = _llama_config_to_hf(config), _llama_entries(config)
    else:
        raise ValueError(f"export_hf: unsupported config type {type(config).__name__}")
    hf_config.update(tokens.hf_config_ids(ids, isinstance(config, network.T5Config), hf_ids))
    params = network.unscan_params(params)
    tensors: dict[str, np.ndarray] = {}
    for e in entries:
        x = _get(params, e.path)
        if tuple(x.shape) != e.shape:
            raise ValueError(
                f"export_hf: parameter {'/'.join(e.path)} has shape {tuple(x.shape)}, the config "
                f"implies {e.shape}"
            )
        # NOTE: written as fp32 (numpy has no bfloat16); `torch_dtype` records the model's dtype.
        tensors[e.hf_key] = np.ascontiguousarray(_to_hf(np.asarray(x, np.float32), e))
    if isinstance(config, network.T5Config):
        # Written out as well so that loaders which do not re-tie them still share one table.
        for key in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight"):
            tensors[key] = tensors["shared.weight"].copy()
        if config.logits_via_embedding and not config.scale_tied_logits:
            tensors[_HEAD] = tensors["shared.weight"].copy()  # see `_t5_config_to_hf`
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / _WEIGHTS), metadata={"format": "pt"})
    (out_dir / _CONFIG).write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
