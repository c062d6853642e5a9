"""The T5 train step compiled by the real TPU compiler for a v5e:2x2 slice, on this CPU machine.

libtpu (the `[tpu]` extra) gives compile-only TPU devices; the mesh is built over them and the
sharded train step is lowered and compiled ahead of time. Runs in a fresh process so the TPU
plugin never meets the test session's fake CPU devices.
"""

import textwrap

import pytest
from conftest import tpu_compile_result

from t5lite.insight.topology import libtpu_available, num_devices

pytestmark = pytest.mark.skipif(
    not libtpu_available(), reason='libtpu not installed (pip install -e ".[tpu]")'
)

_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from t5lite.insight import report as rep
    from t5lite.insight.topology import get_topology
    from t5lite.model.models import EncoderDecoderModel
    from t5lite.model.network import T5Config
    from t5lite.partitioning import Partitioner, create_mesh, standard_logical_axis_rules
    from t5lite.trainer import Trainer

    topo = get_topology("v5e:2x2")
    cfg = T5Config(vocab_size=512, emb_dim=128, num_heads=4, head_dim=32, mlp_dim=512,
                   num_encoder_layers=2, num_decoder_layers=2, dtype="bfloat16")
    out = {"devices": len(topo.devices), "kind": topo.spec.device_kind,
           "hbm": topo.spec.memory_bytes}
    for name, dims in (("megatron", (1, 1)), ("fsdp", (1, 2))):
        part = Partitioner(create_mesh(2, devices=topo.devices),
                           logical_axis_rules=standard_logical_axis_rules(*dims))
        tr = Trainer(EncoderDecoderModel(network_config=cfg), part, batch_size=8,
                     lengths={"inputs": 32, "targets": 32})
        s = rep.step_report(tr, device=topo.spec)
        out[name] = {"platform": part.mesh.devices.flat[0].platform, "memory": s.memory.total,
                     "fits": s.memory.fits, "arguments": s.memory.arguments,
                     "state": s.predicted.state, "flops": s.flops,
                     "step_seconds": s.step_seconds,
                     "counts": {f"{r.kind} {r.axes_str}": r.count for r in s.collectives}}
    print("RESULT " + json.dumps(out))
    """
)


def test_t5_train_step_compiles_for_v5e_2x2_megatron_and_fsdp():
    assert num_devices("v5e:2x2") == 4
    r = tpu_compile_result(_SCRIPT)
    assert r["devices"] == 4 and r["kind"] == "TPU v5 lite" and r["hbm"] == 16 * 2**30
    for name in ("megatron", "fsdp"):
        x = r[name]
        assert x["platform"] == "tpu"
        assert x["fits"] and 0 < x["memory"] < 16 * 2**30
        assert x["arguments"] >= x["state"] > 0 and x["flops"] > 0 and x["step_seconds"] > 0
        # Megatron blocks all-reduce over `model`; the gradients are reduced over `data`.
        assert x["counts"].get("all-reduce model", 0) >= 2 * (2 + 3 * 2), x["counts"]
        assert any(k.endswith(" data") and "all-gather" not in k for k in x["counts"]), x
    # FSDP gathers its data-sharded weights before use; Megatron never does over `data`.
    assert r["fsdp"]["counts"].get("all-gather data", 0) > 0, r["fsdp"]["counts"]
    assert "all-gather data" not in r["megatron"]["counts"]
    # Splitting the weights over `data` too leaves less train state on each chip.
    assert r["fsdp"]["state"] < r["megatron"]["state"]


def test_unknown_topology_is_a_clear_error():
    from t5lite.insight.topology import TopologyError, get_topology

    with pytest.raises(TopologyError, match=r"expected \[SLICESx\]GENERATION:AxB"):
        get_topology("v99:2x2")
