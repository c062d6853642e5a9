"""`predict_memory` for XLA:TPU of mixtures of experts with their layers unrolled against the
TPU compiler's own figure, ahead of time on this CPU: tests/test_tpu_memory.py's check (within
10% of `memory_analysis()`'s total) and runner, on v5e:2x4.

A file of its own so that `--dist loadfile` compiles it on one worker while the other compiles
test_tpu_memory.py's programs.
"""

import pytest
from test_tpu_memory import _check_within_ten_percent

from t5lite.insight.topology import libtpu_available

pytestmark = pytest.mark.skipif(
    not libtpu_available(), reason='libtpu not installed (pip install -e ".[tpu]")'
)

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
