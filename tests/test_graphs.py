"""CUDA graphs, streams and threads (GPU): replay is bit-identical to eager for every kernel path, chained
calls captured in one graph behave like consecutive layers (also with no kernel between them, where PDL overlaps
them), concurrent streams and host threads stay correct, and inputs on a GPU other than the current one are handled
on their own device."""

import threading

import pytest
import torch
from helpers import ACTIVATIONS, KERNEL_BACKENDS, skip_unless_available

from mhc_cute.accuracy import check_outputs, make_inputs, poisoned_outputs, problem_of, same_bits, tolerances
from mhc_cute import MhcFusedHcOutput, mhc_fused_hc

pytestmark = pytest.mark.gpu


def _capture(work):
    """``work()`` run once on a side stream (compile, workspace), then captured: (graph, the capture's result)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        work()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = work()
    return graph, captured


@pytest.mark.parametrize("m", [3, 200])
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_graph_replay_equals_eager(backend, m):
    skip_unless_available(backend, "cuda")
    inp = make_inputs(m, 4096, seed=11, device="cuda", norm=True)
    eager = mhc_fused_hc(**inp, backend=backend)
    graph, captured = _capture(lambda: mhc_fused_hc(**inp, backend=backend))
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert same_bits(captured, eager)


@pytest.mark.parametrize("m", [3, 200])
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_static_out_buffers_in_a_graph(backend, m):
    """``out=``: the caller's buffers, written eagerly and by a graph replayed on new activations (static buffers,
    as an engine's graphs keep them; the weights stay, as a layer's do: a graph keeps the prepared form of ``fn``
    it was captured with), bit-identical to fresh outputs; every element written (buffers start as NaN)."""
    skip_unless_available(backend, "cuda")
    weights = {k: v for k, v in make_inputs(m, 4096, seed=20, device="cuda", norm=True).items() if k not in ACTIVATIONS}
    sets = [{**weights, **{k: v for k, v in make_inputs(m, 4096, seed=21 + i, device="cuda").items()
                           if k in ACTIVATIONS}} for i in range(3)]
    fresh = [mhc_fused_hc(**s, backend=backend) for s in sets]
    bufs = poisoned_outputs(problem_of(sets[0]))
    got = mhc_fused_hc(**sets[0], backend=backend, out=bufs)
    assert all(g is b for g, b in zip(got, bufs)) and same_bits(got, fresh[0])
    static = {k: sets[0][k].clone() for k in ACTIVATIONS}
    graph, _ = _capture(lambda: mhc_fused_hc(**weights, **static, backend=backend, out=bufs))
    for s, want in zip(sets[1:], fresh[1:]):
        for b in bufs:
            b.fill_(float("nan"))
        for k, v in static.items():
            v.copy_(s[k])
        graph.replay()
        torch.cuda.synchronize()
        assert same_bits(MhcFusedHcOutput(*bufs), want)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_three_chained_layers_in_one_graph(backend):
    """Each call's outputs feed the next, each layer with its own weights, as consecutive layers do."""
    skip_unless_available(backend, "cuda")
    m, h = 5, 4096
    layers = [make_inputs(m, h, seed=100 + i, device="cuda", norm=True) for i in range(3)]
    first = {k: layers[0][k] for k in ("x_prev", "residual_prev", "post_mix_prev", "comb_mix_prev")}

    def chain(state):
        outs = []
        for i, layer in enumerate(layers):
            o = mhc_fused_hc(**{**layer, **state}, backend=backend)
            outs.append(o)
            # the sublayer is stood in for by a fixed function of its input
            state = dict(x_prev=(o.layer_input.float() * 0.5).bfloat16(), residual_prev=o.residual_cur,
                         post_mix_prev=o.post_mix_cur, comb_mix_prev=o.comb_mix_cur)
        return outs

    eager = chain(dict(first))
    static = {k: v.clone() for k, v in first.items()}
    graph, captured = _capture(lambda: chain(static))
    graph.replay()
    torch.cuda.synchronize()
    for e, c in zip(eager, captured):
        assert same_bits(e, c)
    # and the chain's last layer is right on its own inputs
    last_in = dict(layers[2], x_prev=(captured[1].layer_input.float() * 0.5).bfloat16(),
                   residual_prev=captured[1].residual_cur, post_mix_prev=captured[1].post_mix_cur,
                   comb_mix_prev=captured[1].comb_mix_cur)
    check_outputs(captured[2], problem_of(last_in), **tolerances(backend, "fp32"))


