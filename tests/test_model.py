"""Model side without processes: tracing on the meta device, cost-balanced partitioning (with
inputs from other pipeline systems' bug reports), partition errors, stage materialisation and the
partition-invariant segment RNG."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import _workers as W
from varuna_sdk.model import (
    CutPoint,
    PartitionError,
    StageMap,
    balanced_stage_map,
    build_on_meta,
    gpt2,
    init_gpt2,
    materialize,
    preset,
    segment_rng,
    shared_state,
    stage_state_names,
    trace_model,
)
from varuna_sdk.model.tracer import segment_costs

SAMPLE = (torch.zeros(2, 16, dtype=torch.long),)


def traced_gpt2(n_layer: int, **kw):
    cfg = preset("tiny", n_layer=n_layer, bias=False, **kw)
    meta = build_on_meta(lambda: gpt2(cfg))
    return meta, trace_model(meta, SAMPLE)


def stage_cost(costs, stage_map):
    return max(sum(costs[a:b]) for a, b in stage_map.ranges)


# ---------------------------------------------------------------------------------------------
# bug-report inputs: uneven splits that other pipeline systems got wrong


@pytest.mark.parametrize("n_layer,P", [(7, 3), (61, 8), (58, 8), (42, 16)])
def test_balanced_split_of_gpt2_puts_every_block_on_exactly_one_stage(n_layer, P):
    """GPT-2 with n blocks has n + 2 segments ([embeddings], blocks…, [head]); a cost-balanced
    split into P stages (P need not divide anything) is contiguous, covers every segment, leaves
    no stage empty, places each block's parameters wholly on one stage, and shares only the tied
    embedding (first ↔ last stage). Its slowest stage is no slower than the uniform split's."""
    meta, s = traced_gpt2(n_layer)
    assert s.num_segments == n_layer + 2
    costs = segment_costs(s)
    sm = balanced_stage_map(costs, P)
    assert sm.P == P and sm.ranges[0][0] == 0 and sm.ranges[-1][1] == s.num_segments
    assert all(a < b for a, b in sm.ranges), sm
    assert all(sm.ranges[i][1] == sm.ranges[i + 1][0] for i in range(P - 1)), sm

    held = [stage_state_names(s, sm, st) for st in range(P)]
    assert all(h for h in held), f"an empty stage in {sm}"
    all_params = {n for n, _ in meta.named_parameters()}
    assert set().union(*held) == all_params
    for i in range(n_layer):
        block = {n for n in all_params if n.startswith(f"h.{i}.")}
        owners = [st for st in range(P) if held[st] & block]
        assert len(owners) == 1, f"block {i} is on stages {owners}"
        assert block <= held[owners[0]]
    multi = {n for n in all_params if sum(n in h for h in held) > 1}
    assert multi == {"wte.weight"}
    assert shared_state(s, sm) == {"wte.weight": [0, P - 1]}
    assert stage_cost(costs, sm) <= stage_cost(costs, StageMap.uniform(s.num_segments, P)) * (1 + 1e-12)


def test_balanced_split_follows_costs():
    """Cost balancing, not segment counting: one heavy segment gets a stage of its own."""
    sm = balanced_stage_map([1, 1, 1, 10, 1, 1, 1], 3)
    assert sm.ranges == ((0, 3), (3, 4), (4, 7))
    assert balanced_stage_map([5.0], 1).ranges == ((0, 1),)


@pytest.mark.parametrize("P", [10, 11, 40])
def test_depth_larger_than_segment_count_is_a_partition_error(P):
    _, s = traced_gpt2(7)  # 9 segments
    n = s.num_segments
    msg = (rf"P={P} is larger than the model's {n} segments \(the pieces its {n - 1} cut-points split it into: "
           rf"typically what comes before the first block, each block, and what comes after the last\); choose P <= {n}")
    with pytest.raises(PartitionError, match=msg):
        balanced_stage_map(segment_costs(s), P)
    with pytest.raises(PartitionError, match=msg):
        StageMap.uniform(n, P)
    with pytest.raises(PartitionError, match="at least 1"):
        balanced_stage_map(segment_costs(s), 0)
    assert balanced_stage_map(segment_costs(s), n).P == n  # one segment per stage is fine


