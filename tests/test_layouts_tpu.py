"""FSDP gradients are reduce-scattered: the TPU compiler's view (ahead of time, on this CPU).

XLA's SPMD partitioner writes a reduce-scatter as all-reduce + dynamic-slice to the device's
shard. XLA:CPU keeps it that way (it has no reduce-scatter creator; tests/test_layouts.py). The
TPU compiler fuses the pair into an `all-reduce-scatter` fusion (strategy ReduceScatterFusion):
its operands are the per-device partial gradients, its results the shards. This test compiles
the FSDP train step for v5e:2x4 (data=4 x model=2) and checks that every weight gradient split
over `data` leaves through exactly such a reduce-scatter, with ZeRO-3's volume.
"""

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest

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
    fusions = []
    pat = r"^%(all-reduce-scatter[\\w.]*) \\((.*?)\\) -> (.*?) \\{\\n(.*?)^\\}"
    for m in re.finditer(pat, hlo, re.M | re.S):
        groups = re.search(r"replica_groups=(\\S+?),? ", m.group(4)).group(1)
        fusions.append({
            "in": [[int(d) for d in s.split(",") if d] for _, s in _ARRAY_RE.findall(m.group(2))],
            "out": [[int(d) for d in s.split(",") if d] for _, s in _ARRAY_RE.findall(m.group(3))],
            "groups": [list(g) for g in _parse_groups(groups)],
        })
    placements = jax.tree_util.tree_leaves(
        part.placements(tr.state_abstract.params, tr.params_axes),
        is_leaf=lambda x: hasattr(x, "shard_shape"))
    params = [{"path": p.path, "shape": list(p.shape), "shard": list(p.shard_shape),
               "spec": [e if e is None or isinstance(e, str) else list(e) for e in p.spec]}
              for p in placements]
    collectives = [{"kind": c.kind, "bytes": c.bytes, "axes": c.axes}
                   for c in parse_collectives(hlo, mesh)]
    print("RESULT " + json.dumps({"fusions": fusions, "params": params,
                                  "collectives": collectives}))
    """
)


def test_fsdp_weight_gradients_are_reduce_scattered_on_tpu():
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["JAX_PLATFORMS"] = "cpu"  # the host backend; TPU devices come from the topology alone
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    r = json.loads(line.removeprefix("RESULT "))
    data, model = 4, 2
    # Every weight matrix split over `data` by the rules (embed -> data), except the token
    # embedding: its gradient is a scatter-add of looked-up rows, which XLA computes from the
    # gathered lookups instead of reducing a [V, D] partial sum.
    kernels = [p for p in r["params"] if len(p["shape"]) >= 2 and "data" in p["spec"]
               and not p["path"].startswith("token_embedder")]  # fmt: skip
    assert len(kernels) == 19  # 3 attentions x (q, k, v, out), 2 MLPs x (wi_0, wi_1, wo), logits
    (fusion,) = r["fusions"]  # one fused reduce-scatter for all of them, over `data`
    # Groups of 4 devices that differ only in their `data` index (model = 2 is the fast axis).
    assert sorted(map(sorted, fusion["groups"])) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    # Its results are exactly the shards the rules give those gradients; its operands the
    # per-device partial sums (whole over `data`, split over `model` as the weight is).
    assert sorted(map(tuple, fusion["out"])) == sorted(tuple(p["shard"]) for p in kernels)
    per_model = [[n // model if e == "model" else n for n, e in zip(p["shape"], p["spec"])]
                 for p in kernels]  # fmt: skip
    assert sorted(map(tuple, fusion["in"])) == sorted(map(tuple, per_model))
    # ZeRO-3's gradient volume: a reduce-scatter over d devices sends and receives (d-1)/d of
    # its operand, here each device's model shard of every weight, once (an all-reduce moves
    # twice that); its results are 1/d of the operands.
    weights_per_model_shard = sum(math.prod(p["shape"]) // model for p in kernels)
    assert sum(math.prod(s) for s in fusion["in"]) == weights_per_model_shard
    assert sum(math.prod(s) for s in fusion["out"]) * data == weights_per_model_shard
    # insight/hlo.py reads the fusion as what it is: one reduce-scatter over `data` whose
    # result is the fusion's (the fp32 shards), not an all-reduce of the whole operands.
    scatters = [c for c in r["collectives"] if c["kind"] == "reduce-scatter"]
    assert scatters == [{"kind": "reduce-scatter", "bytes": 4 * weights_per_model_shard // data,
                         "axes": ["data"]}]  # fmt: skip
    whole = 4 * weights_per_model_shard
    assert not any(c["kind"] == "all-reduce" and c["bytes"] >= whole for c in r["collectives"])
