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