def test_explicit_boundaries_are_checked():
    assert StageMap.from_lists([[0, 1], [2, 3, 4]], 5).ranges == ((0, 2), (2, 5))
    with pytest.raises(PartitionError, match="stage 1 has no segments"):
        StageMap.from_lists([[0, 1], [], [2]], 3)
    with pytest.raises(PartitionError, match="stage 1 must start at segment 2"):
        StageMap.from_lists([[0, 1], [3]], 4)
    with pytest.raises(PartitionError, match="contiguous"):
        StageMap.from_lists([[0, 2], [1]], 3)
    with pytest.raises(PartitionError, match="last stage must end at segment 4"):
        StageMap.from_lists([[0, 1], [2]], 5)


# ---------------------------------------------------------------------------------------------
# partition errors


def test_tensor_skipping_a_cut_point_across_stages_names_both_segments():
    """LeakyModel makes ``skip`` in segment 0 and uses it in segment 2 without a cut-point: any
    split separating them is a PartitionError naming both segments (with their modules) and the
    fix; a split keeping them together is fine."""
    s = trace_model(build_on_meta(W.LeakyModel), SAMPLE)
    assert s.num_segments == 3
    assert any(p == 0 and c == 2 for p, c, _ in s.cross_uses), s.cross_uses
    for lists in ([[0, 1], [2]], [[0], [1, 2]], [[0], [1], [2]]):
        with pytest.raises(PartitionError) as ei:
            shared_state(s, StageMap.from_lists(lists, 3))
        msg = str(ei.value)
        assert "segment 0 (emb)" in msg and re.search(r"segment 2 \([^)]*fc2", msg), msg
        assert "without passing through the cut-points in between" in msg and "CutPoint" in msg
    assert shared_state(s, StageMap.from_lists([[0, 1, 2]], 3)) == {}


def test_undeclared_shared_parameter_names_parameter_and_stages():
    """Declared mode (``shared_params=[]``): GPT-2's tied embedding on stages 0 and 1 is a
    PartitionError naming the parameter, the stages and both fixes; declaring it or automatic
    tying (``None``) accepts it."""
    _, s = traced_gpt2(2)
    sm = balanced_stage_map(segment_costs(s), 2)
    with pytest.raises(PartitionError) as ei:
        shared_state(s, sm, [])
    msg = str(ei.value)
    assert "parameter 'wte.weight' is used on stages [0, 1]" in msg
    assert "shared_params=['wte.weight']" in msg and "shared_params=None" in msg
    assert shared_state(s, sm, ["wte.weight"]) == {"wte.weight": [0, 1]}
    assert shared_state(s, sm, None) == {"wte.weight": [0, 1]}
    assert shared_state(s, StageMap.from_lists([list(range(s.num_segments))], s.num_segments), []) == {}
    # a misspelt name is refused with the closest valid one (it used to be ignored silently)
    with pytest.raises(PartitionError, match=r"shared_params names 'wte.weigth', which is not a parameter of the "
                                             r"model; did you mean 'wte.weight'\?"):
        shared_state(s, sm, ["wte.weigth"])


class _BufferTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 8)
        self.fc = nn.Linear(8, 64)
        self.register_buffer("bias_buf", torch.zeros(8))
        self.cut1, self.cut2 = CutPoint(), CutPoint()

    def forward(self, idx):
        x = self.cut1(self.emb(idx) + self.bias_buf)
        x = self.cut2(x * 2)
        return self.fc(x + self.bias_buf)


class _BufferWrittenTwice(_BufferTwice):
    def forward(self, idx):
        self.bias_buf.mul_(0.5)   # state the forward updates (a running statistic)
        return super().forward(idx)


class _BufferReplaced(_BufferTwice):
    def forward(self, idx):
        self.bias_buf = self.bias_buf + 1   # replaced, not changed in place: written all the same
        return super().forward(idx)


