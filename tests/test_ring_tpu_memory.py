"""`predict_memory` of ring attention (`context_parallel_ring`) on a v5p megacore against the TPU
compiler's own figure, ahead of time on this CPU (libtpu, the `[tpu]` extra).

The test-size decoder-only model (`accuracy.accuracy_trainer`), layers unrolled, fp32 (libtpu
refuses the unrolled ring in bf16), compiled for v5p:2x2x2: its peak is the update, where the
vocabulary-sized gradients and one's reduced copy are in HBM (`tpu_memory.ring_update`)
beside each ring step's small values' slots (`tpu_memory.ring_slots`), and each step adds
kernels (`tpu_memory.code_bytes`). v5e's ring is checked in tests/test_tpu_memory_v5p.py; the
figures are in docs/performance.md. Scanned (bf16), the heap holds the scan's stacks, the logits,
the ring's buffers and the slots side by side, and its fragmentation is counted twice
(`tpu_memory.scanned_megacore`). Each runs in a fresh process so the TPU plugin never meets the
test session's fake CPU devices.
"""

import textwrap

import pytest
from conftest import tpu_compile_result
from test_tpu_memory_v5p_scanned import logged_v5p_script

from t5lite.insight.topology import libtpu_available

pytestmark = pytest.mark.skipif(
    not libtpu_available(), reason='libtpu not installed (pip install -e ".[tpu]")'
)

# Compiles one program and prints XLA:TPU's figures beside the prediction.
_SCRIPT = textwrap.dedent(
    """
    import json
    from t5lite.insight import accuracy, memory
    from t5lite.insight.meshes import partitioner_on
    from t5lite.insight.report import compile_train_step
    from t5lite.insight.topology import get_topology
    from t5lite.trainer import Trainer

    tr = accuracy.accuracy_trainer("lm", "context_parallel_ring", "none", scan=False)
    part = partitioner_on(tr.partitioner, get_topology("v5p:2x2x2").devices)
    tr = Trainer(tr.model, part, batch_size=tr.batch_size, lengths=tr.lengths)
    compiled = memory.memory_report(compile_train_step(tr))
    predicted = memory.predict_memory(tr)
    print("RESULT " + json.dumps({
        "kind": part.mesh.devices.flat[0].device_kind, "compiled": compiled.total,
        "aliased": compiled.aliased, "code": compiled.generated_code,
        "predicted": predicted.total, "state": predicted.state,
        "predicted_code": predicted.code, "gradients": predicted.gradients,
    }))
    """
)


def test_ring_attention_memory_on_v5p_within_ten_percent():
    # accuracy_trainer builds its mesh over host devices first (then moved onto the slice's).
    r = tpu_compile_result(_SCRIPT, host_devices=8, timeout=600)
    assert r["kind"] == "TPU v5", r  # a v5p chip: a megacore
    # The train state is exact but for the tiles' padding of the smallest arrays.
    assert 0 <= r["aliased"] - r["state"] < r["state"] // 1000, r
    # The peak is the update: the gradients beyond VMEM are in the prediction.
    assert r["gradients"] > 0, r
    # Each ring step's kernels, forward and backward, at v5p's size a step.
    assert abs(r["predicted_code"] / r["code"] - 1) < 0.10, r
    assert abs(r["predicted"] / r["compiled"] - 1) < 0.10, r


def test_scanned_ring_counts_its_heap_fragmentation_twice_on_v5p():
    # The scanned ring in bf16 (fp32 masters), with libtpu's log read back.
    r = tpu_compile_result(logged_v5p_script("context_parallel_ring"), host_devices=8, timeout=600)
    # memory_analysis' temporaries are libtpu's HLO temp allocation plus its fragmentation
    # again (the log's figures are rounded to 0.01 MiB).
    assert abs(r["temporaries"] - r["heap"] - r["fragmentation"]) < 0.02 * 2**20, r
    # The peak is the backward's: the heap (stacks, logits, the ring's buffers and the slots side
    # by side) and its extent less the bytes live at its peak, each as libtpu's log has them.
    heap = r["activations"] - r["terms"]["heap fragmentation"]
    assert abs(heap / r["heap"] - 1) < 0.05, r
    assert abs(r["terms"]["heap fragmentation"] / r["fragmentation"] - 1) < 0.05, r
    assert abs(r["activations"] / r["temporaries"] - 1) < 0.05, r
    assert abs(r["predicted"] / r["compiled"] - 1) < 0.05, r
