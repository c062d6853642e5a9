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
# them in VMEM; Megatron capacity `none` was held out of the fit.
_MOE_CASES = [
    ("lm", "expert_parallel", "none", "float32", False, 4, "capacity"),
    ("t5", "megatron", "full", "float32", False, 4, "dropless"),
    ("lm", "megatron", "none", "float32", False, 4, "capacity"),
]


def test_predicted_memory_of_unrolled_moe_layers_on_tpu():
    _check_within_ten_percent(_MOE_CASES)