def test_a_buffer_the_forward_writes_may_not_be_on_two_stages_and_a_read_only_one_may():
    """A buffer only read (a constant mask) is held by every stage using it, identical copies, no
    gradient sum; one the forward changes in place or replaces is refused on two stages (its
    copies would drift apart), naming it, its stages and the fix."""
    s = trace_model(build_on_meta(_BufferTwice), SAMPLE)
    assert s.read_only_buffers == ["bias_buf"]
    assert shared_state(s, StageMap.from_lists([[0, 1], [2]], 3)) == {}
    assert trace_model(build_on_meta(_BufferReplaced), SAMPLE).read_only_buffers == []
    s = trace_model(build_on_meta(_BufferWrittenTwice), SAMPLE)
    assert s.read_only_buffers == []
    with pytest.raises(PartitionError, match=r"buffer 'bias_buf' is used on stages \[0, 1\] .* and the forward "
                                             r"changes it"):
        shared_state(s, StageMap.from_lists([[0, 1], [2]], 3))


def test_data_dependent_forward_is_reported_with_its_segment():
    class DataDependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.cut, self.fc = nn.Embedding(64, 8), CutPoint(), nn.Linear(8, 8)

        def forward(self, idx):
            x = self.cut(self.emb(idx))
            if x.sum() > 0:
                x = x * 2
            return self.fc(x)

    with pytest.raises(RuntimeError, match=r"segment 1.*computed from the model's weights"):
        trace_model(build_on_meta(DataDependent), SAMPLE)


# ---------------------------------------------------------------------------------------------
# tracing, materialisation, RNG


@pytest.mark.parametrize("order", ["xms", "mxs"])
def test_mixed_boundary_tensors_are_traced_with_dtype_and_grad(order):
    s = trace_model(build_on_meta(lambda: W.MixedModel(order=order)), SAMPLE)
    assert s.num_segments == 5
    x = {"dtype": "float32", "requires_grad": True, "shape": [2, 16, 16]}
    m = {"dtype": "int64", "requires_grad": False, "shape": [2, 16]}
    sc = {"dtype": "float32", "requires_grad": False, "shape": [2, 16, 1]}
    expect = [x, m, sc] if order == "xms" else [m, x, sc]
    assert s.crossings == [expect] * 4
    assert s.cross_uses == []


def test_cut_points_inside_sub_modules_are_counted():
    s = trace_model(build_on_meta(W.NestedModel), SAMPLE)
    assert s.num_segments == 6  # 2 groups × 2 inner cut-points + the final one
    assert s.state_segments["emb.weight"] == [0] and s.state_segments["head.weight"] == [5]
    assert s.state_segments["groups.1.blocks.1.1.weight"] == [4]


class _TLinear(nn.Linear):
    """Reads its weight through a property, as transformers' FalconLinear does (``x @ self.weight.T``)."""

    def forward(self, x):
        return x @ self.weight.T + self.bias


class _PropertyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.blocks = nn.ModuleList([_TLinear(8, 8) for _ in range(3)])
        self.head = nn.Parameter(torch.randn(10, 8))

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return x @ self.head.mT


def test_a_weight_read_through_a_tensor_property_belongs_to_the_segment_that_reads_it():
    """``w.T``/``w.mT`` are property getters: the dry run counted no use, put such weights in
    segment 0, and a later stage ran its block with meta weights (Falcon at P=2: "invalid gradient
    ... expected device meta")."""
    from varuna_sdk.model.spec import prepare_model

    s = trace_model(build_on_meta(lambda: prepare_model(_PropertyModel())), (torch.zeros(2, 4, dtype=torch.long),))
    assert s.num_segments == 5   # embedding | block 0 | block 1 | block 2 | head
    assert [s.state_segments[f"blocks.{i}.weight"] for i in range(3)] == [[1], [2], [3]]
    assert s.state_segments["head"] == [4] and s.state_segments["emb.weight"] == [0]


def test_gpt2_auto_cut_points_and_tied_weight_segments():
    _, s = traced_gpt2(3)
    assert s.num_segments == 5
    assert all(c == [{"dtype": "float32", "requires_grad": True, "shape": [2, 16, 32]}] for c in s.crossings)
    assert s.state_segments["wte.weight"] == [0, 4]
    assert s.state_segments["h.1.mlp.c_fc.weight"] == [2]


