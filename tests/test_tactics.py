"""Tactics as data: validity rules, names, defaults (CPU only)."""

import re
from dataclasses import replace

import pytest

from mhc_cute import tactics as tac
from mhc_cute.tactics import FmaTactic

HS = [64, 256, 512, 1024, 4096, 5120, 7168, 64 * 97]
MS = [1, 2, 3, 4, 5, 16, 17, 32, 33, 64, 100, 256, 257, 1000, 1024, 4096, 8192, 65536]


@pytest.mark.parametrize("h", HS)
@pytest.mark.parametrize("path", tac.FMA_PATHS)
def test_default_is_valid_for_every_m(path, h):
    for m in MS:
        t = tac.default_fma_tactic(path, m, h)
        assert t.path == path
        assert t.invalid_reason(h) is None, (m, t)


def test_default_buckets_limit_variants():
    # one tactic per M bucket: few compiled variants per (path, H)
    names = {tac.default_fma_tactic("all_fma", m, 7168).name for m in MS}
    assert len(names) <= len(tac.FMA_BUCKETS)


def test_small_m_spreads_the_weight_read():
    t = tac.default_fma_tactic("all_fma", 1, 7168, sm_count=132)
    assert t.split_k * -(-1 // t.tokens_per_cta) >= 100  # about a wave of CTAs at decode
    assert 7168 // t.split_k == t.chunk_h  # one chunk each


@pytest.mark.parametrize("t", [FmaTactic("all_fma", 112, 4, 6, 256), FmaTactic("half_fma", 7, 8, 3, 128, 2, 4, "lat"),
                               FmaTactic("half_fma", 112, 16, 12, 128, fuse="latp", warp_mma=True),
                               FmaTactic("half_fma", 112, 32, 6, 256, fuse="lat", warp_mma=True, one_per_sm=True)])
def test_name_round_trip(t):
    assert tac.parse_tactic(t.name) == t
    assert hash(t) == hash(tac.parse_tactic(t.name))


def test_parse_rejects_garbage():
    with pytest.raises(ValueError, match="unknown tactic name 'all_fma:k1'"):
        tac.parse_tactic("all_fma:k1")


@pytest.mark.parametrize(
    "t, h, why",
    [
        (FmaTactic("bad", 1, 1, 6, 256), 512, "path"),
        (FmaTactic("all_fma", 1, 1, 5, 256), 512, "tile_n"),
        (FmaTactic("all_fma", 1, 1, 6, 100), 512, "threads"),
        (FmaTactic("all_fma", 1, 1, 3, 64), 512, "whole warps"),
        (FmaTactic("all_fma", 3, 1, 6, 256), 512, "divide"),
        (FmaTactic("all_fma", 16, 1, 6, 256), 512, "chunk_h"),
        (FmaTactic("all_fma", 1, 16, 6, 256), 512, "tokens_per_cta"),
        (FmaTactic("all_fma", 1, 1, 6, 256, 3), 512, "stages"),
        (FmaTactic("all_fma", 8, 1, 6, 256, 2), 512, "two chunks"),
        (FmaTactic("all_fma", 1, 8, 24, 1024), 4096, "tokens_per_cta"),
        (FmaTactic("all_fma", 56, 1, 6, 256, 1, 4), 7168, "burst"),
        (FmaTactic("all_fma", 1, 1, 6, 256, fuse="lat"), 512, "two-launch paths only"),
        (FmaTactic("half_fma", 1, 1, 6, 256, fuse="fast"), 512, "fuse must be"),
        (FmaTactic("half_fma", 8, 33, 6, 256, warp_mma=True), 512, "tokens_per_cta"),
        (FmaTactic("half_fma", 8, 64, 24, 64, warp_mma=True), 512, "tokens_per_cta"),
        (FmaTactic("half_fma", 16, 16, 4, 192, warp_mma=True), 512, "multiple of 16"),
        (FmaTactic("half_fma", 8, 32, 6, 256, 1, 4, warp_mma=True), 4096, "shared memory"),
        (FmaTactic("all_fma", 112, 8, 6, 256, one_per_sm=True), 7168, "one_per_sm"),
    ],
)
def test_invalid(t, h, why):
    reason = t.invalid_reason(h)
    assert reason is not None and why in reason
    with pytest.raises(ValueError, match=f"^invalid tactic {re.escape(t.name)} for H = {h}: "):
        t.check(h)


def test_chunk_and_smem():
    t = FmaTactic("half_fma", 8, 8, 6, 256)
    assert t.chunk_h == 64
    assert t.smem_bytes() == 8 * 4 * 64 * 4 + 8 * 8 * 7 * 4
    assert t.invalid_reason(4096) is None
    assert FmaTactic("half_fma", 8, 8, 6, 256, 1, 4).smem_bytes() == 8 * 4 * 256 * 4 + 8 * 8 * 7 * 4


def test_resolve_tactic_default_or_the_callers(monkeypatch):
    """A path runs the caller's tactic (checked by the API, ``backends.checked_tactic``), else its default."""
    from mhc_cute import kernels
    from mhc_cute.accuracy import make_inputs, problem_of
    from mhc_cute.tactics import default_fma_tactic

    monkeypatch.setattr(kernels, "sm_count", lambda index: 132)
    problem = problem_of(make_inputs(3, 512))
    want = default_fma_tactic("all_fma", 3, 512, 132)
    assert kernels.resolve_tactic("all_fma", None, problem, default_fma_tactic) == want
    other = default_fma_tactic("all_fma", 300, 512, 132)
    assert kernels.resolve_tactic("all_fma", other, problem, default_fma_tactic) is other


def test_big_fuse_shape_follows_m_on_the_two_launch_paths():
    for m, want in ((1, "lat"), (32, "lat"), (33, "bw"), (8192, "bw")):
        assert tac.ffma_tactic("half_fma", m, 7168).fuse == want
        assert tac.default_mma_tactic("half_mma", m, 7168).fuse == want
    # the warp-MMA default (9 <= M <= 128) keeps the latency shape, as every tuned pick of that kind has
    assert [tac.default_fma_tactic("half_fma", m, 7168).fuse for m in (8, 9, 33, 128, 129)] == \
        ["lat", "lat", "lat", "lat", "bw"]


@pytest.mark.parametrize("h", [512, 4096, 6144, 7168])
def test_path_e_default_projects_on_warp_mma_from_9_to_128_tokens(h):
    """Path E: the FFMA projection up to 8 tokens and from 129; between, the warp-MMA shape of the tuned tables: one
    64-position chunk per CTA (H / 64 splits), 16 tokens per CTA up to M = 32 (32 at M = 17-32 where 16 would
    take more than a wave) and 32 up to 128. Path F: FFMA."""
    for m in (1, 8, 129, 1000):
        assert replace(tac.default_fma_tactic("half_fma", m, h), one_per_sm=False) == tac.ffma_tactic("half_fma", m, h)
        assert not tac.default_fma_tactic("half_fma", m, h).warp_mma
    for m, tokens in ((9, 16), (16, 16), (32, 16 if 2 * h // 64 <= 132 else 32), (33, 32), (128, 32)):
        t = tac.default_fma_tactic("half_fma", m, h)
        assert t.warp_mma and t.tokens_per_cta == tokens and t.split_k == h // 64 and t.chunk_h == 64
        assert t.fuse == "lat"
        assert tac.default_fma_tactic("all_fma", m, h) == tac.ffma_tactic("all_fma", m, h)
        assert tac.default_fma_tactic("all_fma", m, 7168).fuse == "bw"
        assert tac.default_mma_tactic("all_mma", m, 7168).fuse == "bw"


@pytest.mark.parametrize("h", [512, 4096, 6144, 7168])
def test_path_e_default_puts_one_wave_grids_one_to_an_sm(h):
    """Path E's default runs one CTA per SM exactly where its grid at the bucket's largest M is one wave; path F
    never does."""
    for m in (1, 2, 4, 8, 16, 32, 128, 256, 512, 8192):
        t = tac.default_fma_tactic("half_fma", m, h, 132)
        bucket_m = next(b[0] for b in tac.FMA_BUCKETS if m <= b[0])
        assert t.one_per_sm == tac.fits_one_wave(t, bucket_m, 132), (m, t.name)
        assert not tac.default_fma_tactic("all_fma", m, h, 132).one_per_sm
    assert tac.default_fma_tactic("half_fma", 8, 7168, 132).one_per_sm
    assert not tac.default_fma_tactic("half_fma", 2, 7168, 132).one_per_sm  # 224 CTAs at M = 2
    assert tac.default_fma_tactic("half_fma", 32, 7168, 132).name == "half_fma:k112:t32:n6:w256:s1:b1:flat:mma:o1"


def test_one_launch_mma_fuse_rules():
    assert "two-launch" in tac.MmaTactic("all_mma", 1, 64, 2, "lat").invalid_reason(512)
    assert tac.parse_tactic("half_mma:k8:m128:s3:flat") == tac.MmaTactic("half_mma", 8, 128, 3, "lat")


def test_partials_past_32_bit_offsets_are_refused():
    """The CuTe kernels index the split-K partials [split_k, M, 32] with 32-bit offsets: a launch whose partials would
    reach 2^31 floats is refused, naming the tactic; the default tactics stay below it at any M that fits in memory."""
    from mhc_cute.kernels import partials_count

    t = tac.parse_tactic("half_mma:k112:m64:s3:fbw")
    assert partials_count(t, 599_186) == 599_186 * 112 * 32  # 2^31 - 1024
    with pytest.raises(ValueError, match=r"half_mma:k112:m64:s3:fbw: .* fewer K splits"):
        partials_count(t, 599_187)
    for path in tac.FMA_PATHS + tac.MMA_PATHS:
        for h in (512, 4096, 7168):
            m = 40 * 2**30 // (20 * h)  # tokens of 40 GiB of operands
            d = tac.default_tactic(path, m, h)
            partials_count(d, m)


def test_one_wave():
    t = FmaTactic("half_fma", 112, 16, 6, 256, fuse="lat", warp_mma=True)
    assert tac.fits_one_wave(t, 16, 132) and not tac.fits_one_wave(t, 17, 132)
    assert tac.fits_one_wave(t, 17, 224)
