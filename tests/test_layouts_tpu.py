"""FSDP gradients are reduce-scattered: the TPU compiler's view (ahead of time, on this CPU).

t5lite gathers each FSDP kernel over `data` inside its layer's shard_map
(t5lite/collectives.py), so the gradient's transpose is a reduce-scatter in the program itself;
XLA:TPU emits each as a `reduce-scatter` instruction (emitter SingleInputAllReduceScatterFusion).
A reduce-scatter the SPMD partitioner writes (all-reduce + dynamic-slice to the device's shard)
becomes an `all-reduce-scatter` fusion instead, whose operands are the per-device partial
gradients and whose results the shards; this test accepts either spelling. It compiles the FSDP
train step for v5e:2x4 (data=4 x model=2) and checks that every weight gradient split over
`data` leaves through exactly one such reduce-scatter, with ZeRO-3's volume.
"""

import math
import textwrap

import pytest
from conftest import tpu_compile_result

from t5lite.insight.topology import libtpu_available

pytestmark = pytest.mark.skipif(
    not libtpu_available(), reason='libtpu not installed (pip install -e ".[tpu]")'
)

_SCRIPT = textwrap.dedent(
    """
    import json, re
    import jax
    from t5lite.insight.hlo import _ARRAY_RE, _parse_groups, parse_collectives
    from t5lite.insight.topology import get_topology
    from t5lite.model import optimizers
    from t5lite.model.models import EncoderDecoderModel
    from t5lite.model.network import T5Config
    from t5lite.partitioning import Partitioner, create_mesh, preset_rules
    from t5lite.pytree import path_str
    from t5lite.trainer import Trainer

    topo = get_topology("v5e:2x4")
    mesh = create_mesh(2, devices=topo.devices)
    part = Partitioner(mesh, logical_axis_rules=preset_rules("fsdp"))
    cfg = T5Config(vocab_size=128, emb_dim=64, num_heads=4, head_dim=32, mlp_dim=256,
                   num_encoder_layers=1, num_decoder_layers=1, dtype="float32")
    tr = Trainer(EncoderDecoderModel(cfg, optimizer=optimizers.AdamW(1e-3)), part,
                 batch_size=8, lengths={"inputs": 4, "targets": 4})
    batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=tr.batch_shardings[k])
             for k, v in tr.batch_abstract.items()}
    with part.context():
        hlo = tr.train_step.lower(tr.abstract_state(), batch).compile().as_text()
    defs = {m.group(1): m.group(2) for m in re.finditer(
        r"^\\s*(?:ROOT\\s+)?%([\\w.\\-]+)\\s*=\\s*(.+?)\\s+[\\w\\-]+\\(", hlo, re.M)}
    def dims(text):
        return [[int(d) for d in s.split(",") if d] for _, s in _ARRAY_RE.findall(text)]
    scatters = []  # {"in": operand shapes, "out": result shapes, "groups": replica groups}
    pat = r"^%(all-reduce-scatter[\\w.]*) \\((.*?)\\) -> (.*?) \\{\\n(.*?)^\\}"
    for m in re.finditer(pat, hlo, re.M | re.S):  # the partitioner's, fused
        groups = re.search(r"replica_groups=(\\S+?),? ", m.group(4)).group(1)
        scatters.append({"in": dims(m.group(2)), "out": dims(m.group(3)),
                         "groups": [list(g) for g in _parse_groups(groups)]})
    pat = (r"^\\s*%\\S+ = (.+?) reduce-scatter(?:-start)?\\(%([\\w.\\-]+)\\)"
           r".*?replica_groups=(\\S+?),? ")
    for m in re.finditer(pat, hlo, re.M):  # written by a shard_map
        scatters.append({"in": dims(defs[m.group(2)]), "out": dims(m.group(1)),
                         "groups": [list(g) for g in _parse_groups(m.group(3))]})
    placements = jax.tree_util.tree_leaves(
        part.placements(tr.state_abstract.params, tr.params_axes),
        is_leaf=lambda x: hasattr(x, "shard_shape"))
    params = [{"path": p.path, "shape": list(p.shape), "shard": list(p.shard_shape),
               "spec": [e if e is None or isinstance(e, str) else list(e) for e in p.spec]}
              for p in placements]
    collectives = [{"kind": c.kind, "bytes": c.bytes, "axes": c.axes}
                   for c in parse_collectives(hlo, mesh)]
    print("RESULT " + json.dumps({"scatters": scatters, "params": params,
                                  "collectives": collectives}))
    """
)


def _sorted(shape):
    return tuple(sorted(shape))


def test_fsdp_weight_gradients_are_reduce_scattered_on_tpu():
    r = tpu_compile_result(_SCRIPT)
    data, model = 4, 2
    # Every weight matrix split over `data` by the rules (embed -> data), except the token
    # embedding: its gradient is a scatter-add of looked-up rows, which XLA computes from the
    # gathered lookups instead of reducing a [V, D] partial sum.
    kernels = [p for p in r["params"] if len(p["shape"]) >= 2 and "data" in p["spec"]
               and not p["path"].startswith("token_embedder")]  # fmt: skip
    assert len(kernels) == 19  # 3 attentions x (q, k, v, out), 2 MLPs x (wi_0, wi_1, wo), logits
    # One reduce-scatter per kernel over `data`: groups of 4 devices that differ only in their
    # `data` index (model = 2 is the fast axis).
    scatters = r["scatters"]
    assert all(sorted(map(sorted, x["groups"])) == [[0, 2, 4, 6], [1, 3, 5, 7]] for x in scatters)
    ins = [tuple(s) for x in scatters for s in x["in"]]
    outs = [tuple(s) for x in scatters for s in x["out"]]
    # Their results are exactly the shards the rules give those gradients, their operands the
    # per-device partial sums (whole over `data`, split over `model` as the weight is); XLA may
    # lay a kernel out transposed.
    assert sorted(map(_sorted, outs)) == sorted(_sorted(p["shard"]) for p in kernels)
    per_model = [[n // model if e == "model" else n for n, e in zip(p["shape"], p["spec"])]
                 for p in kernels]  # fmt: skip
    assert sorted(map(_sorted, ins)) == sorted(map(_sorted, per_model))
    # ZeRO-3's gradient volume: a reduce-scatter over d devices sends and receives (d-1)/d of
    # its operand, here each device's model shard of every weight, once (an all-reduce moves
    # twice that); its results are 1/d of the operands.
    weights_per_model_shard = sum(math.prod(p["shape"]) // model for p in kernels)
    assert sum(math.prod(s) for s in ins) == weights_per_model_shard
    assert sum(math.prod(s) for s in outs) * data == weights_per_model_shard
    # insight/hlo.py reads them as what they are: reduce-scatters over `data` whose results are
    # the fp32 shards, not all-reduces of the whole operands.
    read = [c for c in r["collectives"] if c["kind"] == "reduce-scatter"]
    assert all(c["axes"] == ["data"] for c in read) and len(read) == len(scatters)
    assert sum(c["bytes"] for c in read) == 4 * weights_per_model_shard // data
    whole = 4 * weights_per_model_shard
    assert not any(c["kind"] == "all-reduce" and c["bytes"] >= whole for c in r["collectives"])
