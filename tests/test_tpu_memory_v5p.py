"""`predict_memory` for XLA:TPU against the TPU compiler's own figure on a v5p megacore and for
ring attention, ahead of time on this CPU: tests/test_tpu_memory.py's check (within 10% of
`memory_analysis()`'s total) and runner, on other topologies.

A file of its own so that `--dist loadfile` compiles it on one worker while the other compiles
test_tpu_memory.py's programs.
"""

import pytest
from test_tpu_memory import BF16, _check_within_ten_percent

from t5lite.insight.topology import libtpu_available

pytestmark = pytest.mark.skipif(
    not libtpu_available(), reason='libtpu not installed (pip install -e ".[tpu]")'
)

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


def test_predicted_memory_on_v5p_and_for_ring_attention():
    _check_within_ten_percent(_MORE_CASES)
