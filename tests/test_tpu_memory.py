"""`predict_memory` for XLA:TPU against the TPU compiler's own figure, ahead of time on this CPU.

libtpu (the `[tpu]` extra) compiles the train step of `accuracy.accuracy_trainer`'s test-size
models for a v5e:2x4 slice (data=2 x model=4, data=8 without model parallelism); the analytic
prediction, which models XLA:TPU (`tpu_memory`: bf16 dots, fused elementwise work, in-place
gradient reduction, the executable in HBM), must be within 10% of `memory_analysis()`'s total.
The whole matrix is `benchmarks/memory_accuracy.py --topology v5e:2x4` (docs/performance.md).
Runs in a fresh process so the TPU plugin never meets the test session's fake CPU devices.
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
# A v5p megacore device (the logits, attention logits, MLP pre-activations and parameters cast
# from fp32 masters in HBM: tpu_memory.backward's `device_kind`, `casts`) and ring attention
# (its buffers in HBM, its steps' kernels: tpu_memory.ring_in_hbm, code_bytes), each with its
# topology; the ring unscanned in fp32 (libtpu refuses it unscanned in bf16).
_MORE_CASES = [
    ("lm", "megatron", "full", BF16, False, 0, "capacity", "v5p:2x2x2"),
    ("lm", "megatron", "none", "float32", False, 0, "capacity", "v5p:2x2x2"),
    ("lm", "fully_sharded", "full", BF16, False, 0, "capacity", "v5p:2x2x2"),
    ("lm", "context_parallel_ring", "none", "float32", False, 0, "capacity", "v5e:2x4"),
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


def test_predicted_memory_on_v5p_and_for_ring_attention():
    _check_within_ten_percent(_MORE_CASES)


# A mixture of experts with its layers unrolled (tpu_moe_memory.unscanned_moe): top-2 routing
# (decoder-only) spills its MoE values and every gradient to HBM (fitted); top-1 (T5) keeps
# them in VMEM; Megatron capacity `none` was held out of the fit; Megatron capacity `full` is
# the MoE layers' 16 KiB slots (`moe slots`) and the recomputed layer's evicted buffers
# (`recomputed_in_hbm`), both read from its dump, where the gradient-sized copies fitted on
# expert_parallel left it 19% short.
_MOE_CASES = [
    ("lm", "expert_parallel", "none", "float32", False, 4, "capacity"),
    ("t5", "megatron", "full", "float32", False, 4, "dropless"),
    ("lm", "megatron", "none", "float32", False, 4, "capacity"),
    ("lm", "megatron", "full", "float32", False, 4, "capacity"),
]


def test_predicted_memory_of_unrolled_moe_layers_on_tpu():
    _check_within_ten_percent(_MOE_CASES)


def test_recomputed_megatron_layer_in_hbm():
    """An unrolled capacity layer's recomputation under `full` leaves VMEM where the rules
    split the expert kernels' F and its hidden buffers, one a choice, exceed a tenth of the
    budget: both pre-activations in the activations' dtype and the activation's and the two
    dispatched tokens' bf16 copies, F padded to 128 lanes (f32[2,16,80,192] at 2.5 MiB in the
    v5e buffer assignment); F whole (expert_parallel) or smaller buffers (bf16) stay."""
    from t5lite.insight import tpu_moe_memory

    def program(f_split=True, itemsize=4):
        # one [E/2, G, C, F/4] hidden buffer and one [E/2, G, C, D] dispatched, in `itemsize`
        layer = {
            "moe_h": 2 * 16 * 80 * 192 * itemsize,
            "moe_dispatched": 2 * 16 * 80 * 256 * itemsize,
            "moe_share": 1.0,
        }
        return tpu_moe_memory.MoeProgram(
            layers=((2, layer),),
            remat="full",
            dispatch="capacity",
            gradients=0,
            copies=0,
            one_axis=False,
            itemsize=itemsize,
            vmem=32 * 2**20,
            f_split=f_split,
            lane_padding=256 / 192,
        )

    padded = 2 * 16 * 80 * 256  # elements of one buffer, F padded to 256 lanes, or of D
    assert tpu_moe_memory.recomputed_in_hbm(program()) == 2 * padded * 4 + 3 * padded * 2
    assert tpu_moe_memory.recomputed_in_hbm(program(f_split=False)) == 0
    assert tpu_moe_memory.recomputed_in_hbm(program(itemsize=2)) == 0
