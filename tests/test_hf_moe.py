"""Hugging Face mixtures of experts: `SwitchTransformersForConditionalGeneration` (top-1,
capacity) and `MixtralForCausalLM` (top-2, dropless) imported and exported with logit parity
against transformers (fp32, tiny random models built here), on one device and on 8 fake devices
under three expert layouts; Switch's dropped tokens, Mixtral's per-token reference and greedy
decoding; the router losses against transformers' own loss functions."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import require_devices
from readme_blocks import block, run

from t5lite import partitioning
from t5lite.hf import weights as hf_convert
from t5lite.model import moe, network
from t5lite.model.models import DecoderOnlyModel, EncoderDecoderModel
from t5lite.partitioning import Partitioner
from t5lite.trainer import Trainer

torch = pytest.importorskip("torch", reason="needs the [hf] extra (torch==2.13.0)")
transformers = pytest.importorskip("transformers", reason="needs the [hf] extra (transformers)")
pytest.importorskip("safetensors", reason="needs the [hf] extra (safetensors)")

from hf_models import mixtral_hf, switch_hf  # noqa: E402
from transformers.models.mixtral import modeling_mixtral  # noqa: E402
from transformers.models.switch_transformers import modeling_switch_transformers  # noqa: E402

TOL = 1e-4  # max |logits_t5lite - logits_transformers|, fp32
V, E = 96, 4


def _tokens(shape, seed=0):
    return np.random.RandomState(seed).randint(2, V, size=shape).astype(np.int64)


def _t5_inputs(b=2):
    enc, dec = _tokens((b, 12)), _tokens((b, 9), seed=1)
    dec[:, 0] = 0
    return enc, dec


def _apply(cfg, params, *tokens, capture=False):
    """(logits, intermediates): the sown MoE statistics and, with `capture`, each MoeBlock's
    output under `.../mlp/__call__`."""
    model = network.EncoderDecoder(cfg) if len(tokens) == 2 else network.DecoderOnly(cfg)

    def fn(params, *tokens):
        return model.apply(
            {"params": params},
            *tokens,
            enable_dropout=False,
            mutable=["intermediates"],
            capture_intermediates=(lambda m, _: isinstance(m, moe.MoeBlock)) if capture else False,
        )

    logits, state = jax.jit(fn)(params, *(jnp.asarray(t, jnp.int32) for t in tokens))
    return np.asarray(logits), jax.tree.map(np.asarray, state["intermediates"])


def _sown(inter, stack: str, name: str) -> list[np.ndarray]:
    """One value per MoE layer of `stack`, in layer order (unscanned trees)."""
    layers = inter[stack]
    keys = sorted((k for k in layers if k.startswith("layers_")), key=lambda k: int(k[7:]))
    return [layers[k]["mlp"][name][0] for k in keys if name in layers[k].get("mlp", {})]


# --- Switch Transformers -------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_switch_parity_router_losses_and_round_trip(tmp_path, tied):
    hf = switch_hf(tmp_path / "hf", expert_capacity=64, tie_word_embeddings=tied)
    assert (hf.lm_head.weight.data_ptr() == hf.shared.weight.data_ptr()) == tied
    cfg, params = hf_convert.import_hf(tmp_path / "hf")
    # Tied: scaled by d_model**-0.5 (T5 v1.0); untied: a separate lm_head, unscaled.
    assert (cfg.logits_via_embedding, cfg.scale_tied_logits) == (tied, tied)
    assert (cfg.variant, cfg.num_experts, cfg.moe_every, cfg.moe_top_k) == ("t5.1.0", E, 2, 1)
    assert (cfg.moe_expert_capacity, cfg.moe_dispatch, cfg.moe_normalize_top_k) == (
        64,
        "capacity",
        False,
    )
    assert "router" in params["encoder"]["layers_1"]["mlp"]
    assert "router" not in params["encoder"]["layers_0"]["mlp"]
    assert params["decoder"]["layers_3"]["mlp"]["wi"].shape == (E, 32, 48)
    enc, dec = _t5_inputs()
    with torch.no_grad():
        out = hf(
            input_ids=torch.tensor(enc),
            decoder_input_ids=torch.tensor(dec),
            output_router_logits=True,
        )
    want = out.logits.numpy()
    got, inter = _apply(cfg, params, enc, dec)
    assert np.max(np.abs(got - want)) <= TOL
    # transformers' z-loss is over all MoE layers' tokens of a stack: t5lite's per-layer mean.
    for stack, hf_z in (("encoder", out.encoder_z_loss), ("decoder", out.decoder_z_loss)):
        np.testing.assert_allclose(np.mean(_sown(inter, stack, moe.Z_LOSS)), float(hf_z), 1e-5)

    hf_convert.export_hf(cfg, params, tmp_path / "out")
    cls = transformers.SwitchTransformersForConditionalGeneration
    reloaded = cls.from_pretrained(tmp_path / "out").eval()
    assert reloaded.config.expert_capacity == 64 and reloaded.config.encoder_sparse_step == 2
    with torch.no_grad():
        again = reloaded(input_ids=torch.tensor(enc), decoder_input_ids=torch.tensor(dec)).logits
    assert np.max(np.abs(again.numpy() - want)) <= TOL
    want_sd = hf.state_dict()
    for k, v in reloaded.state_dict().items():
        np.testing.assert_array_equal(v.numpy(), want_sd[k].numpy(), err_msg=k)


def test_switch_drops_and_router_losses_equal_transformers(tmp_path):
    """One sequence: transformers' Switch balances each sequence, t5lite the batch; the
    load-balancing losses agree for a batch of one."""
    # 4 experts with 2 slots each: at least 4 of the 12 encoder tokens and 1 of the 9 decoder
    # tokens are dropped.
    hf = switch_hf(tmp_path / "hf", expert_capacity=2, layers=2)
    cfg, params = hf_convert.import_hf(tmp_path / "hf")
    enc, dec = _t5_inputs(b=1)
    outputs: dict[str, np.ndarray] = {}

    def keep(key):
        return lambda module, args, out: outputs.update({key: out.numpy()})

    hooks = []
    for stack in ("encoder", "decoder"):
        for i, blk in enumerate(getattr(hf, stack).block):
            mlp = blk.layer[-1].mlp
            if isinstance(mlp, modeling_switch_transformers.SwitchTransformersSparseMLP):
                hooks.append(mlp.register_forward_hook(keep(f"{stack}/layers_{i}")))
    with torch.no_grad():
        out = hf(
            input_ids=torch.tensor(enc),
            decoder_input_ids=torch.tensor(dec),
            output_router_logits=True,
        )
    for h in hooks:
        h.remove()
    got, inter = _apply(cfg, params, enc, dec, capture=True)
    assert np.max(np.abs(got - out.logits.numpy())) <= TOL
    assert sorted(outputs) == ["decoder/layers_1", "encoder/layers_1"]
    total_dropped = 0
    for key, hf_y in outputs.items():
        stack, layer = key.split("/")
        y = inter[stack][layer]["mlp"]["__call__"][0]
        # A dropped token's MoE output is exactly 0: the residual alone carries it.
        hf_dropped, dropped = ~hf_y.any(-1), ~y.any(-1)
        np.testing.assert_array_equal(dropped, hf_dropped, err_msg=key)
        np.testing.assert_allclose(y, hf_y, atol=TOL, err_msg=key)
        np.testing.assert_allclose(
            inter[stack][layer]["mlp"][moe.DROPPED][0], hf_dropped.mean(), err_msg=key
        )
        total_dropped += int(hf_dropped.sum())
    assert total_dropped >= 4 + 1
    # Each layer's router losses (before capacity) by transformers' own functions.
    f = modeling_switch_transformers
    for stack in ("encoder", "decoder"):
        (logits,) = getattr(out, f"{stack}_router_logits")
        aux, z = (
            inter[stack]["layers_1"]["mlp"][moe.AUX_LOSS],
            inter[stack]["layers_1"]["mlp"][moe.Z_LOSS],
        )
        want_aux = f.load_balancing_loss_func(torch.softmax(logits, -1), logits.argmax(-1))
        np.testing.assert_allclose(aux[0], float(want_aux), rtol=1e-5)
        np.testing.assert_allclose(z[0], float(f.router_z_loss_func(logits)), rtol=1e-5)


# --- Mixtral -------------------------------------------------------------------------------------


@pytest.mark.parametrize("scan", [False, True])
def test_mixtral_parity_router_loss_and_round_trip(tmp_path, scan):
    hf = mixtral_hf(tmp_path / "hf")
    cfg, params = hf_convert.import_hf(tmp_path / "hf", scan_layers=scan)
    assert (cfg.num_experts, cfg.moe_top_k, cfg.moe_every, cfg.moe_dispatch) == (
        E,
        2,
        1,
        "dropless",
    )
    assert cfg.moe_normalize_top_k and cfg.moe_z_loss_coef == 0.0
    tokens = _tokens((2, 16))
    with torch.no_grad():
        out = hf(input_ids=torch.tensor(tokens), output_router_logits=True)
    want = out.logits.numpy()
    got, inter = _apply(cfg, params, tokens)
    assert np.max(np.abs(got - want)) <= TOL
    if not scan:
        # transformers' Mixtral balances all layers' tokens at once; its function on one
        # layer's logits is t5lite's loss of that layer.
        aux = _sown(inter, "decoder", moe.AUX_LOSS)
        for layer, aux_l in zip(out.router_logits, aux, strict=True):
            want_aux = modeling_mixtral.load_balancing_loss_func((layer,), E, 2)
            np.testing.assert_allclose(aux_l, float(want_aux), rtol=1e-5)

    hf_convert.export_hf(cfg, params, tmp_path / "out")
    reloaded = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        again = reloaded(input_ids=torch.tensor(tokens)).logits.numpy()
    assert np.max(np.abs(again - want)) <= TOL
    want_sd = hf.state_dict()
    for k, v in reloaded.state_dict().items():
        np.testing.assert_array_equal(v.numpy(), want_sd[k].numpy(), err_msg=k)


def test_mixtral_dropless_equals_a_per_token_numpy_reference(tmp_path):
    hf = mixtral_hf(tmp_path / "hf")
    cfg, params = hf_convert.import_hf(tmp_path / "hf")
    p = jax.tree.map(np.asarray, params["decoder"]["layers_0"]["mlp"])
    x = np.random.RandomState(0).normal(size=(2, 8, 32)).astype(np.float32)
    y = np.asarray(moe.mlp_block(cfg, sparse=True).apply({"params": p}, jnp.asarray(x)))
    x_TD = x.reshape(-1, 32).astype(np.float64)
    want = np.zeros_like(x_TD)

    def silu(v):
        return v / (1.0 + np.exp(-v))

    for t, x_D in enumerate(x_TD):
        logits = x_D @ p["router"]["kernel"]
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        top = np.argsort(-probs)[:2]
        for e in top:  # Mixtral: softmax, top-2, renormalised
            h = silu(x_D @ p["wi_0"][e]) * (x_D @ p["wi_1"][e])
            want[t] += probs[e] / probs[top].sum() * (h @ p["wo"][e])
    np.testing.assert_allclose(y.reshape(-1, 32), want, atol=1e-5)
    with torch.no_grad():
        hf_y = hf.model.layers[0].mlp(torch.tensor(x)).numpy()
    np.testing.assert_allclose(y, hf_y, atol=1e-5)


def test_mixtral_greedy_equals_hf_generate(tmp_path):
    hf = mixtral_hf(tmp_path / "hf")
    with torch.no_grad():  # EOS (1) likely after some tokens, so that stopping is exercised
        hf.lm_head.weight[1] = hf.lm_head.weight[83] + 0.01
    hf.save_pretrained(tmp_path / "hf")
    cfg, params = hf_convert.import_hf(tmp_path / "hf", scan_layers=True)
    new = 10
    prompts = [np.random.RandomState(1).randint(2, V, n).tolist() for n in (1, 3, 5, 2)]
    length = 5 + 1 + new  # longest prompt, BOS, new tokens

    def pad(rows):
        return np.array([list(r) + [0] * (length - len(r)) for r in rows], np.int32)

    model = DecoderOnlyModel(network_config=cfg, inputs_bidirectional_attention=False)
    batch = {
        "decoder_input_tokens": pad([[0, *p] for p in prompts]),
        "decoder_causal_attention": pad([[1] * (len(p) + 1) for p in prompts]),
    }
    decode = jax.jit(lambda p, b: model.predict_batch(p, b, max_decode_length=new))
    got = np.asarray(decode(params, batch))
    for row, p in zip(got, prompts):
        with torch.no_grad():
            out = hf.generate(
                input_ids=torch.tensor([[0, *p]]),
                attention_mask=torch.ones(1, len(p) + 1),
                max_new_tokens=new,
                do_sample=False,
                num_beams=1,
                eos_token_id=1,
                pad_token_id=0,
            )[0, len(p) + 1 :].tolist()
        assert row.tolist() == out + [0] * (new - len(out))
    assert (got == 1).any()  # some row stopped at EOS


# --- 8 devices, three expert layouts -------------------------------------------------------------

LAYOUTS = {
    # GShard: experts over `data`, each whole; the dispatch is an all-to-all.
    "experts_over_data": partitioning.preset_rules("expert_parallel"),
    "experts_over_model": partitioning.preset_rules(
        "megatron", overrides={"expert": "model", "expert_mlp": None}
    ),
    # Every device holds every expert, each expert's MLP split over `model` as Megatron's.
    "experts_replicated_megatron": partitioning.preset_rules(
        "megatron", overrides={"expert": None, "expert_mlp": "model"}
    ),
}
EXPERT_SPECS = {  # wi kernels [expert, embed, expert_mlp] on a data=4 x model=2 mesh
    "experts_over_data": ("data", None, None),
    "experts_over_model": ("model", None, None),
    "experts_replicated_megatron": (None, None, "model"),
}


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_moe")
    # Capacity 3 of 8 tokens: drops (decoder and encoder), the same ones as transformers.
    return {
        "switch": (switch_hf(root / "switch", expert_capacity=3, layers=2), root / "switch"),
        "mixtral": (mixtral_hf(root / "mixtral", layers=1), root / "mixtral"),
    }


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("arch", ["switch", "mixtral"])
def test_loss_on_8_devices_equals_transformers(hf_models, arch, layout):
    require_devices(8)
    hf, path = hf_models[arch]
    cfg, params = hf_convert.import_hf(path)
    targets = _tokens((8, 8), seed=2)
    batch = {
        "decoder_input_tokens": np.pad(targets[:, :-1], ((0, 0), (1, 0))).astype(np.int32),
        "decoder_target_tokens": targets.astype(np.int32),
        "decoder_loss_weights": np.ones((8, 8), np.float32),
    }
    with torch.no_grad():
        if arch == "switch":
            enc = _tokens((8, 8), seed=3)
            batch["encoder_input_tokens"] = enc.astype(np.int32)
            out = hf(input_ids=torch.tensor(enc), labels=torch.tensor(targets))
            model = EncoderDecoderModel(network_config=cfg, z_loss=0.0)
        else:  # HF shifts the labels: [0, t_0 .. t_7] predicts t_0 .. t_7 after position 0
            ids = torch.tensor(np.pad(targets, ((0, 0), (1, 0))))
            out = hf(input_ids=ids, labels=ids)
            model = DecoderOnlyModel(network_config=cfg, z_loss=0.0)
    part = Partitioner(partitioning.create_mesh(2), logical_axis_rules=LAYOUTS[layout])
    lengths = {"inputs": 8, "targets": 8} if arch == "switch" else {"targets": 8}
    tr = Trainer(model, part, batch_size=8, lengths=lengths)
    layer = "layers_1" if arch == "switch" else "layers_0"
    wi = tr.state_shardings.params["decoder"][layer]["mlp"]["wi" if arch == "switch" else "wi_0"]
    assert tuple(wi.spec) == EXPERT_SPECS[layout]
    sharded = jax.tree.map(jax.device_put, params, tr.state_shardings.params)
    got = tr.eval_step(sharded, tr.global_batch_from_full(batch))
    loss = float(got["loss_sum"]) / float(got["weight_sum"])
    np.testing.assert_allclose(loss, float(out.loss), rtol=1e-5, atol=1e-6)
    if arch == "switch":
        assert float(got["moe_dropped_sum"]) > 0  # capacity 3 drops tokens here


# --- refused variants ----------------------------------------------------------------------------


def _edit_config(path: Path, **changes) -> None:
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, **changes}))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"encoder_sparse_step": 3, "decoder_sparse_step": 3},
            "unsupported Switch variant encoder_sparse_step=3, decoder_sparse_step=3",
        ),
        ({"router_bias": True}, "unsupported Switch variant router_bias=true"),
        ({"router_dtype": "bfloat16"}, "unsupported Switch variant router_dtype='bfloat16'"),
        ({"dense_act_fn": "gelu"}, "unsupported Switch variant dense_act_fn='gelu'"),
    ],
)
def test_unrepresentable_switch_variants_are_refused_in_one_line(tmp_path, changes, message):
    switch_hf(tmp_path / "hf", layers=2)
    _edit_config(tmp_path / "hf", **changes)
    with pytest.raises(ValueError, match=message) as e:
        hf_convert.import_hf(tmp_path / "hf")
    assert "\n" not in str(e.value) and "config.json" in str(e.value)


def test_unrepresentable_mixtral_and_exports_are_refused_in_one_line(tmp_path):
    mixtral_hf(tmp_path / "hf")
    _edit_config(tmp_path / "hf", sliding_window=4)
    with pytest.raises(ValueError, match="unsupported Mixtral variant sliding_window=4"):
        hf_convert.import_hf(tmp_path / "hf")
    _edit_config(tmp_path / "hf", sliding_window=None)
    cfg, params = hf_convert.import_hf(tmp_path / "hf")
    capacity = dataclasses.replace(cfg, moe_dispatch="capacity")
    with pytest.raises(ValueError, match="MixtralForCausalLM only with moe_dispatch='dropless'"):
        hf_convert.export_hf(capacity, params, tmp_path / "x")
    t5 = network.T5Config(variant="t5.1.0", num_experts=4, num_encoder_layers=2)
    with pytest.raises(ValueError, match=r"set T5Config\.moe_expert_capacity"):
        hf_convert.export_hf(t5, {}, tmp_path / "x")
    with pytest.raises(ValueError, match="SwitchTransformersForConditionalGeneration only with "):
        hf_convert.export_hf(dataclasses.replace(t5, moe_top_k=2), {}, tmp_path / "x")
    with pytest.raises(ValueError, match="moe_expert_capacity must be >= 0"):
        dataclasses.replace(t5, moe_expert_capacity=-1)


# --- docs/moe.md's commands ----------------------------------------------------------------------


def test_convert_commands_in_moe_docs(tmp_path):
    switch_hf(Path("/tmp/t5lite_switch_hf"), expert_capacity=64)
    mixtral = mixtral_hf(Path("/tmp/t5lite_mixtral_hf"))
    for path in ("/tmp/t5lite_switch", "/tmp/t5lite_mixtral", "/tmp/t5lite_mixtral_out"):
        shutil.rmtree(path, ignore_errors=True)
    run(block("docs/moe.md", "convert-switch-mixtral"), timeout=600)
    gin = Path("/tmp/t5lite_switch/model.gin").read_text()
    assert "network.T5Config.moe_expert_capacity = 64" in gin
    assert "network.T5Config.moe_every = 2" in gin
    assert (
        "network.DecoderOnlyConfig.moe_dispatch = 'dropless'"
        in Path("/tmp/t5lite_mixtral/model.gin").read_text()
    )
    reloaded = transformers.MixtralForCausalLM.from_pretrained("/tmp/t5lite_mixtral_out").eval()
    tokens = torch.tensor(_tokens((2, 12)))
    with torch.no_grad():
        diff = reloaded(input_ids=tokens).logits - mixtral(input_ids=tokens).logits
    assert float(diff.abs().max()) <= TOL


def test_preset_rules_overrides_replace_rules_in_place_and_bind_in_gin():
    import gin

    from t5lite.cli import registry as gin_registry
    from t5lite.cli.gin_config import parse_gin

    megatron = partitioning.preset_rules("megatron")
    over = LAYOUTS["experts_over_model"]
    # Same names in the same order (same priorities); only the two overridden rules differ.
    assert [n for n, _ in over] == [n for n, _ in megatron]
    changed = {n: a for (n, a), (_, b) in zip(over, megatron) if a != b}
    assert changed == {"expert": "model", "expert_mlp": None}
    with pytest.raises(partitioning.PartitioningError, match="has no rule for 'experts'"):
        partitioning.preset_rules("megatron", overrides={"experts": "model"})
    binding = "preset_rules.overrides = {'expert': None, 'expert_mlp': 'model'}"
    try:
        parse_gin(["partitioning/megatron.gin"], [binding])
        with gin.unlock_config():
            rules = gin_registry.Partitioner(mesh=partitioning.create_mesh()).rules
    finally:
        with gin.unlock_config():
            gin.clear_config()
    assert rules == LAYOUTS["experts_replicated_megatron"]
