"""`predict_memory` of scanned layers on a v5p megacore against the TPU compiler's own figures,
ahead of time on this CPU (libtpu, the `[tpu]` extra).

The test-size decoder-only model (`accuracy.accuracy_trainer`), Megatron, no remat, bf16 with
fp32 masters, layers scanned, compiled for v5p:2x2x2 with libtpu's log read back: the scan's
residuals stacked in HBM beside the logits and the scalar slots make the HLO temp allocation,
and `memory_analysis` adds its fragmentation again (`tpu_memory.scanned_megacore`); and, without
compiling, T5's predictions against the compiled figures recorded in docs/performance.md, where
every preset's figures are. Each runs in a fresh process so the TPU plugin never meets the test
session's fake CPU devices.
"""

import textwrap

import pytest
from conftest import tpu_compile_result

from t5lite.insight.topology import libtpu_available

pytestmark = pytest.mark.skipif(
    not libtpu_available(), reason='libtpu not installed (pip install -e ".[tpu]")'
)

_LOGGED_SCRIPT = textwrap.dedent(
    """
    import json, os, re, tempfile
    os.environ["TPU_MIN_LOG_LEVEL"] = os.environ["TPU_STDERR_LOG_LEVEL"] = "0"
    from t5lite.insight import accuracy, memory
    from t5lite.insight.meshes import partitioner_on
    from t5lite.insight.report import compile_train_step
    from t5lite.insight.topology import get_topology
    from t5lite.trainer import Trainer

    policy = "params=bfloat16,compute=bfloat16,output=float32"
    tr = accuracy.accuracy_trainer("lm", PRESET, "none", precision=policy)
    part = partitioner_on(tr.partitioner, get_topology("v5p:2x2x2").devices)
    tr = Trainer(tr.model, part, batch_size=tr.batch_size, lengths=tr.lengths)
    log = tempfile.TemporaryFile("w+")
    saved = os.dup(2)
    os.dup2(log.fileno(), 2)
    try:
        compiled = memory.memory_report(compile_train_step(tr))
    finally:
        os.dup2(saved, 2)
    log.seek(0)
    hbm = log.read().split("Program hbm requirement", 1)[1]
    heap, frag = re.search(r"HLO temp +([\\d.]+)M .*fragmentation \\(([\\d.]+)M\\)", hbm).groups()
    predicted = memory.predict_memory(tr)
    print("RESULT " + json.dumps({
        "kind": part.mesh.devices.flat[0].device_kind,
        "compiled": compiled.total, "temporaries": compiled.temporaries,
        "heap": float(heap) * 2**20, "fragmentation": float(frag) * 2**20,
        "predicted": predicted.total, "activations": predicted.activations,
        "terms": dict(predicted.terms),
    }))
    """
)


def logged_v5p_script(preset: str) -> str:
    """The script compiling the test-size decoder-only model (`preset`, no remat, bf16 with fp32
    masters, scanned) for v5p:2x2x2 with libtpu's log read back: its "Program hbm requirement"
    gives the HLO temp allocation and its fragmentation. Shared with test_ring_tpu_memory.py."""
    return _LOGGED_SCRIPT.replace("PRESET", repr(preset))


def test_scanned_layers_memory_on_v5p_counts_stacks_and_fragmentation():
    r = tpu_compile_result(logged_v5p_script("megatron"), host_devices=8, timeout=600)
    assert r["kind"] == "TPU v5", r  # a v5p chip: a megacore
    # memory_analysis' temporaries: libtpu's HLO temp allocation plus its fragmentation again
    # (the log's figures are rounded to 0.01 MiB).
    assert abs(r["temporaries"] - r["heap"] - r["fragmentation"]) < 0.02 * 2**20, r
    terms = r["terms"]
    # The heap: every stacked residual, the fp32 logits and the scalar slots, side by side.
    heap = terms["saved activations"] + terms["loss temporaries"] + terms["parameter scalars"]
    heap += terms["loop scalars"]
    assert abs(heap / r["heap"] - 1) < 0.05, r
    assert abs(terms["heap fragmentation"] / r["fragmentation"] - 1) < 0.05, r
    assert abs(r["activations"] / r["temporaries"] - 1) < 0.05, r
    assert abs(r["predicted"] / r["compiled"] - 1) < 0.05, r


# The encoder-decoder's rows of docs/performance.md that hold a logits-sized value through the
# backward (tpu_memory.held_logits), predicted (no compile) against their compiled figures
# recorded there (v5p:2x2x2, libtpu 0.0.42.1, MiB), and Megatron's, which holds none.
_RECORDED = {
    ("fully_sharded", "none", "bf16"): 99.10,
    ("activations_2d", "none", "bf16"): 111.17,
    ("fsdp", "none", "bf16"): 117.50,
    ("megatron", "full", "bf16"): 60.38,
}
_PREDICT_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from t5lite.insight import accuracy, memory
    from t5lite.insight.meshes import partitioner_on
    from t5lite.insight.topology import get_topology
    from t5lite.trainer import Trainer

    policy = "params=bfloat16,compute=bfloat16,output=float32"
    devices = get_topology("v5p:2x2x2").devices
    out = []
    for preset, remat, _ in json.loads(sys.argv[1]):
        tr = accuracy.accuracy_trainer("t5", preset, remat, precision=policy)
        part = partitioner_on(tr.partitioner, devices)
        tr = Trainer(tr.model, part, batch_size=tr.batch_size, lengths=tr.lengths)
        p = memory.predict_memory(tr)
        out.append({"total": p.total, "terms": dict(p.terms)})
    print("RESULT " + json.dumps(out))
    """
)


def test_scanned_t5_on_v5p_holds_a_logits_sized_value_through_the_backward():
    import json

    cases = list(_RECORDED)
    r = dict(zip(cases, tpu_compile_result(_PREDICT_SCRIPT, json.dumps(cases), host_devices=8)))
    logits = 4 * 2**20  # the fp32 [8, 64, 2048] logits a device
    loss = {case: r[case]["terms"]["loss temporaries"] for case in cases}
    # FSDP's and fully sharded's bf16 cotangent, 2D activations' fp32 logits, Megatron's none.
    assert loss[("fsdp", "none", "bf16")] == loss[("fully_sharded", "none", "bf16")] == 1.5 * logits
    assert loss[("activations_2d", "none", "bf16")] == 2 * logits
    assert loss[("megatron", "full", "bf16")] == logits
    # The loop slots are the residual stacks': none under `full`.
    assert r[("megatron", "full", "bf16")]["terms"]["loop scalars"] == 0
    assert r[("fsdp", "none", "bf16")]["terms"]["loop scalars"] > 0
    for case, mib in _RECORDED.items():
        assert abs(r[case]["total"] / (mib * 2**20) - 1) < 0.10, (case, r[case])
