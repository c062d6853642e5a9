"""`predict_memory` for XLA:TPU against the TPU compiler's own figure, ahead of time on this CPU.

libtpu (the `[tpu]` extra) compiles the train step of `accuracy.accuracy_trainer`'s test-size
models for a v5e:2x4 slice (data=2 x model=4, data=8 without model parallelism); the analytic
prediction, which models XLA:TPU (`tpu_memory`: bf16 dots, fused elementwise work, in-place
gradient reduction, the executable in HBM), must be within 10% of `memory_analysis()`'s total.
The whole matrix is `benchmarks/memory_accuracy.py --topology v5e:2x4` (docs/performance.md).
Runs in a fresh process so the TPU plugin never meets the test session's fake CPU devices.
test_tpu_memory_v5p.py (v5p, ring attention) and test_tpu_memory_moe.py (unrolled MoE) check
more programs with this file's runner, each file on its own `--dist loadfile` worker.
"""

import json
import textwrap

import pytest
from conftest import tpu_compile_result

from t5lite.insight.topology import libtpu_available

pytestmark = pytest.mark.skipif(
    not libtpu_available(), reason='libtpu not installed (pip install -e ".[tpu]")'
)

BF16 = "params=bfloat16,compute=bfloat16,output=float32"
BF16_MASTERS = BF16 + ",master=bfloat16"
# (family, preset, remat, precision[, scanned, experts, dispatch, topology]), layers unrolled as
# shipped, on v5e:2x4 unless named:
# both families, each policy and remat policy once, Megatron, FSDP, data parallel and context
# parallelism (whose gathered keys and values add code to every block:
# tpu_memory.gathers_in_blocks); and scanned: a dense model, and a mixture of experts whose
# stacked values and gradients stay in HBM (tpu_moe_memory).
_CASES = [
    ("t5", "megatron", "none", BF16),
    ("lm", "fsdp", "full", "float32"),
    ("lm", "data_parallel", "minimal", BF16_MASTERS),
    ("lm", "context_parallel", "full", BF16_MASTERS),
    ("lm", "fully_sharded", "full", BF16, True),
    ("lm", "megatron", "full", "float32", True, 4, "capacity"),
]
_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from t5lite.insight import accuracy, memory
    from t5lite.insight.meshes import partitioner_on
    from t5lite.insight.report import compile_train_step
    from t5lite.insight.topology import get_topology
    from t5lite.trainer import Trainer

    out = []
    for fam, preset, remat, precision, *more in json.loads(sys.argv[1]):
        scan, experts, dispatch, topology = more + [False, 0, "capacity", "v5e:2x4"][len(more):]
        topo = get_topology(topology)
        tr = accuracy.accuracy_trainer(
            fam, preset, remat, scan=scan, precision=precision, experts=experts,
            dispatch=dispatch,
        )
        part = partitioner_on(tr.partitioner, topo.devices)
        tr = Trainer(tr.model, part, batch_size=tr.batch_size, lengths=tr.lengths)
        compiled = memory.memory_report(compile_train_step(tr))
        predicted = memory.predict_memory(tr)
        out.append({"platform": part.mesh.devices.flat[0].platform,
                    "compiled": compiled.total, "aliased": compiled.aliased,
                    "code": compiled.generated_code, "predicted": predicted.total,
                    "state": predicted.state, "predicted_code": predicted.code})
    print("RESULT " + json.dumps(out))
    """
)


def _compile_and_predict(cases: list) -> list[dict]:
    # accuracy_trainer builds its mesh over host devices first (then moved onto the slice's).
    return tpu_compile_result(_SCRIPT, json.dumps(cases), host_devices=8, timeout=600)


def _check_within_ten_percent(cases: list) -> None:
    for case, r in zip(cases, _compile_and_predict(cases)):
        assert r["platform"] == "tpu"
        # The train state is exact but for the tiles' padding of the smallest arrays (scalars
        # take 512 bytes in HBM): the donated buffers the new state aliases.
        assert 0 <= r["aliased"] - r["state"] < r["state"] // 1000, (case, r)
        # The executable is counted and estimated (a fixed part and each unrolled block's).
        assert abs(r["predicted_code"] / r["code"] - 1) < 0.35, (case, r)
        ratio = r["predicted"] / r["compiled"]
        assert abs(ratio - 1) < 0.10, (case, ratio, r)


def test_predicted_memory_within_ten_percent_on_tpu():
    _check_within_ten_percent(_CASES)


# Scanned FSDP programs' compiled totals (v5e:2x4, libtpu 0.0.42.1, MiB; docs/performance.md),
# predicted without compiling. Their gathers' code (`tpu_memory.gathers_in_blocks`) follows
# from `gathered_layer_bytes`, which once found no weights in a scanned stack: 0.948, 0.941,
# 0.920 then, 0.984, 1.012, 1.025 with the layer loop's gathered layer counted.
_RECORDED_SCANNED_FSDP = {
    ("lm", "none", "float32"): 22.16,
    ("lm", "full", "float32"): 22.50,
    ("t5", "full", BF16): 37.98,
}
_PREDICT_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from t5lite.insight import accuracy, memory
    from t5lite.insight.meshes import partitioner_on
    from t5lite.insight.topology import get_topology
    from t5lite.trainer import Trainer

    devices = get_topology("v5e:2x4").devices
    out = []
    for fam, remat, precision in json.loads(sys.argv[1]):
        tr = accuracy.accuracy_trainer(fam, "fsdp", remat, precision=precision)
        part = partitioner_on(tr.partitioner, devices)
        tr = Trainer(tr.model, part, batch_size=tr.batch_size, lengths=tr.lengths)
        out.append(memory.predict_memory(tr).total)
    print("RESULT " + json.dumps(out))
    """
)


def test_scanned_fsdp_on_v5e_counts_the_layer_loops_gathers():
    cases = list(_RECORDED_SCANNED_FSDP)
    totals = tpu_compile_result(_PREDICT_SCRIPT, json.dumps(cases), host_devices=8)
    for case, total in zip(cases, totals):
        assert abs(total / (_RECORDED_SCANNED_FSDP[case] * 2**20) - 1) < 0.05, (case, total)
