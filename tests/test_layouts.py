"""Sequence parallel, context parallel, 2D tensor parallel and FSDP presets: losses and HLO.

Each preset trains a tiny T5 on 8 fake CPU devices (data=2 x model=4) with the losses of pure
data parallelism; the compiled train step shows the collectives the layout implies. XLA:CPU has
no reduce-scatter creator, so a reduce-scatter the partitioner writes would stay an all-reduce
whose uses slice out this device's shard; sequence parallelism's block boundaries and ZeRO-3's
per-use kernel gathers are written with shard_map (t5lite/collectives.py), whose transposes are
real reduce-scatters. tests/test_layouts_tpu.py checks the TPU compiler's spelling.
"""

import collections
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import require_devices
from hlo_consumers import definitions, shapes
from jax.sharding import PartitionSpec as P

from t5lite.insight.hlo import collective_ops, parse_collectives
from t5lite.model import layers, network, optimizers
from t5lite.model.models import EncoderDecoderModel
from t5lite.partitioning import (
    Partitioner,
    create_mesh,
    preset_rules,
    standard_logical_axis_rules,
)
from t5lite.partitioning.rules import _sequence_parallel
from t5lite.trainer import Trainer, summarize

B, L, D, MODEL = 8, 8, 16, 4  # batch, length, emb_dim, size of the `model` axis
CFG = network.T5Config(vocab_size=32, emb_dim=D, num_heads=4, num_encoder_layers=1,
                       num_decoder_layers=1, head_dim=4, mlp_dim=32)  # fmt: skip
