"""The `data` row of FSDP T5's communication (configs/inspect.gin's layout, tiny): every
collective over `data`, part of it or `data+model` explained per kind, count and bytes.

T5.1.1 under the `fsdp` rules (embed -> data; heads, mlp, vocab -> model) on data=4 x model=2.
What the compiled step sends over `data`, derived by hand below from the shapes:
  - dense kernels: gathered once (kept for the backward pass), gradients reduce-scattered;
  - norm scales [D]: gathered forward and backward by the partitioner, gradients all-reduced;
  - the token embedding [V/2, D/4]: never gathered; each lookup all-to-alls [B/4, L, D]
    forward and its cotangent back, and the token ids reach every device through a permute
    over data+model and an all-gather over data/2 (then one over model);
  - the relative-position bias: its gradient [H/2, L, L] all-reduced in each layer.
"""

import collections

import pytest
from conftest import require_devices

from t5lite.insight import communication
from t5lite.insight import comparison as comparisons
from t5lite.insight.hlo import collective_ops, parse_collectives
from t5lite.insight.report import compile_train_step
from t5lite.insight.sharding import sharding_report
from t5lite.model.models import EncoderDecoderModel
from t5lite.model.network import T5Config
from t5lite.partitioning import Partitioner, create_mesh, preset_rules
from t5lite.trainer import Trainer

V, D, H, K, F = 256, 64, 4, 16, 128  # vocab, width, heads, head width, MLP width
ENC, DEC = 2, 2  # layers
B, LI, LT = 8, 16, 8  # batch, input and target lengths
DATA, MODEL = 4, 2


def _compare(scan_layers: bool = False):
    require_devices(8)
    cfg = T5Config(vocab_size=V, emb_dim=D, num_heads=H, head_dim=K, mlp_dim=F,
                   num_encoder_layers=ENC, num_decoder_layers=DEC,
                   scan_layers=scan_layers)  # fmt: skip
    part = Partitioner(create_mesh(MODEL), logical_axis_rules=preset_rules("fsdp"))
    tr = Trainer(EncoderDecoderModel(network_config=cfg), part, batch_size=B,
                 lengths={"inputs": LI, "targets": LT})  # fmt: skip
    assert dict(part.mesh.shape) == {"data": DATA, "model": MODEL}
    collectives = parse_collectives(compile_train_step(tr).as_text(), part.mesh)
    report = sharding_report(part, tr.abstract_state().params, tr.params_axes)
    analytic = communication.analytic_communication(tr, report)
    rows = communication.collective_rows(collectives)
    return {c.axes: c for c in comparisons.compare_communication(rows, analytic)}


@pytest.fixture(scope="module")
def comparison():
    return _compare()


def _kinds(cmp):
    return {k: (n, b, m, e) for k, n, b, m, e in cmp.kinds}


