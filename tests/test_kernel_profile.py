"""benchmarks/kernel_profile.py: kernel categories by name, the busy time, a profiled call."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.kernel_profile import busy_seconds, category, profile_call


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3", "attention"),
        ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<...>", "attention"),
        ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80", "attention"),
        ("nvjet_hsh_256x128_64x4_2x1_v_bz_coopA_NNT", "matmul"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", "matmul"),
        ("triton_poi_fused__to_copy_add_mul_0", "pointwise (Inductor)"),
        ("triton_red_fused_native_layer_norm_1", "reduction (Inductor)"),
        ("triton_per_fused_rms_norm_2", "reduction (Inductor)"),
        (
            "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdam>",
            "optimizer",
        ),
        ("ncclDevKernel_AllGather_RING_LL", "collective"),
        ("Memcpy DtoD (Device -> Device)", "copy / memset"),
        (
            "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add>",
            "element-wise (eager)",
        ),
        ("some_unknown_kernel", "other"),
    ],
)
def test_kernels_fall_in_the_category_their_name_says(name, expected):
    assert category(name) == expected


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 10)), max_size=12))
def test_busy_time_is_the_length_of_the_union_of_the_intervals(pairs):
    intervals = [(float(a), float(a + n)) for a, n in pairs]
    covered = {t for a, n in pairs for t in range(a, a + n)}  # unit cells [t, t + 1)
    assert busy_seconds(intervals) == pytest.approx(len(covered))


def test_a_profiled_call_returns_its_result_and_counts_its_matmuls():
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    out = profile_call(lambda: (a @ b).relu().sum(), torch.device("cpu"))
    assert torch.equal(out["result"], (a @ b).relu().sum())
    assert out["categories"].get("matmul", 0.0) > 0.0
    assert out["idle_s"] == pytest.approx(out["wall_s"] - out["busy_s"])
    assert 0.0 < out["busy_s"] <= out["wall_s"] + 1e-9
