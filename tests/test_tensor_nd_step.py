"""The whole train step of the 2D and 3D layouts, part by part, on 8 fake devices.

The papers' per-layer formulas count the transformer layers; a step also runs the logits, the
token embedding, the norms and (with `data` > 1) the gradients' data-parallel reduction.
`insight.step_parts` attributes each compiled collective by its HLO `op_name`; here the layers
and logits parts equal `insight.tensor_nd.step_terms` (written out again below), and the
kernels' gradient all-reduce over `data` runs on each device's own block.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from conftest import require_devices

from t5lite.insight.communication import link_bytes
from t5lite.insight.hardware import device_spec_named
from t5lite.insight.hlo import collective_ops
from t5lite.insight.step_parts import part_of, step_parts
from t5lite.insight.tensor_nd import step_part_lines, step_terms, whole_step_lines
from t5lite.model import network, optimizers
from t5lite.model.models import DecoderOnlyModel
from t5lite.partitioning import Partitioner, tensor_mesh, tensor_nd_rules
from t5lite.trainer import Trainer

B, L, D, A, F, V = 8, 8, 16, 16, 32, 128  # A: heads x head width
CFG = network.DecoderOnlyConfig(
    vocab_size=V, emb_dim=D, num_heads=4, num_layers=1, head_dim=A // 4, mlp_dim=F
)


@functools.cache
def _compiled(scheme: str) -> tuple[Trainer, str]:
    part = Partitioner(tensor_mesh(scheme), logical_axis_rules=tensor_nd_rules(scheme))
    model = DecoderOnlyModel(network_config=CFG, optimizer=optimizers.AdamW(1e-2))
    tr = Trainer(model, part, batch_size=B, lengths={"targets": L})
    tokens = np.ones((B, L), np.int32)
    batch = tr.global_batch({"decoder_target_tokens": tokens, "decoder_input_tokens": tokens})
    return tr, tr.train_step.lower(tr.abstract_state(), batch).compile().as_text()


def test_3d_step_parts_are_the_formulas():
    """2 x 2 x 2, float32, T = 64 tokens: per layer 2 (q-1)/q^3 (TN + NK + TK) over q, k, v
    ([D, 3A], one gathered input), out [A, D], wi ([D, 2F]) and wo [F, D]; the logits
    [T, D] x [D, V] the same layer, TK = T V included."""
    require_devices(8)
    tr, hlo = _compiled("tensor_3d")
    parts = step_parts(hlo, tr.partitioner.mesh)
    t, f3 = B * L, 2 * (2 - 1) / 2**3
    layer = sum(t * n + n * k + t * k for n, k in [(D, 3 * A), (A, D), (D, 2 * F), (F, D)])
    assert parts["layers"].link_bytes == f3 * layer * 4
    assert parts["logits"].link_bytes == f3 * (t * D + D * V + t * V) * 4
    # Each of the 7 kernels: its gather, the output's reduce-scatter and their two transposes;
    # each of the 4 inputs (q, k and v share one, wi's two kernels too): a gather and its dual.
    assert parts["layers"].count == 7 * 4 + 4 * 2
    terms = step_terms("tensor_3d", D, F, A, V, 1, t, 8, 1.0, itemsize=4)
    assert (terms.layers, terms.logits) == (
        parts["layers"].link_bytes,
        parts["logits"].link_bytes,
    )
    # What the formulas leave out is there too, attributed: the lookup, its gradient, norms.
    assert {"embedding", "norms"} <= set(parts)


def test_2d_step_parts_are_the_formulas_and_gradients_reduce_own_blocks():
    """data 2 x 2 x 2: t5lite's SUMMA sends 2 (q-1)/q^2 of the two operands each layer
    gathers (x for q, k, v, wi and the logits; the output for out and wo) on a replica's
    T = 32 tokens; the kernels' gradients are all-reduced over `data` at 1/q^2 of each kernel
    (the block a device holds), not at the 1/q of the block it gathered."""
    require_devices(8)
    tr, hlo = _compiled("summa_2d")
    mesh = tr.partitioner.mesh
    parts = step_parts(hlo, mesh)
    t, f2 = B * L // 2, 2 * (2 - 1) / 2**2
    layer = (t * D + D * 3 * A) + (A * D + t * D) + (t * D + D * 2 * F) + (F * D + t * D)
    assert parts["layers"].link_bytes == f2 * layer * 4
    assert parts["logits"].link_bytes == f2 * (t * D + D * V) * 4
    terms = step_terms("summa_2d", D, F, A, V, 1, B * L, 8, 1.0, itemsize=4)
    assert (terms.layers, terms.logits) == (
        parts["layers"].link_bytes,
        parts["logits"].link_bytes,
    )
    kernels = (D * 3 * A + A * D + 3 * D * F + D * V) // 4  # elements a device holds
    over_data = [
        link_bytes(op.collective)
        for op in collective_ops(hlo, mesh)
        if op.collective.kind == "all-reduce" and op.collective.axes == ("data",)
    ]
    assert sum(over_data) == 2 * (2 - 1) / 2 * kernels * 4
    # The analytic step counts every parameter's block there, the embedding table's too.
    assert terms.gradients == 2 * (2 - 1) / 2 * (kernels + V * D // 4) * 4
    assert parts["gradients"].link_bytes >= sum(over_data)


def test_inspect_prints_each_part_beside_its_formula():
    require_devices(8)
    tr, hlo = _compiled("tensor_3d")
    lines = step_part_lines(tr, hlo)
    assert lines[0].startswith("whole train step, compiled, by part")
    rows = {x.split()[0]: x for x in lines[1:]}
    assert rows["layers"].endswith("ratio 1.00") and rows["logits"].endswith("ratio 1.00")
    assert "ratio" not in rows["embedding"]
    total = sum(r.link_bytes for r in step_parts(hlo, tr.partitioner.mesh).values())
    assert rows["step"].split()[3] == f"{total:,.0f}"


def test_part_of_names_each_part():
    assert part_of("jit(f)/jvp(DecoderOnly)/decoder/layers_0/mlp/wi/x", "all-gather", ()) == (
        "layers"
    )
    assert part_of("jit(f)/transpose(jvp(M))/decoder/logits_dense/y", "all-gather", ()) == (
        "logits"
    )
    assert part_of("jit(f)/jvp(M)/decoder/token_embedder/take", "all-gather", ()) == "embedding"
    assert part_of("jit(f)/jvp(M)/decoder/layers_1/pre_mlp_layer_norm/s", "all-reduce", ()) == (
        "norms"
    )
    assert part_of("jit(f)/anything", "all-reduce", ("data", "tensor_row")) == "gradients"
    assert part_of("jit(f)/jvp()/reduce_sum", "all-reduce", ("tensor_i",)) == "rest"


def test_whole_step_ranking_of_the_64_chip_compile():
    """The two-layer ≈1B shape `benchmarks/tensor_nd.py --topology v5p:4x4x4` compiles
    (vocabulary 32768, 64 x 2048 tokens, bf16): t5lite's 2D sends least, then 3D, then 1D, as
    the TPU compiler's step does (1.34, 3.54 and 10.7 GB in docs/tensor-nd.md), while the
    survey's per-layer ranking puts 3D first. Figures written out from the formulas."""
    cfg = network.DecoderOnlyConfig(
        vocab_size=32768, emb_dim=2048, num_heads=64, head_dim=32, mlp_dim=5632, num_layers=2
    )
    spec = device_spec_named("v5p")
    lines = whole_step_lines(cfg, {"targets": 2048}, 64, 64, spec)
    rows = [x.split() for x in lines[2:5]]
    assert [r[0] for r in rows] == ["summa_2d", "tensor_3d", "megatron"]
    t, d, f, v = 64 * 2048, 2048, 5632, 32768
    two_d = 2 * 7 / 64 * (4 * t * d + d * 3 * d + d * d + 2 * d * f + f * d) * 2 * 2
    three_d = 2 * 6 / 64 * sum(t * n + n * k + t * k for n, k in [(d, 3 * d), (d, d)]) * 2
    three_d += 2 * 6 / 64 * (t * d + d * 2 * f + t * 2 * f + t * f + f * d + t * d) * 2
    want = {
        "summa_2d": (two_d, 7 / 64 * (t * d + d * v) * 6),
        "tensor_3d": (three_d, 3 / 64 * (t * d + d * v + t * v) * 6),
        "megatron": (2 * 4 * 2 * 63 / 64 * t * d * 2, 2 * 63 / 64 * t * d * 2),
    }
    for r in rows:
        layers, logits = want[r[0]]
        assert float(r[4]) == pytest.approx(layers / 1e6, abs=0.05)
        assert float(r[5]) == pytest.approx(logits / 1e6, abs=0.05)
        assert float(r[6]) == 0.0  # data = 1: no gradient all-reduce


