"""The benchmark's arithmetic on the CPU: SPEC's floors."""

import pytest

from mhc_cute import benchmark as bm

H = 7168


def test_the_seam_floor_counts_the_fp32_weight_once():
    # fn [24, 4H] fp32 = 384H bytes, read once per call; 20H + 160 bytes per token
    assert bm.floor_bytes(1, H) == 20 * H + 160 + 384 * H
    assert bm.floor_bytes(0, H) == 384 * H == 2_752_512
    assert bm.floor_bytes(1000, H) - bm.floor_bytes(999, H) == 143_520  # SPEC: 143,520 B per token at H = 7168


@pytest.mark.parametrize("floor,per_token,weight", [  # bytes per token and of the weight, as functions of H
    (bm.delayed_floor_bytes, lambda h: 20 * h + 192, lambda h: 384 * h),
    (bm.entry_floor_bytes, lambda h: 2 * h + 8 * h + 2 * h, lambda h: 24 * h * 4),
    (bm.no_post_floor_bytes, lambda h: 8 * h + 2 * h, lambda h: 384 * h),
    (bm.post_floor_bytes, lambda h: 18 * h + 80, lambda h: 0),
    (bm.collapse_floor_bytes, lambda h: 10 * h + 16, lambda h: 0),
    (bm.head_floor_bytes, lambda h: 10 * h + 8 * h, lambda h: 4 * 4 * h * 4),
])
@pytest.mark.parametrize("hidden", [4096, 5120, 7168])
def test_the_other_ops_floors_follow_the_spec(floor, per_token, weight, hidden):
    for m in (0, 1, 256):
        assert floor(m, hidden) == m * per_token(hidden) + weight(hidden)


def test_rotation_covers_the_flush_size_with_the_weight_counted():
    for m in (1, 64, 4096):
        n = bm.n_rotation_sets(m, H)
        assert 2 <= n <= bm.MAX_SETS
        assert n == bm.MAX_SETS or n * bm.floor_bytes(m, H) >= bm.L2_FLUSH_BYTES