def test_data_row_explained_kind_by_kind(comparison):
    f32 = 4
    # Kernels, gathered over data (result: the model shard): per encoder layer q, k, v, out
    # [D, H/2, K] and wi_0, wi_1, wo [D, F/2]; a decoder layer has cross-attention's four more;
    # the logits [D, V/2].
    attn, mlp = D * H // MODEL * K * f32, D * F // MODEL * f32
    kernels = ENC * (4 * attn + 3 * mlp) + DEC * (8 * attn + 3 * mlp) + D * V // MODEL * f32
    n_kernels = ENC * 7 + DEC * 11 + 1
    norms, n_norms = D * f32, ENC * 2 + 1 + DEC * 3 + 1  # per layer, plus each stack's final
    relpos = (ENC * LI * LI + DEC * LT * LT) * H // MODEL * f32
    lookups = 2 * (B // DATA) * (LI + LT) * D * f32  # forward and backward, per stack
    kinds = _kinds(comparison[("data",)])
    # Explained (the third and fourth figures) exactly as derived, and compiled the same.
    assert kinds["all-gather"] == (n_kernels + 2 * n_norms, kernels + 2 * n_norms * norms) * 2
    assert kinds["reduce-scatter"] == (n_kernels, kernels // DATA) * 2
    assert kinds["all-to-all"] == (4, lookups) * 2
    # All-reduces: one per layer for the bias, one per norm scale; XLA combines them (with the
    # loss's scalar sums), so fewer ops, the same bytes plus those scalars.
    n, got, m, want = kinds["all-reduce"]
    assert (m, want) == (ENC + DEC + n_norms, relpos + n_norms * norms)
    assert n <= m and want <= got <= want + 1024, kinds["all-reduce"]
    cmp = comparison[("data",)]
    assert cmp.agrees and abs(cmp.ratio - 1) < 0.01, cmp
    assert set(cmp.differences) == {
        "the norm scales' gradients all-reduced instead of reduce-scattered (each device then "
        "keeps its slice)",
        "2D parameters gathered once and kept for the backward pass (memory traded for "
        "communication)",
    }


def test_token_ids_rows_explained(comparison):
    ids = (B // DATA) * (LI + LT) * 4  # one device's int32 ids, both lookups
    permute = comparison[("data", "model")]
    assert permute.agrees and permute.differences == (
        "token ids regrouped for the lookup (one permute per lookup)",
    )
    assert _kinds(permute) == {"collective-permute": (2, ids, 2, ids)}
    half = comparison[("data/2",)]
    assert half.agrees and half.differences == (
        "token ids gathered for the lookup over part of the batch axis",
    )
    assert _kinds(half) == {"all-gather": (2, 2 * ids, 2, 2 * ids)}


def test_scanned_stacks_count_every_layer():
    """With scan_layers the kernels' collectives sit in the loop bodies: counted once per
    iteration (the compiled loops' trip counts), and the analytic side counts a stacked
    parameter once per layer, so both say one reduce-scatter per kernel per step as unscanned."""
    f32 = 4
    attn, mlp = D * H // MODEL * K * f32, D * F // MODEL * f32
    kernels = ENC * (4 * attn + 3 * mlp) + DEC * (8 * attn + 3 * mlp) + D * V // MODEL * f32
    n_kernels = ENC * 7 + DEC * 11 + 1
    cmp = _compare(scan_layers=True)[("data",)]
    assert _kinds(cmp)["reduce-scatter"] == (n_kernels, kernels // DATA) * 2
    assert cmp.agrees, cmp


def test_loop_bodies_run_their_trip_count():
    """A collective in a while body counts once per iteration, nested loops multiply, and a
    computation a body calls runs as often as the body."""
    hlo = "\n".join([
        "%callee (p: f32[4]) -> f32[4] {",
        "  ROOT %ar = f32[4]{0} all-reduce(f32[4]{0} %p), replica_groups={{0,1}}",
        "}",
        "%inner (p: (s32[], f32[4])) -> (s32[], f32[4]) {",
        "  %rs = f32[2]{0} reduce-scatter(f32[4]{0} %x), replica_groups={{0,1}}, dimensions={0}",
        "  %f = f32[4]{0} fusion(f32[4]{0} %x), kind=kCustom, calls=%callee",
        "}",
        "%outer (p: (s32[], f32[4])) -> (s32[], f32[4]) {",
        "  %ag = f32[8]{0} all-gather(f32[4]{0} %x), replica_groups={{0,1}}, dimensions={0}",
        "  %w = (s32[], f32[4]) while(%t), condition=%c2, body=%inner,"
        ' backend_config={"known_trip_count":{"n":"3"}}',
        "}",
        "ENTRY %main (p0: f32[4]) -> f32[4] {",
        "  %w0 = (s32[], f32[4]) while(%t0), condition=%c1, body=%outer,"
        ' backend_config={"known_trip_count":{"n":"2"}}',
        "  %top = f32[4]{0} all-reduce(f32[4]{0} %p0), replica_groups={{0,1}}",
        "}",
    ])  # fmt: skip
    runs = {op.name: op.runs for op in collective_ops(hlo)}
    assert runs == {"ar": 6, "rs": 6, "ag": 2, "top": 1}
    kinds = collections.Counter(c.kind for c in parse_collectives(hlo))
    assert kinds == {"all-reduce": 7, "reduce-scatter": 6, "all-gather": 2}
