"""benchmarks/_step_profile.py: the device time of a traced step, summed by kind, op and kernel."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import _step_profile


def test_union_counts_overlapping_spans_once():
    spans = [(0, 10), (5, 15), (20, 30), (22, 25), (30, 31)]
    assert _step_profile._union_ns(spans) == 15 + 10 + 1


@pytest.mark.parametrize(
    ("kernel", "op", "kind"),
    [  # names from the H200 profile in docs/performance.md
        ("nvjet_sm90_tst_128x160_64x5_1x2_h_bz_NNT", "", "matmul"),
        ("sm90_xmma_gemm_f32f32_tf32f32_f32_nt_n_tilesize128x256x32_cublas", "", "matmul"),
        (
            "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64_1x4x1",
            "",
            "attention",
        ),
        ("memcpy128", "", "copy"),
        ("loop_add_multiply_fusion", "loop_add_multiply_fusion", "other"),
    ],
)
def test_kernels_are_sorted_by_name(kernel, op, kind):
    assert _step_profile.kind_of(kernel, op) == kind


def test_profile_of_a_cpu_step_sums_its_ops():
    f = jax.jit(lambda x: jnp.tanh(x @ x).sum())
    x = jnp.ones((256, 256))
    f(x).block_until_ready()
    p = _step_profile.profile_steps(lambda: f(x), steps=2, top=5)
    assert set(p) == {"wall_ms", "busy_ms", "kinds_ms", "ops_ms", "kernels_ms"}
    assert 0 < p["busy_ms"] <= sum(p["kinds_ms"].values()) + 1e-3
    assert 0 < len(p["ops_ms"]) <= 5
    assert list(p["ops_ms"].values()) == sorted(p["ops_ms"].values(), reverse=True)