def test_stage_materialisation_matches_the_whole_model_bitwise():
    """Initial weights depend only on (seed, name): materialising one stage of a P=3 split gives
    exactly the tensors of the fully materialised model, and the last stage's ``lm_head`` *is* its
    ``wte`` (re-tied); everything else stays on meta."""
    cfg = preset("tiny", n_layer=3, bias=False)
    init = lambda m, n: init_gpt2(m, n, n_layer=3)  # noqa: E731
    full = build_on_meta(lambda: gpt2(cfg))
    materialize(full, [n for n, _ in full.named_parameters()], seed=7, init_fn=init)
    ref = dict(full.named_parameters())
    s = trace_model(build_on_meta(lambda: gpt2(cfg)), SAMPLE)
    sm = balanced_stage_map(segment_costs(s), 3)
    for st in range(3):
        part = build_on_meta(lambda: gpt2(cfg))
        names = stage_state_names(s, sm, st)
        materialize(part, names, seed=7, init_fn=init)
        for n, p in part.named_parameters():
            if n in names:
                assert p.device.type == "cpu" and torch.equal(p, ref[n]), n
            else:
                assert p.device.type == "meta", n
        if st == 2:
            assert part.lm_head.weight is part.wte.weight and part.wte.weight.device.type == "cpu"
    with pytest.raises(KeyError, match="nope"):
        materialize(build_on_meta(lambda: gpt2(cfg)), ["nope"], seed=0)


def test_segment_rng_is_reproducible_per_micro_batch_and_leaves_caller_rng_alone():
    cfg = preset("tiny", n_layer=2, dropout=0.5, bias=False)
    model = build_on_meta(lambda: gpt2(cfg))
    materialize(model, [n for n, _ in model.named_parameters()], seed=0, init_fn=init_gpt2)
    model.train()
    x = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(123)
    before = torch.get_rng_state()
    with segment_rng(1, 0, 0):
        a = model(x)
    with segment_rng(1, 0, 0):
        b = model(x)
    with segment_rng(1, 0, 1):
        c = model(x)
    with segment_rng(1, 1, 0):
        d = model(x)
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(a, b)
    assert not torch.allclose(a, c) and not torch.allclose(a, d)


def test_an_encoder_decoder_gets_cut_points_in_both_stacks():
    """T5, BART and ``nn.Transformer``: both the encoder's and the decoder's blocks are bodies
    (encoder first), so a split can cut the decoder too; T5 with 3 + 3 blocks has 9 segments
    (embeddings, 3 encoder blocks, between, 3 decoder blocks, head), and P = 3 ends no stage at the
    encoder's end alone: the last stage no longer holds the whole decoder."""
    import transformers

    from tests.thirdparty import hf_models
    from varuna_sdk.model.cutpoint import auto_cutpoints, find_block_lists
    from varuna_sdk.model.partition import unsplittable_cuts

    bart = transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=64, d_model=16, encoder_layers=2, decoder_layers=3, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32))
    assert [n for n, _ in find_block_lists(bart)] == ["model.encoder.layers", "model.decoder.layers"]
    tr = nn.Transformer(d_model=16, nhead=2, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=32)
    assert [n for n, _ in find_block_lists(tr)] == ["encoder.layers", "decoder.layers"]
    assert [n for n, _ in find_block_lists(gpt2(preset("tiny")))] == ["h"]   # one stack: as before

    t5 = build_on_meta(lambda: auto_cutpoints(hf_models.t5(n_layer=3)))
    x = torch.randint(0, 256, (2, 24))
    s = trace_model(t5, {"input_ids": x, "labels": x}, torch.device("cpu"))
    assert s.num_segments == t5._varuna_auto_segments == 9
    cuts = balanced_stage_map(segment_costs(s), 3, unsplittable_cuts(s)).ranges
    assert cuts[-1][0] > 5, cuts   # the last stage starts inside the decoder (segments 5..8)
