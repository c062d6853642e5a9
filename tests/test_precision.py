"""Mixed precision: a jmp-style policy in gin, fp32 masters and optimizer state under bf16."""

from __future__ import annotations

import dataclasses
import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import require_devices, run_cli

import seqio_lite
from t5lite import partitioning
from t5lite.checkpoint import CheckpointManager
from t5lite.insight import report as rep
from t5lite.insight.memory import predict_memory
from t5lite.model import network, optimizers
from t5lite.model.models import EncoderDecoderModel
from t5lite.model.precision import Precision
from t5lite.trainer import Trainer, summarize

# The quickstart task (synthetic_reverse, byte vocabulary) on a smaller T5 than quickstart's.
TINY = network.T5Config(
    vocab_size=384, emb_dim=32, num_heads=2, num_encoder_layers=1, num_decoder_layers=1,
    head_dim=16, mlp_dim=64,
)  # fmt: skip
LENGTHS = {"inputs": 24, "targets": 24}
MIXED = "params=bfloat16,compute=bfloat16,output=float32"


def test_policy_strings_as_jmp_writes_them():
    assert Precision.parse("params=float32,compute=bfloat16,output=float32") == Precision(
        compute="bfloat16"
    )
    assert Precision.parse("p=bf16,c=bf16,o=f32") == Precision("bfloat16", "bfloat16")
    assert Precision.parse("bf16") == Precision("bfloat16", "bfloat16", "bfloat16", "float32")
    assert str(Precision.parse("c=bf16,m=bf16")) == (
        "params=float32,compute=bfloat16,output=float32,master=bfloat16"
    )
    with pytest.raises(ValueError, match=r"'param=bf16' is not one of params=, compute="):
        Precision.parse("param=bf16")
    with pytest.raises(ValueError, match=r"T5Config: precision 'c=int8': unknown dtype 'int8'"):
        network.T5Config(precision="c=int8")


def _trainer(precision: str, optimizer=None) -> Trainer:
    require_devices(8)
    model = EncoderDecoderModel(
        dataclasses.replace(TINY, precision=precision),
        optimizer=optimizer or optimizers.AdamW(3e-3),
    )
    part = partitioning.Partitioner(num_partitions=2)  # Megatron: data=4 x model=2
    return Trainer(model, part, batch_size=16, lengths=LENGTHS)


def _losses(tr: Trainer, steps: int):
    data = seqio_lite.get_dataset("synthetic_reverse", LENGTHS, "train", batch_size=16, seed=0)
    state, losses = tr.init_state(), []
    for _, batch in zip(range(steps), data):
        state, metrics = tr.train_step(state, tr.global_batch(batch))
        losses.append(summarize(metrics)["loss"])
    return state, np.array(losses)


def test_bf16_compute_with_fp32_masters_trains_like_fp32(tmp_path):
    _, fp32 = _losses(_trainer("float32"), 50)
    tr = _trainer(MIXED)
    state, mixed = _losses(tr, 50)
    # The state holds fp32 masters and fp32 Adam moments; the forward pass saw bf16.
    floats = jax.tree_util.tree_leaves((state.params, state.opt_state))
    assert {x.dtype for x in floats if jnp.issubdtype(x.dtype, jnp.floating)} == {
        jnp.dtype(jnp.float32)
    }
    assert mixed[-1] < 0.8 * mixed[0]  # it learns...
    # ...as fp32 does: per step within 0.5% (bf16 keeps 8 mantissa bits; measured: 0.04% at
    # most, 0.012% on average), and not by chance: the losses do differ in the last bits.
    np.testing.assert_allclose(mixed, fp32, rtol=0.005)
    assert not np.array_equal(mixed, fp32)

    # Checkpoints store the masters (fp32); a pure-bf16 policy restores them cast to bf16.
    mgr = CheckpointManager(tmp_path, async_save=False)
    mgr.save(50, state, extra={"step": 50})
    arrays = json.loads((tmp_path / "checkpoint_50" / "metadata.json").read_text())["arrays"]
    kernel = "params/decoder/layers_0/mlp/wi_0/kernel"
    assert arrays[kernel]["dtype"] == "float32"
    assert {a["dtype"] for n, a in arrays.items() if n.startswith("opt_state/")} >= {"float32"}
    pure = _trainer("params=bf16,compute=bf16,output=f32,master=bf16")
    restored, _ = mgr.restore(pure.abstract_state())
    wi = restored.params["decoder"]["layers_0"]["mlp"]["wi_0"]["kernel"]
    assert wi.dtype == jnp.bfloat16
    want = np.asarray(state.params["decoder"]["layers_0"]["mlp"]["wi_0"]["kernel"])
    np.testing.assert_array_equal(np.asarray(wi), want.astype(jnp.bfloat16))


