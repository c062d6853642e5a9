"""Every way transformers saves a checkpoint's output layer, through `t5lite convert` and back.

The reference is always what transformers itself reads from the saved directory
(`from_pretrained`). Each case saves a random small model in one save style (a 4.x-style or a
5.x-style `config.json`; the head tied, untied, tied with an equal copy saved, or marked tied but
saved with a different head) and checks: the logits of `t5lite convert --direction=import` equal
transformers'; the export of that import reads back in transformers (and by 4.x's rule) with the
same logits; and the export re-imports as the same network config.

transformers' rules (installed 5.x: `PreTrainedModel.tie_weights` on load; 4.x:
`_tie_or_clone_weights` after load):
  - 5.x ties where the config asks (`tie_word_embeddings`; T5Config forces it to true) unless
    `lm_head.weight` is in the file with values that differ from the embedding: then it warns and
    keeps the file's head. 4.x ties whenever `tie_word_embeddings` is true.
  - T5 scales the decoder output by d_model**-0.5: 5.x iff `scale_decoder_outputs` (when absent:
    `tie_word_embeddings` is not false); 4.x iff `tie_word_embeddings`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5lite.checkpoint import restore_checkpoint
from t5lite.hf import convert
from t5lite.model import network
from t5lite.model.config import config_from_record

torch = pytest.importorskip("torch", reason="needs the [hf] extra (torch==2.13.0)")
transformers = pytest.importorskip("transformers", reason="needs the [hf] extra (transformers)")
safetensors_numpy = pytest.importorskip("safetensors.numpy", reason="needs the [hf] extra")

import hf_models  # noqa: E402

TOL = 1e-4  # as test_hf_parity: max |logits_t5lite - logits_transformers|, fp32
V = 96
HEAD = "lm_head.weight"


# --- models -----------------------------------------------------------------------------------


def _t5(proj: str, *, untie: bool) -> torch.nn.Module:
    """A random small T5; `untie`: its lm_head is a parameter of its own (set after the
    constructor, which 5.x forces to tie), the input embedding stays shared."""
    kw = {"tie_word_embeddings": False} if proj == "gated-gelu" else {}
    cfg = hf_models.t5_config(vocab_size=V, num_decoder_layers=3, feed_forward_proj=proj, **kw)
    model = hf_models.build(transformers.T5ForConditionalGeneration, cfg)
    if untie:
        model.lm_head.weight = torch.nn.Parameter(torch.randn(V, 32) * 0.5)
    return model


def _llama(*, tie: bool, untie: bool = False) -> torch.nn.Module:
    cfg = hf_models.llama_config(vocab_size=V, tie_word_embeddings=tie)
    model = hf_models.build(transformers.LlamaForCausalLM, cfg)
    if untie:
        model.lm_head.weight = torch.nn.Parameter(torch.randn(V, 32) * 0.5)
    return model


# --- save styles ----------------------------------------------------------------------------


def _save_5x(model: torch.nn.Module, path: Path) -> None:
    model.save_pretrained(path)


def _save_5x_resaved(model: torch.nn.Module, path: Path) -> None:
    """A 4.x-style untied file loaded and saved again by 5.x: 5.x's T5Config turns
    `tie_word_embeddings` to true, and the separate head is saved beside it."""
    legacy = path.with_name(path.name + "-4.x")
    _save_4x(model, legacy, tie=False)
    transformers.T5ForConditionalGeneration.from_pretrained(legacy).save_pretrained(path)


def _save_4x(model: torch.nn.Module, path: Path, tie: bool) -> None:
    """What transformers 4.x writes: no `scale_decoder_outputs` / `rope_parameters`, its
    `tie_word_embeddings`, and only the first of the tensors that share storage."""
    path.mkdir(parents=True)
    tensors, seen = {}, set()
    for k, v in model.state_dict(keep_vars=True).items():
        if v.data_ptr() not in seen:
            seen.add(v.data_ptr())
            tensors[k] = v.detach().numpy().copy()
    safetensors_numpy.save_file(tensors, str(path / "model.safetensors"), {"format": "pt"})
    raw = model.config.to_dict()
    raw.pop("scale_decoder_outputs", None)
    if "rope_parameters" in raw:
        raw["rope_theta"] = raw.pop("rope_parameters")["rope_theta"]
        raw["rope_scaling"] = None
    raw.update(
        architectures=[type(model).__name__],
        tie_word_embeddings=tie,
        transformers_version="4.46.0",
    )
    (path / "config.json").write_text(json.dumps(raw))


def _with_tensor(path: Path, key: str, value: np.ndarray) -> None:
    """Adds one tensor to a saved file (as a converted `.bin` holds both tied copies)."""
    tensors = safetensors_numpy.load_file(path / "model.safetensors")
    safetensors_numpy.save_file({**tensors, key: value}, str(path / "model.safetensors"))


def _edit_config(path: Path, **changes) -> None:
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, **changes}))


@dataclasses.dataclass(frozen=True)
class Case:
    """A save style: `save(path)` writes the checkpoint; transformers reads it with `head`
    ('tied' or 'untied') and `scaled` decoder outputs (T5)."""

    save: object
    head: str
    scaled: bool = False


def _case_t5_11_tied_5x(p):  # what 5.x writes for T5.1.1 built as usual
    _save_5x(_t5("gated-gelu", untie=False), p)


def _case_t5_11_untied_5x_resaved(p):  # the bug: tie_word_embeddings true, a trained head
    _save_5x_resaved(_t5("gated-gelu", untie=True), p)


def _case_t5_11_untied_5x_config_false(p):
    m = _t5("gated-gelu", untie=True)
    m.config.tie_word_embeddings = False
    _save_5x(m, p)


def _case_t5_11_untied_4x(p):
    _save_4x(_t5("gated-gelu", untie=True), p, tie=False)


def _case_t5_11_tied_equal_head_5x(p):
    m = _t5("gated-gelu", untie=False)
    _save_5x(m, p)
    _with_tensor(p, HEAD, m.shared.weight.detach().numpy().copy())


def _case_t5_11_tied_scaled_4x(p):  # gated-GELU with 4.x's tied (hence scaled) head
    _save_4x(_t5("gated-gelu", untie=False), p, tie=True)


def _case_t5_10_tied_5x(p):
    _save_5x(_t5("relu", untie=False), p)


def _case_t5_10_tied_4x(p):
    _save_4x(_t5("relu", untie=False), p, tie=True)


def _case_t5_10_tied_equal_head_4x(p):
    m = _t5("relu", untie=False)
    _save_4x(m, p, tie=True)
    _with_tensor(p, HEAD, m.shared.weight.detach().numpy().copy())


def _case_llama_untied_5x(p):
    _save_5x(_llama(tie=False), p)


def _case_llama_untied_4x(p):
    _save_4x(_llama(tie=False), p, tie=False)


def _case_llama_tied_5x(p):
    _save_5x(_llama(tie=True), p)


def _case_llama_tied_4x(p):
    _save_4x(_llama(tie=True), p, tie=True)


def _case_llama_tied_but_different_5x(p):  # the bug: tie_word_embeddings true, a trained head
    _save_5x(_llama(tie=True, untie=True), p)


def _case_llama_tied_equal_head_5x(p):
    m = _llama(tie=True)
    _save_5x(m, p)
    _with_tensor(p, HEAD, m.model.embed_tokens.weight.detach().numpy().copy())


CASES = {
    "t5.1.1-5.x-tied": Case(_case_t5_11_tied_5x, "tied"),
    "t5.1.1-5.x-tied-but-different": Case(_case_t5_11_untied_5x_resaved, "untied"),
    "t5.1.1-5.x-untied": Case(_case_t5_11_untied_5x_config_false, "untied"),
    "t5.1.1-4.x-untied": Case(_case_t5_11_untied_4x, "untied"),
    "t5.1.1-5.x-tied-equal-head": Case(_case_t5_11_tied_equal_head_5x, "tied"),
    "t5.1.1-4.x-tied-scaled": Case(_case_t5_11_tied_scaled_4x, "tied", scaled=True),
    "t5.1.0-5.x-tied": Case(_case_t5_10_tied_5x, "tied", scaled=True),
    "t5.1.0-4.x-tied": Case(_case_t5_10_tied_4x, "tied", scaled=True),
    "t5.1.0-4.x-tied-equal-head": Case(_case_t5_10_tied_equal_head_4x, "tied", scaled=True),
    "llama-5.x-untied": Case(_case_llama_untied_5x, "untied"),
    "llama-4.x-untied": Case(_case_llama_untied_4x, "untied"),
    "llama-5.x-tied": Case(_case_llama_tied_5x, "tied"),
    "llama-4.x-tied": Case(_case_llama_tied_4x, "tied"),
    "llama-5.x-tied-but-different": Case(_case_llama_tied_but_different_5x, "untied"),
    "llama-5.x-tied-equal-head": Case(_case_llama_tied_equal_head_5x, "tied"),
}


# --- logits -----------------------------------------------------------------------------------


def _tokens(shape, seed):
    return np.random.RandomState(seed).randint(1, V, size=shape).astype(np.int64)


ENC, DEC, LM = _tokens((2, 24), 0), _tokens((2, 9), 1), _tokens((2, 16), 2)


def _is_t5(path: Path) -> bool:
    return json.loads((path / "config.json").read_text())["model_type"] == "t5"


def _load(path: Path) -> torch.nn.Module:
    cls = transformers.T5ForConditionalGeneration if _is_t5(path) else transformers.LlamaForCausalLM
    return cls.from_pretrained(path).eval()


def _torch_logits(model: torch.nn.Module) -> np.ndarray:
    with torch.no_grad():
        if isinstance(model, transformers.T5ForConditionalGeneration):
            out = model(input_ids=torch.tensor(ENC), decoder_input_ids=torch.tensor(DEC))
        else:
            out = model(input_ids=torch.tensor(LM))
    return out.logits.numpy()


def _load_as_4x(path: Path) -> torch.nn.Module:
    """`path` as transformers 4.x reads it: tied iff `tie_word_embeddings` (a saved head is
    then dropped), T5 scaled iff tied, and a missing untied head is left random (refused)."""
    raw = json.loads((path / "config.json").read_text())
    tie = raw.get("tie_word_embeddings", _is_t5(path))
    if not tie:
        assert HEAD in safetensors_numpy.load_file(path / "model.safetensors")
    model = _load(path)
    if _is_t5(path):
        model.config.scale_decoder_outputs = tie
    if tie:
        model.lm_head.weight = model.get_input_embeddings().weight
    return model


def _t5lite_logits(cfg, params) -> np.ndarray:
    t5 = isinstance(cfg, network.T5Config)
    module = network.EncoderDecoder(cfg) if t5 else network.DecoderOnly(cfg)
    inputs = (ENC, DEC) if t5 else (LM,)
    fn = jax.jit(functools.partial(module.apply, enable_dropout=False))
    return np.asarray(fn({"params": params}, *(jnp.asarray(t, jnp.int32) for t in inputs)))


def _imported(hf_dir: Path, out: Path):
    ckpt = convert.hf_to_t5lite(hf_dir, out)
    state, extra = restore_checkpoint(ckpt, None)
    return ckpt, config_from_record(extra["network_config"]), state["params"]


def _max_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)))


@pytest.mark.parametrize("name", list(CASES))
def test_save_style_imports_and_exports_as_transformers_reads_it(tmp_path, name):
    case = CASES[name]
    hf_dir = tmp_path / "hf"
    case.save(hf_dir)
    reference = _load(hf_dir)
    want = _torch_logits(reference)
    # What transformers made of the file: the case's head and scaling.
    tied = reference.lm_head.weight is reference.get_input_embeddings().weight
    assert tied == (case.head == "tied")
    assert getattr(reference.config, "scale_decoder_outputs", False) == case.scaled

    ckpt, cfg, params = _imported(hf_dir, tmp_path / "imported")
    assert cfg.logits_via_embedding == tied
    if isinstance(cfg, network.T5Config):
        assert cfg.scale_tied_logits == case.scaled
    assert _max_diff(_t5lite_logits(cfg, params), want) <= TOL

    exported = tmp_path / "exported"
    convert.t5lite_to_hf(ckpt, exported)
    assert _max_diff(_torch_logits(_load(exported)), want) <= TOL
    assert _max_diff(_torch_logits(_load_as_4x(exported)), want) <= TOL
    _, again, params_again = _imported(exported, tmp_path / "reimported")
    assert again == cfg
    jax.tree.map(np.testing.assert_array_equal, params_again, params)


@pytest.mark.parametrize("legacy", [False, True], ids=["5.x", "4.x"])
def test_t5_1_0_with_a_different_head_is_refused_naming_it(tmp_path, legacy):
    """transformers 5.x reads a scaled T5 whose saved head differs from the embedding as an
    untied head behind the d_model**-0.5 scaling (4.x: tied, the head dropped). t5lite's
    T5Config has no untied scaled head: one line says so instead of tying it silently."""
    model = _t5("relu", untie=True)
    hf_dir = tmp_path / "hf"
    (_save_4x if legacy else _save_5x)(model, hf_dir, *([True] if legacy else []))
    reference = _load(hf_dir)
    assert reference.lm_head.weight is not reference.shared.weight
    assert reference.config.scale_decoder_outputs
    with pytest.raises(ValueError, match="untied lm_head with scale_decoder_outputs=true") as e:
        convert.hf_to_t5lite(hf_dir, tmp_path / "imported")
    assert "\n" not in str(e.value)


def test_a_tied_head_stored_as_the_only_copy_is_the_embedding(tmp_path):
    """5.x ties the other way round when only `lm_head.weight` is saved."""
    model = _llama(tie=True)
    hf_dir = tmp_path / "hf"
    _save_5x(model, hf_dir)
    tensors = safetensors_numpy.load_file(hf_dir / "model.safetensors")
    tensors[HEAD] = tensors.pop("model.embed_tokens.weight")
    safetensors_numpy.save_file(tensors, str(hf_dir / "model.safetensors"))
    want = _torch_logits(_load(hf_dir))
    _, cfg, params = _imported(hf_dir, tmp_path / "imported")
    assert cfg.logits_via_embedding
    assert _max_diff(_t5lite_logits(cfg, params), want) <= TOL
