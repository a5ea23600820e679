"""The zero-bubble split of a stage's backward (``pipeline.split_backward``), on its own: B (input
gradients, with the join-node gradients captured by the engine) followed by W (weight gradients)
equals one whole ``torch.autograd.backward`` — input and weight gradients over two micro-batches in a
row, accumulation into an existing ``.grad`` included — on graphs chosen for their awkward shapes: a weight used twice, a
LayerNorm applied twice, a two-output node whose second output is unused and whose weight is used
twice (its W pre-hook must return both slots), an output made from weights only that the other output
also uses (T5's position bias crossing with the hidden state), outputs y and 2y, two weights added
(autograd hands both the same gradient tensor: W must not alias their ``.grad``), a multi-output
split with an unused output, an output made from weights only, a first stage whose input needs no
gradient, and a transformer block. The engine-level equivalence (tests/test_engine.py) covers whole
pipelines; this pins the module itself, so a change to how B captures gradients fails here first."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from varuna_sdk.pipeline.split_backward import backward_input

D = 8


def _shared_linear(m):
    h = torch.tanh(m["a"](m.x))
    return [m["a"](h)]  # the same weight twice: two joins in one group, one feeding the other


def _layernorm_twice(m):
    return [m["ln"](torch.relu(m["ln"](m.x)) * 1.5)]


def _split_unused(m):
    q, _k, v = m["qkv"](m.x).split(D, dim=-1)  # the middle output gets no gradient
    return [q * torch.sigmoid(v)]


class _TwoOut(torch.autograd.Function):
    """``(x @ w, x * 2)``: one autograd node with two gradient slots."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w, x * 2

    @staticmethod
    def backward(ctx, g0, g1):
        x, w = ctx.saved_tensors
        gx = g0 @ w.t() + (0 if g1 is None else 2 * g1)
        return gx, x.t() @ g0


def _two_out_twice(m):
    w = m["a"].weight
    h, _unused = _TwoOut.apply(m.x, w)  # a join whose last slot receives nothing, used twice
    y, _unused2 = _TwoOut.apply(torch.tanh(h), w)
    return [y]


def _bias_crossing(m):
    bias = m["b"].weight * 2.0  # weights only; the hidden state that crosses with it uses it (T5's position bias)
    return [torch.tanh(m["a"](m.x) + bias[:1]), bias]


def _output_feeds_output(m):
    y = m["a"](m.x)
    return [y, 2 * y]  # on a first stage y is off the input path and 2*y feeds it gradient


def _two_params_added(m):
    pp = m["pp"]  # autograd hands one gradient tensor to both weights
    return [torch.tanh(m["a"](m.x)) + pp["p1"] + pp["p2"]]


def _weights_only_output(m):
    y = m["a"](m.x)
    return [y, m["b"].weight.sum() * torch.ones(2)]  # second output never touches the input


def _two_inputs(m):
    return [m["a"](m.x) + m["b"](m.x2)]


def _block(m):
    return [m["blk"](m.x.unsqueeze(0)).squeeze(0)]


GRAPHS = {"shared_linear": _shared_linear, "layernorm_twice": _layernorm_twice,
          "split_unused": _split_unused, "weights_only_output": _weights_only_output,
          "two_inputs": _two_inputs, "transformer_block": _block, "two_out_twice": _two_out_twice,
          "bias_crossing": _bias_crossing, "output_feeds_output": _output_feeds_output,
          "two_params_added": _two_params_added}


class _Model(nn.ModuleDict):
    def __init__(self):
        torch.manual_seed(3)
        super().__init__({"a": nn.Linear(D, D), "b": nn.Linear(D, D), "ln": nn.LayerNorm(D),
                          "qkv": nn.Linear(D, 3 * D),
                          "pp": nn.ParameterDict({"p1": nn.Parameter(torch.randn(4, D)),
                                                  "p2": nn.Parameter(torch.randn(4, D))}),
                          "blk": nn.TransformerEncoderLayer(D, 2, 16, dropout=0.0, batch_first=True)})


def _run(graph, split: bool, input_grad: bool, seed_grads: bool, micro_batches: int = 2):
    """Backward of ``micro_batches`` forwards in a row (gradients accumulate across them)."""
    model = _Model()
    if seed_grads:  # W must add to an existing .grad, as backward() does
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.25)
    g = torch.Generator().manual_seed(5)
    got = []
    for _ in range(micro_batches):
        model.x = torch.randn(4, D, generator=g).requires_grad_(input_grad)
        model.x2 = torch.randn(4, D, generator=g).requires_grad_(input_grad)
        outs = graph(model)
        gouts = [torch.randn(o.shape, generator=g) for o in outs]
        inputs = [model.x, model.x2]
        if split:
            before = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
            ins, work = backward_input(outs, gouts, inputs, model.parameters())
            assert all((p.grad is None and before[n] is None) or torch.equal(p.grad, before[n])
                       for n, p in model.named_parameters()), "B touched a weight gradient"
            work.run()
            work.run()  # a second run does nothing
        else:
            torch.autograd.backward(outs, gouts)
            ins = [t.grad for t in inputs]
        got += list(ins)
    return got, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", sorted(GRAPHS))
@pytest.mark.parametrize("input_grad", [True, False])
@pytest.mark.parametrize("seed_grads", [False, True])
def test_b_then_w_equals_the_whole_backward(name, input_grad, seed_grads):
    ref_in, ref_w = _run(GRAPHS[name], split=False, input_grad=input_grad, seed_grads=seed_grads)
    got_in, got_w = _run(GRAPHS[name], split=True, input_grad=input_grad, seed_grads=seed_grads)
    for r, g in zip(ref_in, got_in):
        assert (r is None) == (g is None)
        if r is not None:
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
    assert ref_w.keys() == got_w.keys()
    touched = 0
    for n in ref_w:
        r, g = ref_w[n], got_w[n]
        assert (r is None) == (g is None), n
        if r is not None:
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6, msg=n)
            touched += 1
    assert touched > 0


def test_b_computes_no_weight_gradient_and_w_all_of_them():
    """Between B and W no weight has a gradient; after W each used weight has its full one."""
    model = _Model()
    model.x = torch.randn(4, D, requires_grad=True)
    (y,) = _block(model)
    got, work = backward_input([y], [torch.ones_like(y)], [model.x], model["blk"].parameters())
    assert got[0] is not None and got[0].shape == (4, D)
    assert all(p.grad is None for p in model["blk"].parameters())
    work.run()
    assert all(p.grad is not None for p in model["blk"].parameters())
