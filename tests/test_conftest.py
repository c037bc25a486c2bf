"""The GPU suite's sharing of one GPU between pytest-xdist's workers: at most ``LARGE_M_SLOTS`` large-M tests at once."""

import threading
import time

from conftest import LARGE_M_SLOTS, _large_m_slot


def test_a_large_test_waits_for_a_free_slot():
    held = [_large_m_slot() for _ in range(LARGE_M_SLOTS)]
    for slot in held:
        slot.__enter__()
    got = threading.Event()

    def one_more():
        with _large_m_slot():
            got.set()

    t = threading.Thread(target=one_more)
    t.start()
    time.sleep(0.5)
    assert not got.is_set()  # every slot is taken
    held[0].__exit__(None, None, None)
    t.join(timeout=10)
    assert got.is_set()
    for slot in held[1:]:
        slot.__exit__(None, None, None)



def test_the_large_tests_are_the_ones_that_hold_gigabytes():
    """Large: a test at M >= LARGE_M, or whose problem runs past the first row beyond 2^31 elements (``first_past``),
    or one named for 2^31 offsets."""
    from types import SimpleNamespace

    from conftest import LARGE_M, _is_large

    def item(name, **params):
        return SimpleNamespace(name=name, callspec=SimpleNamespace(params=params))

    assert _is_large(item("test_gpu_backend[half_mma-8192]", m=8192))
    assert _is_large(item("test_gpu_offsets_past_int32[half_mma-fused_hc-74899-False]", first_past=74_899))
    assert _is_large(item("test_gpu_past_2_31_elements[mhc_post-cute]"))
    assert not _is_large(item("test_gpu_backend[half_mma-17]", m=17))
    assert not _is_large(item("test_gpu_backend[half_mma]", m=LARGE_M - 1))