def test_docs_whole_step_table_is_whole_step_lines():
    """docs/tensor-nd.md's whole-step table (6 columns): for the ≈1B and ≈7B on 8 and 64 v5p
    chips, 4096 tokens a chip, vocabulary 32000, the order and step ms `plan` prints."""
    from pathlib import Path

    models = {
        "≈1B": network.DecoderOnlyConfig(
            vocab_size=32000, emb_dim=2048, num_heads=32, head_dim=64, mlp_dim=5632, num_layers=22
        ),
        "≈7B": network.DecoderOnlyConfig(
            vocab_size=32000,
            emb_dim=4096,
            num_heads=32,
            head_dim=128,
            mlp_dim=11008,
            num_layers=32,
        ),
    }
    label = {"megatron": "1D", "summa_2d": "2D", "tensor_3d": "3D"}
    text = (Path(__file__).resolve().parent.parent / "docs" / "tensor-nd.md").read_text()
    rows = [
        [c.strip() for c in line.strip("|").split("|")]
        for line in text.splitlines()
        if line.startswith("| ≈")
    ]
    rows = [r for r in rows if len(r) == 6]
    assert len(rows) == 4
    spec = device_spec_named("v5p")
    for model, chips, *ranked, ratio in rows:
        lines = whole_step_lines(models[model], {"targets": 4096}, int(chips), int(chips), spec)
        printed = [x.split() for x in lines[2:5]]
        assert [c.split()[0] for c in ranked] == [label[p[0]] for p in printed]
        for cell, p in zip(ranked, printed, strict=True):
            assert int(cell.split()[1]) == pytest.approx(float(p[2]), abs=0.6)
        step = {p[0]: float(p[2]) for p in printed}
        assert float(ratio) == pytest.approx(step["tensor_3d"] / step["summa_2d"], abs=0.006)
