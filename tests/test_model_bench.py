"""``mhc-cute bench --model``'s pieces that run without a GPU: the op census of each model, its floor, and the forwards
it times (on the CPU, torch backend, a small configuration)."""

import pytest
import torch

from mhc_cute import benchmark as bm


def test_op_census_of_each_model():
    pro = bm.model_ops(bm.MODELS["v4-pro"])  # 61 layers: entry, 2L - 1 seams, last post, head
    assert (pro.count("entry"), pro.count("seam"), pro.count("post"), pro.count("head")) == (1, 121, 1, 1)
    flash = bm.model_ops(bm.MODELS["v4.1-flash"])  # 40 layers, Engram {1, 14}
    assert flash.count("delayed_entry") == 1 and flash.count("delayed_seam") == 77
    assert flash.count("no_post_delayed_seam") == 2 and flash.count("post") == 3 and flash[-1] == "collapse"


def test_model_floor_is_the_sum_of_the_ops():
    c = bm.MODELS["v4-flash"]
    h, m = c.hidden, 100
    want = bm.op_floor_bytes("entry", m, h) + 85 * ((20 * h + 160) * m + 384 * h) + (18 * h + 80) * m + \
        bm.op_floor_bytes("head", m, h)
    assert bm.model_floor_bytes(c, m) == want
    assert bm.op_floor_bytes("post", m, h) == (18 * h + 80) * m
    assert bm.op_floor_bytes("collapse", m, h) == (10 * h + 16) * m


@pytest.mark.parametrize("config", [bm.ModelConfig(64, 2), bm.ModelConfig(64, 3, (1,), delayed=True)])
def test_timed_forwards_run(config):
    """The forwards the bench captures run on small inputs (torch backend, CPU) and give the head input."""
    inputs = bm.model_inputs(config, 3, "cpu")
    assert len(inputs["weights"]) == 2 * config.layers
    out = bm.model_forward_calls(config)["torch"](inputs)
    assert out.shape == (3, 64) and out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