@pytest.mark.parametrize("m", [5, 300])
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_directly_chained_calls(backend, m):
    """Each call's outputs are the next call's inputs with no other kernel between them, so a call's kernel 1
    (launched with PDL, its weights loaded before it waits) starts while the previous call's big fuse runs: eager
    and in a graph, bit-identical to the same chain with the stream drained after every call. The graph is
    replayed on fresh first-layer inputs each time, so a read of a stale input would show."""
    skip_unless_available(backend, "cuda")
    h = 4096
    layers = [make_inputs(m, h, seed=200 + i, device="cuda", norm=bool(i % 2)) for i in range(6)]
    keys = ("x_prev", "residual_prev", "post_mix_prev", "comb_mix_prev")

    def chain(state, drain=False):
        outs = []
        for layer in layers:
            o = mhc_fused_hc(**{**layer, **state}, backend=backend)
            if drain:
                torch.cuda.synchronize()
            outs.append(o)
            state = dict(zip(keys, (o.layer_input, o.residual_cur, o.post_mix_cur, o.comb_mix_cur)))
        return outs

    def first_inputs(seed):
        return {k: v for k, v in make_inputs(m, h, seed=seed, device="cuda").items() if k in keys}

    want = chain(first_inputs(300), drain=True)
    got = chain(first_inputs(300))
    torch.cuda.synchronize()
    for i, (w, g) in enumerate(zip(want, got)):
        assert same_bits(w, g), f"eager layer {i} differs"
    static = first_inputs(300)
    graph, captured = _capture(lambda: chain(static))
    for seed in (301, 302, 303):
        fresh = first_inputs(seed)
        for k in keys:
            static[k].copy_(fresh[k])
        graph.replay()
        torch.cuda.synchronize()
        want = chain(fresh, drain=True)
        for i, (w, c) in enumerate(zip(want, captured)):
            assert same_bits(w, c), f"replay on seed {seed}: layer {i} differs"


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_two_streams_concurrently(backend):
    skip_unless_available(backend, "cuda")
    inputs = [make_inputs(64, 4096, seed=20 + i, device="cuda", norm=bool(i)) for i in range(2)]
    want = [mhc_fused_hc(**inp, backend=backend) for inp in inputs]
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream() for _ in inputs]
    got = [[None] * 8 for _ in inputs]
    for rep in range(8):
        for i, (s, inp) in enumerate(zip(streams, inputs)):
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                got[i][rep] = mhc_fused_hc(**inp, backend=backend)
    torch.cuda.synchronize()
    for i in range(2):
        for rep in range(8):
            assert same_bits(got[i][rep], want[i]), f"stream {i} call {rep} differs"


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_two_host_threads(backend):
    skip_unless_available(backend, "cuda")
    inputs = [make_inputs(17, 4096, seed=30 + i, device="cuda") for i in range(2)]
    want = [mhc_fused_hc(**inp, backend=backend) for inp in inputs]
    torch.cuda.synchronize()
    errors = []

    def work(i):
        try:
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                for _ in range(20):
                    out = mhc_fused_hc(**inputs[i], backend=backend)
                    s.synchronize()
                    if not same_bits(out, want[i]):
                        errors.append(f"thread {i}: mismatch")
                        return
        except Exception as e:  # reported below with the thread's name
            errors.append(f"thread {i}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_inputs_on_another_gpu(backend):
    """Inputs on one GPU while another is current: the op runs on the inputs' device (Triton and the TVM-FFI launches
    use the current device), meets the float64 contract there, and leaves the current device as it was."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    skip_unless_available(backend, "cuda")
    for current, target in ((0, 1), (1, 0)):
        with torch.cuda.device(current):
            inputs = make_inputs(100, 4096, seed=40 + target, device=f"cuda:{target}", norm=True)
            out = mhc_fused_hc(**inputs, backend=backend)
            assert torch.cuda.current_device() == current
            assert all(t.device == torch.device("cuda", target) for t in out)
            torch.cuda.synchronize(target)
            check_outputs(out, problem_of(inputs), **tolerances(backend, "fp32"))
