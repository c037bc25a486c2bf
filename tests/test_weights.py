"""The prepared-weight cache (``mhc_cute.weights``): CPU only."""

import weakref

import torch

import mhc_cute
from mhc_cute import weights


def _double(fn):
    return fn * 2


def test_prepared_follows_storage_and_version():
    fn = torch.randn(24, 4 * 64)
    a = weights.prepared(fn, "double", _double)
    assert weights.prepared(fn, "double", _double) is a
    assert weights.prepared(fn[:], "double", _double) is a  # a view of the same weight
    assert weights.prepared(fn, "other", _double) is not a
    fn.mul_(2)  # in-place update bumps the version counter: prepared again
    b = weights.prepared(fn, "double", _double)
    assert b is not a and torch.equal(b, fn * 2)


def test_prepared_never_serves_a_freed_weight_at_the_same_address():
    # the caching allocator may put a new weight where a freed one was, with the same version counter (0)
    new = torch.randn(24, 4 * 64)
    freed = torch.randn(24, 4 * 64)
    stale = _double(freed)
    key = (new.data_ptr(), new._version, tuple(new.shape), new.device, "double")
    weights._cache[key] = (weakref.ref(freed), stale)
    del freed
    got = weights.prepared(new, "double", _double)
    assert got is not stale and torch.equal(got, new * 2)


def test_prepared_cache_is_bounded():
    keep = [torch.randn(2, 4) for _ in range(weights.CACHE_ENTRIES + 5)]
    for w in keep:
        weights.prepared(w, "double", _double)
    assert len(weights._cache) <= weights.CACHE_ENTRIES


def test_prepared_serves_inference_tensors_until_cleared():
    # inference tensors have no version counter: cached on their address, an in-place update is seen after clear()
    with torch.inference_mode():
        fn = torch.randn(24, 4 * 64)
        a = weights.prepared(fn, "double", _double)
        assert weights.prepared(fn, "double", _double) is a and torch.equal(a, fn * 2)
        fn.mul_(2)
    assert weights.prepared(fn, "double", _double) is a
    mhc_cute.clear_prepared_weights()
    b = weights.prepared(fn, "double", _double)
    assert b is not a and torch.equal(b, fn * 2)
