"""MetaAsDevice's metadata cache (``model.hybrid.MetaShapeCache``): a replayed meta operation gives
exactly the shape, strides and dtype the meta kernel gives, operations that mutate or return an
argument are never replayed, and the cache stays bounded."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from varuna_sdk.model.hybrid import MetaAsDevice, MetaShapeCache


def _meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, device="meta", dtype=dtype)


def _sig(out):
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return [(tuple(t.shape), tuple(t.stride()), t.dtype, t.device.type) for t in outs]


def _run(fn, cache):
    with MetaAsDevice("cpu", cache=cache):
        out = fn()
    return out


# operations a model's prefix runs: broadcasting, matmul, views, slicing, reductions, tuple outputs,
# real (input-only) tensors mixed with meta ones, dtype changes
OPS = {
    "broadcast add": lambda: _meta(4, 8, 16) + _meta(8, 16),
    "matmul": lambda: _meta(4, 8, 16) @ _meta(16, 32),
    "transpose view": lambda: _meta(4, 8, 16).transpose(1, 2),
    "slice": lambda: _meta(4, 8, 16)[:, 2:5, ::2],
    "ellipsis index": lambda: _meta(4, 8, 16)[..., None, :3],
    "softmax": lambda: torch.softmax(_meta(2, 3, 5), dim=-1),
    "cat": lambda: torch.cat([_meta(2, 3), _meta(4, 3)], dim=0),
    "split (tuple out)": lambda: _meta(6, 4).split(2, dim=0),
    "real mask mixed in": lambda: _meta(2, 4, 4).masked_fill(torch.ones(4, 4, dtype=torch.bool).tril(), 0.0),
    "dtype change": lambda: _meta(3, 5).to(torch.bfloat16),
    "layer norm": lambda: F.layer_norm(_meta(2, 7, 16), (16,), _meta(16), _meta(16)),
    "real positions": lambda: _meta(2, 9, 16) + torch.arange(9).float()[:, None],
}


@pytest.mark.parametrize("name", sorted(OPS))
def test_a_replayed_meta_operation_has_the_metadata_the_meta_kernel_gives(name):
    fn = OPS[name]
    expected = _sig(_run(fn, None))
    cache = MetaShapeCache()
    first = _sig(_run(fn, cache))
    again = _sig(_run(fn, cache))
    assert first == expected and again == expected
    assert cache.hits >= 2  # the first call returns a replay of what it recorded, the second is a hit
    assert all(d == "meta" for *_, d in again)


def test_different_argument_metadata_or_scalars_are_different_entries():
    cache = MetaShapeCache()
    a = _run(lambda: _meta(2, 3).sum(dim=0), cache)
    b = _run(lambda: _meta(2, 3).sum(dim=1), cache)
    c = _run(lambda: _meta(5, 3).sum(dim=0), cache)
    d = _run(lambda: _meta(2, 3, dtype=torch.float64).sum(dim=0), cache)
    assert [tuple(t.shape) for t in (a, b, c)] == [(3,), (2,), (3,)]
    assert d.dtype == torch.float64
    assert len(cache.entries) == 4
    # 1, 1.0 and True hash alike; a scalar argument's key keeps its type
    x = _meta(2, 3)
    keys = {cache.key(torch.Tensor.__mul__, [x, v], None, {}) for v in (1, 1.0, True)}
    assert len(keys) == 3


def test_operations_that_mutate_or_return_an_argument_are_never_replayed():
    cache = MetaShapeCache()
    x, y = _meta(4, 4), _meta(4, 4)
    with MetaAsDevice("cpu", cache=cache):
        for _ in range(2):
            assert x.add_(y) is x  # in place: the argument itself comes back, every time
            assert x.to(torch.float32) is x  # a no-op conversion returns its argument
            z = x.clone()
            z[0] = 1.0  # __setitem__ mutates
    assert cache.entries and all(k[0] not in (torch.Tensor.add_, torch.Tensor.__setitem__) for k in cache.entries)


def test_the_cache_is_bounded_and_refuses_to_hide_operations_from_on_mixed():
    cache = MetaShapeCache(max_entries=3)
    for n in range(1, 10):
        _run(lambda: _meta(n, 2) * 2.0, cache)
        assert len(cache.entries) <= 3
    with pytest.raises(ValueError, match="one or the other"):
        MetaAsDevice("cpu", on_mixed=lambda *a: None, cache=cache)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=4), st.integers(0, 3), st.integers(1, 6))
def test_broadcast_and_matmul_replays_equal_the_meta_kernel(shape, drop, k):
    a_shape = shape
    b_shape = shape[min(drop, len(shape) - 1):]  # a suffix: broadcasts against a
    cache = MetaShapeCache()

    def fn():
        s = _meta(*a_shape) + _meta(*b_shape)
        return s, s.unsqueeze(-1) @ _meta(1, k)

    expected = _sig(_run(fn, None)[0]) + _sig(_run(fn, None)[1])
    for _ in range(2):
        out = _run(fn, cache)
        assert _sig(out[0]) + _sig(out[1]) == expected


@pytest.mark.parametrize("a_shape,b_shape,offs", [((6, 8), (2, 8, 4), [3, 6]), ((2, 6, 8), (8, 12), [4, 12]),
                                                   ((6, 8), (8, 4), [4, 8]), ((2, 6, 8), (2, 8, 4), None)])
def test_a_grouped_product_of_meta_experts_has_the_real_kernels_shape(a_shape, b_shape, offs):
    """``torch._grouped_mm`` (mixture-of-experts layers) on meta weights: torch's meta kernel wants
    bf16 and 16-byte strides (its CUDA kernel's needs) where the CPU kernel runs fp32, so the dry run
    and a later stage's prefix use a stand-in — of the real kernel's output shape and dtype for every
    layout (2-D/3-D operands), and differentiable."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(*a_shape, generator=g), torch.randn(*b_shape, generator=g)
    o = torch.tensor(offs, dtype=torch.int32) if offs is not None else None
    real = torch._grouped_mm(a, b, o)
    weight = b.to("meta").requires_grad_()
    with MetaAsDevice("cpu"):
        out = torch._grouped_mm(a, weight, o)
    assert out.is_meta and out.shape == real.shape and out.dtype == real.dtype and out.requires_grad


def test_a_packed_sequence_keeps_the_datas_lengths_real_and_its_shape_follows_them():
    """``pack_padded_sequence(x, lengths)`` with ``x`` on meta (activations) and ``lengths`` real (the
    data's): the lengths stay on the CPU, as torch's packing requires (they were moved to meta:
    "'lengths' argument should be a 1D CPU int64 tensor, but got 1D meta Long tensor"), the packed
    data has one row per real token, the LSTM and the unpacking run on it, and a shape cache never
    replays them: other lengths of the same shape give other shapes."""
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    rnn = torch.nn.LSTM(4, 4, batch_first=True).to("meta")
    cache = MetaShapeCache()
    for lengths in ([5, 2, 3], [1, 1, 4]):
        with MetaAsDevice("cpu", cache=cache):
            packed = pack_padded_sequence(_meta(3, 5, 4), torch.tensor(lengths), batch_first=True,
                                          enforce_sorted=False)
            y, _ = rnn(packed)
            out, got = pad_packed_sequence(y, batch_first=True, total_length=5)
        assert packed.data.device.type == "meta" and tuple(packed.data.shape) == (sum(lengths), 4)
        assert packed.batch_sizes.device.type == "cpu" and y.data.shape == packed.data.shape
        assert out.device.type == "meta" and tuple(out.shape) == (3, 5, 4) and got.tolist() == lengths


def test_an_operation_that_needs_a_data_tensors_values_on_meta_is_named_with_that_tensor():
    """An operation given a data tensor beside activations runs on meta with it; when its kernel then
    needs the data's values (``repeat_interleave`` by counts from the data), the dry run's error names
    the operation and that tensor as computed from the data — not "the forward must not depend on
    values computed from its weights", which was untrue of it."""
    from torch import nn

    from varuna_sdk.model.tracer import trace_model

    class Repeat(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, counts):
            return torch.repeat_interleave(self.lin(x), counts, dim=0)

    with pytest.raises(RuntimeError) as e:
        trace_model(Repeat().to("meta"), {"x": torch.randn(3, 4), "counts": torch.tensor([1, 2, 3])})
    msg = str(e.value)
    assert "'repeat_interleave' got a [3] int64 tensor computed from the data alone" in msg, msg
    assert "values computed from its weights" not in msg, msg