def test_pure_bf16_keeps_bf16_state():
    tr = _trainer("params=bf16,compute=bf16,output=f32,master=bf16")
    leaves = jax.tree_util.tree_leaves((tr.state_abstract.params, tr.state_abstract.opt_state))
    assert {x.dtype for x in leaves if x.ndim} == {jnp.dtype(jnp.bfloat16)}


def _inspect(precision: str) -> rep.StepReport:
    require_devices(8)
    cfg = dataclasses.replace(TINY, precision=precision, emb_dim=128, mlp_dim=512, head_dim=32)
    part = partitioning.Partitioner(num_partitions=2)
    _, step = rep.inspect(
        model=EncoderDecoderModel(cfg), task_feature_lengths={"inputs": 64, "targets": 64},
        batch_size=64, partitioner=part, compile=False, stream=io.StringIO(),
    )  # fmt: skip
    return step


def test_inspect_memory_per_device_by_policy():
    fp32 = _inspect("float32").predicted
    mixed = _inspect("compute=bfloat16").predicted
    pure = _inspect("params=bf16,compute=bf16,output=f32,master=bf16").predicted
    # fp32 masters keep the state as is; XLA:CPU (the mesh `inspect` built here) has no bf16
    # matmul and stores bf16 activations in fp32 (memory.activation_itemsize), so they match.
    assert mixed.state == fp32.state and mixed.activations == fp32.activations
    # Without masters the parameters and Adam's moments are stored in bf16 too.
    assert pure.state * 2 == pytest.approx(fp32.state, rel=0.01)
    assert pure.total < mixed.total


def test_bf16_activations_halve_on_an_accelerator():
    """On a backend with bf16 matmuls (TPU, GPU) the backward pass keeps bf16 activations: the
    [B, L, D] and [B, L, F] buffers halve, the fp32 attention scores do not."""
    fp32, mixed = (predict_memory(_trainer(p), "tpu") for p in ("float32", "compute=bfloat16"))
    assert mixed.state == fp32.state
    assert fp32.activations / 2 < mixed.activations < fp32.activations
    assert mixed.total < fp32.total


def test_old_dtype_macros_name_their_replacement(capsys):
    code = run_cli(
        "train", "--gin_file=quickstart.gin", "--gin.MODEL_DIR='/tmp/unused'",
        "--gin.PARAM_DTYPE='bfloat16'",
    )  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0
    assert err[-1].endswith("--gin.PARAM_DTYPE: renamed; set --gin.PRECISION (e.g. "
                            "\"'params=bfloat16'\"; the masters stay fp32)")  # fmt: skip


@pytest.mark.parametrize(("output", "dot_dtype"), [("float32", "f32"), ("bfloat16", "bf16")])
def test_logits_projection_runs_in_the_wider_of_compute_and_output(output, dot_dtype):
    """fp32 logits are computed in fp32 (t5x); bf16 logits in bf16 (MaxText's default), and they
    equal the fp32 product rounded to bf16 up to accumulation order."""
    cfg = network.DecoderOnlyConfig(
        vocab_size=256, emb_dim=64, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128,
        num_layers=1, precision=f"params=bfloat16,compute=bfloat16,output={output}",
    )  # fmt: skip
    model = network.DecoderOnly(cfg)
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, 256, (2, 16)), jnp.int32)
    params = model.init(jax.random.PRNGKey(0), tokens, enable_dropout=False)["params"]
    params = cfg.policy.cast_params(params)  # as a loss or a decode does

    def logits(p, c):
        return network.DecoderOnly(c).apply(
            {"params": p}, tokens, tokens, None, None, None, enable_dropout=False
        )

    text = jax.jit(lambda p: logits(p, cfg)).lower(params).as_text()
    last_dot = [line for line in text.splitlines() if "dot_general" in line][-1]
    assert f"x{dot_dtype}>, tensor<64x256x{dot_dtype}>) -> tensor<32x256x{dot_dtype}>" in last_dot
    got = logits(params, cfg)
    wide = logits(params, dataclasses.replace(cfg, precision=cfg.policy.replace(output="float32")))
    assert got.dtype == jnp.dtype(output)
    ulp = np.abs(np.float32(wide)) * 2.0**-7  # one bf16 ulp (8 significant bits) or less
    np.testing.assert_array_less(np.abs(np.float32(got) - np.float32(wide)), ulp + 1e-6)
