"""`predict_memory` of scanned layers on a v5p megacore against the TPU compiler's own figures,
ahead of time on this CPU (libtpu, the `[tpu]` extra).

The test-size decoder-only model (`accuracy.accuracy_trainer`), Megatron, no remat, bf16 with
fp32 masters, layers scanned, compiled for v5p:2x2x2 with libtpu's log read back: the scan's
residuals stacked in HBM beside the logits and the scalar slots make the HLO temp allocation,
and `memory_analysis` adds its fragmentation again (`tpu_memory.scanned_megacore`). The
figures of every preset are in docs/performance.md. It runs in a fresh process so the TPU
plugin never meets the test session's fake CPU devices.
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