ACT = (B // 2, L, D)  # a residual-stream activation on one data shard, all positions


def _batch(b=B):
    tokens = np.random.default_rng(0).integers(2, 32, size=(b, L)).astype(np.int32)
    return {"encoder_input_tokens": tokens, "decoder_target_tokens": tokens[:, ::-1].copy(),
            "decoder_input_tokens": np.pad(tokens[:, ::-1], ((0, 0), (1, 0)))[:, :-1]}  # fmt: skip


def _train(preset, steps=3, hlo=False, cfg=CFG, microbatches=1):
    """Losses of `steps` steps under `preset`, and the compiled train step's HLO if asked."""
    rules = preset_rules(preset) if isinstance(preset, str) else preset
    part = Partitioner(create_mesh(MODEL), logical_axis_rules=rules)
    model = EncoderDecoderModel(cfg, optimizer=optimizers.AdamW(1e-2))
    b = B * microbatches
    tr = Trainer(model, part, batch_size=b, lengths={"inputs": L, "targets": L},
                 num_microbatches=microbatches)  # fmt: skip
    batch, state = tr.global_batch(_batch(b)), tr.init_state()
    step = tr.train_step.lower(state, batch).compile() if hlo else None
    losses = []
    for _ in range(steps):
        with part.context():
            state, metrics = (step or tr.train_step)(state, batch)
        losses.append(summarize(metrics)["loss"])
    return losses, (step.as_text() if hlo else None), part, batch, tr


@pytest.fixture(scope="module")
def dp_losses():
    require_devices(8)
    return _train("data_parallel")[0]


def _arrays(kind, axes, hlo, mesh, runs=False):
    """Counter of result shapes of the instructions of `kind` over mesh `axes` (with `runs`:
    of their executions in one step, a loop body's once per iteration)."""
    defs = definitions(hlo)
    out = collections.Counter()
    for op in collective_ops(hlo, mesh):
        if op.collective.kind == kind and op.collective.axes == axes:
            out.update(shapes(defs[op.name][1]) * (op.runs if runs else 1))
    return out


def _activations_reduced_over_model(hlo, mesh, trainer):
    """Result shapes of the all-reduces whose groups span `model` (alone or with `data`), less
    scalars and the gradients of weights (by shape, in any layout): activations."""
    weights = {tuple(sorted(x.shape)) for x in jax.tree.leaves(trainer.state_abstract.params)}
    defs, out = definitions(hlo), collections.Counter()
    for op in collective_ops(hlo, mesh):
        if op.collective.kind == "all-reduce" and "model" in (op.collective.axes or ()):
            out.update(s for s in shapes(defs[op.name][1]) if s and tuple(sorted(s)) not in weights)
    return out


def test_sequence_parallel(dp_losses):
    losses, hlo, part, batch, tr = _train("sequence_parallel", hlo=True)
    np.testing.assert_allclose(losses, dp_losses, rtol=1e-5)
    # Batches follow the rules: positions split over `model` like the residual stream.
    assert batch["decoder_target_tokens"].sharding.spec == P("data", "model")
    # Megatron-SP's g / g-bar, written with shard_map (t5lite/collectives.py). Forward:
    # each block's input [B/d, L/m, D] is all-gathered to [B/d, L, D] before its column-parallel
    # matmuls (encoder attention and MLP; decoder self-, cross-attention and MLP), as are the
    # encoder output that cross-attention's keys and values read and the input of the
    # vocab-parallel logits (7); each block's output is reduce-scattered back to 1/m of the
    # positions (5). Backward: the transposes, 7 reduce-scatters and 5 all-gathers.
    shard = (B // 2, L // MODEL, D)
    assert _arrays("reduce-scatter", ("model",), hlo, part.mesh) == {shard: 12}
    assert _arrays("all-gather", ("model",), hlo, part.mesh)[ACT] == 12
    # No all-reduce over `model` carries a layer's activation (Megatron: 21 of [B/d, L, D]).
    # Besides the gradients of weights replicated over `model` (norm scales, the token
    # embedding gathered for the lookup) and scalars, what remains is the vocab-parallel
    # cross-entropy's per-token max and sums over the vocabulary, [B/d, L].
    assert _activations_reduced_over_model(hlo, part.mesh, tr) == {(B // 2, L): 3}


def test_sequence_parallel_with_zero3_weights(dp_losses):
    """Sequence parallelism over FSDP's table (weights' embed -> data): each block's shard_map
    gathers its kernels over `data` itself, so their gradients leave reduce-scattered."""
    rules = tuple(_sequence_parallel(list(standard_logical_axis_rules(1, 2))))
    losses, hlo, part, _, tr = _train(rules, hlo=True)
    np.testing.assert_allclose(losses, dp_losses, rtol=1e-5)
    # One per kernel, each to its shard [D/d, ...] x [.../m]: q, k, v of 3 attention layers
    # [D/2, H/4, K], their `out` [H/4, K, D/2], and 7 [8, 8]: wi_0, wi_1, wo of 2 MLPs and the
    # logits (D/2 x F/4, F/4 x D/2, D/2 x V/4).
    assert _arrays("reduce-scatter", ("data",), hlo, part.mesh) == {
        (D // 2, 1, 4): 9,
        (1, 4, D // 2): 3,
        (8, 8): 7,
    }
    assert _arrays("reduce-scatter", ("model",), hlo, part.mesh) == {(B // 2, L // MODEL, D): 12}
    assert _activations_reduced_over_model(hlo, part.mesh, tr) == {(B // 2, L): 3}


def test_context_parallel(dp_losses):
    losses, hlo, part, batch, tr = _train("context_parallel", hlo=True)
    np.testing.assert_allclose(losses, dp_losses, rtol=1e-5)
    assert batch["encoder_input_tokens"].sharding.spec == P("data", "model")
    # Keys and values are projected on each device's own positions and gathered inside
    # attention (t5lite/collectives.py): 3 attention layers (encoder self, decoder self,
    # decoder cross) x (k, v) forward, [B/d, S, H, K]; their gradients reduce-scattered back.
    kv, kv_shard = (B // 2, L, 4, 4), (B // 2, L // MODEL, 4, 4)
    gathered = _arrays("all-gather", ("model",), hlo, part.mesh)
    assert gathered[kv] == 6
    assert _arrays("reduce-scatter", ("model",), hlo, part.mesh) == {kv_shard: 6}
    # Nothing else of the activations is gathered over the context axis: queries, the MLP and
    # the logits stay split by position (what remains are [B/d, L] masks and tokens).
    assert not [s for s in gathered if len(s) >= 3 and s != kv], gathered
    # No activation is all-reduced over `model` (the key/value gradients were, whole, before):
    # only the gradients of the weights, replicated over it, and scalars.
    assert _activations_reduced_over_model(hlo, part.mesh, tr) == {}


def test_tensor_2d(dp_losses):
    losses, hlo, part, _, _ = _train("tensor_2d", hlo=True)
    np.testing.assert_allclose(losses, dp_losses, rtol=1e-5)
    # Weights are split over both axes and gathered over `data` only (never over `model`).
    assert sum(_arrays("all-gather", ("data",), hlo, part.mesh).values()) > 0


def test_tensor_2d_mlp_volume_matches_the_formula():
    """Per MLP block forward on a d x m mesh: the weights gathered over `data` (D·F/m elements
    each), the input gathered over `model` and the output reduce-scattered over `model` (T·D/d
    each, results 1/m of that)."""
    require_devices(8)
    d, m, t, emb, f = 2, 4, 8 * 4, 32, 64
    part = Partitioner(create_mesh(m), logical_axis_rules=preset_rules("tensor_2d"))
    mlp = layers.MlpBlock(intermediate_dim=f, activations=("gelu", "linear"))
    x = jax.ShapeDtypeStruct((8, 4, emb), jnp.float32)
    variables, axes = part.abstract_initialize(lambda r: mlp.init(r, jnp.zeros(x.shape)),
                                               jax.random.PRNGKey(0))  # fmt: skip
    p_sh = part.shardings(variables["params"], axes["params"])
    x_sh = part.logical_to_sharding(P("batch", "length", "embed"))
    fn = part.partition(lambda p, x: mlp.apply({"params": p}, x), (p_sh, x_sh), x_sh)
    hlo = part.compile(fn, variables["params"], x).as_text()
    volume = collections.Counter()
    for c in parse_collectives(hlo, part.mesh):
        volume[(c.kind, c.axes)] += c.bytes // 4  # f32 elements of each result
    assert dict(volume) == {
        ("all-gather", ("data",)): 3 * emb * f // m,  # wi_0, wi_1, wo: gathered to 1/m each
        ("all-gather", ("model",)): t * emb // d,  # the input, before the wi matmuls
        # wo's partial sums, T·D/d per device, reduce-scattered to the output's 1/m over
        # `model` inside the layer's shard_map (t5lite/collectives.py): the formula's volume.
        ("reduce-scatter", ("model",)): t * emb // (d * m),
    }


def test_fsdp_weight_gradients_are_reduce_scattered():
    """ZeRO-3 on XLA:CPU: each weight matrix split over `data` is gathered inside its layer's
    shard_map (t5lite/collectives.py), so its gradient leaves through a real reduce-scatter over
    `data` to this device's shard, and no weight gradient is all-reduced whole over `data` (the
    partitioner's spelling, all-reduce + slice: twice ZeRO-3's traffic). TPU: test_layouts_tpu.py.
    """
    require_devices(8)
    data, model = 4, 2
    cfg = network.T5Config(vocab_size=128, emb_dim=64, num_heads=4, head_dim=32, mlp_dim=256,
                           num_encoder_layers=1, num_decoder_layers=1)  # fmt: skip
    part = Partitioner(create_mesh(model), logical_axis_rules=preset_rules("fsdp"))
    tr = Trainer(EncoderDecoderModel(cfg, optimizer=optimizers.AdamW(1e-3)), part,
                 batch_size=8, lengths={"inputs": 4, "targets": 4})  # fmt: skip
    batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=tr.batch_shardings[k])
             for k, v in tr.batch_abstract.items()}  # fmt: skip
    hlo = tr.train_step.lower(tr.abstract_state(), batch).compile().as_text()
    placements = jax.tree_util.tree_leaves(
        part.placements(tr.state_abstract.params, tr.params_axes),
        is_leaf=lambda x: hasattr(x, "shard_shape"),
    )
    # The weight matrices split over `data`: 3 attentions x (q, k, v, out), 2 MLPs x (wi_0,
    # wi_1, wo) and the logits. The token embedding's gradient is a scatter-add of looked-up
    # rows, computed from gathered lookups instead (collectives.py leaves embeddings alone).
    kernels = [
        p
        for p in placements
        if len(p.shape) >= 2 and "data" in p.spec and not p.path.startswith("token_embedder")
    ]
    assert len(kernels) == 19
    # Exactly one reduce-scatter over `data` per kernel, to the shard the rules give it (XLA may
    # lay a kernel out transposed): ZeRO-3's volume, 1/data of each model shard per device.
    scattered = _arrays("reduce-scatter", ("data",), hlo, part.mesh)
    assert sorted(tuple(sorted(s)) for s in scattered.elements()) == sorted(
        tuple(sorted(p.shard_shape)) for p in kernels
    )
    per_model = sum(math.prod(p.shape) // model for p in kernels)
    assert sum(math.prod(s) for s in scattered.elements()) * data == per_model
    # Nothing weight-sized is all-reduced over `data` (the smallest kernel's model shard has
    # 64 x 64 elements, the largest activation here 2 x 4 x 64): only the small parameters
    # (norm scales, relative-position biases, the token embedding) and scalars remain.
    reduced = _arrays("all-reduce", ("data",), hlo, part.mesh)
    assert not [s for s in reduced if math.prod(s) >= 64 * 64], reduced


@pytest.mark.slow  # two scanned, rematerialized compiles: ~165 s on 2 busy cores
def test_fsdp_scanned_rematerialized_microbatched_equals_data_parallel():
    """ZeRO-3's shard_maps inside `nn.scan` (scan_layers), under full remat and two microbatches:
    the losses of data parallelism with the same model, and each of the 19 kernels' gradients
    reduce-scattered over `data` (in the scanned body: once per layer and microbatch)."""
    require_devices(8)
    cfg = dataclasses.replace(CFG, scan_layers=True, remat_policy="full")
    dp = _train("data_parallel", cfg=cfg, microbatches=2)[0]
    losses, hlo, part, _, _ = _train("fsdp", hlo=True, cfg=cfg, microbatches=2)
    np.testing.assert_allclose(losses, dp, rtol=1e-5)
    # data=2 x model=4: q, k, v [D/2, H/4, K] (3 attentions), out [H/4, K, D/2], and wi_0, wi_1,
    # wo of 2 MLPs and the logits (D/2 x F/4, F/4 x D/2, D/2 x V/4), each 8x8.
    assert _arrays("reduce-scatter", ("data",), hlo, part.mesh) == {
        (D // 2, 1, 4): 9,
        (1, 4, D // 2): 3,
        (8, 8): 7,
    }
    # Each runs once per microbatch (the 1-layer scans' loops are gone; the microbatch loop's
    # 2 iterations remain): a step sends every gradient twice.
    assert _arrays("reduce-scatter", ("data",), hlo, part.mesh, runs=True) == {
        (D // 2, 1, 4): 18,
        (1, 4, D // 2): 6,
        (8, 8): 14,
    }
