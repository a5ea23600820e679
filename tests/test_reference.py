"""``Job.batch`` and ``Job.plain_pytorch_losses`` (``varuna_sdk.reference``): a user's own check
that the pipeline trains their model as plain PyTorch does. The pipeline's losses come from real
worker processes (``varuna train``'s path, the manager, gloo); the reference is the unpartitioned
model in this process — two computations that share only the data and the initial weights."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from varuna_sdk.config import DataConfig, JobConfig, LaunchConfig, ModelConfig, ParallelConfig, TrainConfig
from varuna_sdk.notebook import Job
from varuna_sdk.runner import train_local

TEXT = "".join(f"Line {i}: the quick brown fox jumps over {i % 7} lazy dogs.\n" for i in range(400))


@pytest.fixture(autouse=True)
def _cache(own_cache):
    """Each test calibrates its models afresh (the host's network figures are the session's)."""


def _pipeline_losses(job: JobConfig, tmp_path) -> list[float]:
    return [m["loss"] for m in train_local(job, run_dir=tmp_path / "run").metrics()]


@pytest.mark.timeout(240)
def test_a_dataset_classifier_at_P2_has_the_losses_plain_pytorch_gives(tmp_path):
    """(x, y) examples, a classifier, P=2 stages, 4 micro-batches, clipping on: every step's loss
    equals ``plain_pytorch_losses`` (and a reference built from ``batch`` by hand agrees too)."""
    job = JobConfig(name="ref-classify", model=ModelConfig(factory="tests.thirdparty.user_data:Classifier"),
                    data=DataConfig(dataset="tests.thirdparty.user_data:make_dataset", dataset_kwargs={"n": 400}),
                    parallel=ParallelConfig(P=2, D=1, global_batch=16, micro_batch_size=4),
                    train=TrainConfig(steps=5, lr=1e-2, warmup_steps=1, eval_batches=1, grad_clip=0.5,
                                      run_dir=str(tmp_path / "runs")))
    got = _pipeline_losses(job, tmp_path)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["loss_end"] > 0 and summary["ppl_start"] is None and summary["ppl_end"] is None  # no perplexity
    handle = Job(job)
    ref = handle.plain_pytorch_losses(5)
    assert got == pytest.approx(ref, rel=1e-5), (got, ref)
    mbs = handle.batch(0)
    assert len(mbs) == 4 and all(x[0].shape == (4, 16) and y.shape == (4,) for x, y in mbs)
    whole = handle.batch(0, micro_batch_size=16)
    assert len(whole) == 1 and torch.equal(whole[0][0][0], torch.cat([x[0] for x, _ in mbs]))
    from tests.thirdparty.user_data import Classifier

    mine = Classifier()
    mine.load_state_dict(handle.initial_weights())  # by hand: the user's own copy, the first step's loss
    first = sum(torch.nn.functional.cross_entropy(mine(x[0]), y).item() for x, y in mbs) / len(mbs)
    assert first == pytest.approx(got[0], rel=1e-5)


@pytest.mark.timeout(240)
def test_a_language_model_at_D2_matches_and_random_draws_are_the_pipelines(tmp_path):
    """Text through a byte tokenizer, Hugging Face's GPT-2 with dropout 0.1 (on the embeddings,
    before the first cut-point, and in every block) at P=2 × D=2 (each replica half the mini-batch):
    the losses equal plain PyTorch's over the whole mini-batch's micro-batches, with no warning —
    the reference draws the pipeline's random numbers (each segment of each micro-batch seeded as
    the workers seed it); it warned and differed by the dropout noise (helper trial: Whisper's
    SpecAugment differed at step 0, and between two calls). A model of one's own passed as
    ``model=``, or another micro-batch size, draws others and is warned about."""
    f = tmp_path / "t.txt"
    f.write_text(TEXT)
    job = JobConfig(name="ref-dropout", model=ModelConfig(factory="tests.thirdparty.hf_models:gpt2",
                                                          kwargs={"n_layer": 2, "dropout": 0.1}),
                    data=DataConfig(path=str(f), tokenizer="byte", seq_len=16),
                    parallel=ParallelConfig(P=2, D=2, global_batch=8, micro_batch_size=2),
                    train=TrainConfig(steps=3, lr=3e-3, warmup_steps=1, eval_batches=1,
                                      run_dir=str(tmp_path / "runs")), launch=LaunchConfig(gpus=4))
    got = _pipeline_losses(job, tmp_path)
    handle = Job(job)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # the pipeline's own draws: nothing to warn about
        ref = handle.plain_pytorch_losses(3)
    assert got == pytest.approx(ref, rel=1e-5), (got, ref)
    inputs, targets = handle.batch(2)[0]   # model(input_ids=, labels=): its own loss, which shifts the labels
    assert inputs["input_ids"].shape == (2, 16) and targets is None
    assert torch.equal(inputs["input_ids"], inputs["labels"])
    import transformers

    bloom = transformers.BloomForCausalLM(transformers.BloomConfig(vocab_size=256, hidden_size=16, n_layer=1, n_head=2,
                                                                   hidden_dropout=0.1))
    with pytest.warns(UserWarning, match=r"config.hidden_dropout=0.1.* \(dropout with p > 0, or random numbers\)"):
        handle.plain_pytorch_losses(1, model=bloom)   # functional dropout (F.dropout), no Dropout module
    noisy = JobConfig(name="ref-noise", model=ModelConfig(factory="tests.thirdparty.plain_models:NoisyLM"),
                      data=DataConfig(path=str(f), tokenizer="byte", seq_len=16),
                      parallel=ParallelConfig(P=1, D=1, global_batch=4, micro_batch_size=2),
                      train=TrainConfig(steps=2, run_dir=str(tmp_path / "runs")))
    with pytest.warns(UserWarning, match=r"randn_like\(\) in its forward .*at micro-batch size 4, not the job's 2, "
                                         r"plain PyTorch draws others"):
        Job(noisy).plain_pytorch_losses(1, micro_batch_size=4)
    with pytest.warns(UserWarning, match=r"Dropout \(dropout with p > 0, or random numbers\)"):
        Job(noisy).plain_pytorch_losses(1, model=torch.nn.Sequential(torch.nn.Embedding(256, 8), torch.nn.Dropout(0.1),
                                                                   torch.nn.Linear(8, 256)))


def test_tuple_examples_go_to_a_forward_that_takes_targets_and_its_own_loss_is_used_at_P2(tmp_path):
    """``(x, y)`` examples and a single-file GPT whose ``forward(idx, targets=None)`` returns
    ``(logits, loss)`` with ``ignore_index=-1``: the targets go to the forward and its own loss is
    trained (targets padded with -1 are ignored, as the model says), at P = 2 equal to plain PyTorch.
    (The pipeline called ``model(x)``, whose logits are then the last position's only, and took its
    own cross-entropy of them: -1 targets failed in the workers.)"""
    job = JobConfig(name="ref-tuple-own", model=ModelConfig(factory="tests.thirdparty.singlefile_gpt:make_gpt",
                                                            kwargs={"n_layer": 2, "block_size": 16, "dropout": 0.0}),
                    data=DataConfig(dataset="tests.thirdparty.user_data:padded_windows", tokenizer=None),
                    parallel=ParallelConfig(P=2, D=1, global_batch=8, micro_batch_size=2),
                    train=TrainConfig(steps=3, lr=3e-3, warmup_steps=1, eval_batches=1, run_dir=str(tmp_path / "runs")))
    handle = Job(job)
    assert handle.resolved.spec.call.describe() == "model(idx=example[0], targets=example[1]), its own loss"
    got = _pipeline_losses(job, tmp_path)
    assert got == pytest.approx(handle.plain_pytorch_losses(3), rel=1e-5)


@pytest.mark.parametrize("P,split", [(2, False), (3, True)])
def test_blocks_the_user_checkpoints_train_across_stages_as_plain_pytorch(tmp_path, P, split):
    """A forward that runs each block under ``torch.utils.checkpoint`` (non-reentrant), with a
    residual outside the blocks: the checkpoint recomputes a stage's first block in the backward
    from the argument it saved, which on a later stage is the prefix's meta tensor; the received
    tensor is put in its place there too (it failed: "Tensor on device cpu is not on the expected
    device meta"). Losses equal plain PyTorch's, with the whole and the split backward."""
    job = JobConfig(name=f"ref-ckpt-{P}", model=ModelConfig(factory="tests.thirdparty.plain_models:CheckpointedBlocks"),
                    data=DataConfig(dataset="tests.thirdparty.user_data:make_dataset", tokenizer=None),
                    parallel=ParallelConfig(P=P, D=1, global_batch=8, micro_batch_size=2, split_backward=split),
                    train=TrainConfig(steps=3, lr=1e-2, warmup_steps=1, eval_batches=1, run_dir=str(tmp_path / "runs")))
    got = _pipeline_losses(job, tmp_path)
    assert got == pytest.approx(Job(job).plain_pytorch_losses(3), rel=1e-5)


def test_numpy_randomness_in_the_forward_is_the_same_in_a_recompute_and_at_any_P(tmp_path):
    """A forward drawing masks from NumPy's global generator: every segment of every micro-batch
    seeds it as it seeds torch's, so a recomputing stage draws its forward's masks again and the
    losses at P = 2 (stage 0 recomputes) equal those at P = 1 (they were different draws: the
    gradient came from another mask than the forward's, and every run differed)."""
    def job(P: int, recompute: bool) -> JobConfig:
        return JobConfig(name=f"ref-np-{P}", model=ModelConfig(factory="tests.thirdparty.plain_models:NumpyMasked"),
                         data=DataConfig(dataset="tests.thirdparty.user_data:make_dataset", tokenizer=None),
                         parallel=ParallelConfig(P=P, D=1, global_batch=8, micro_batch_size=2, recompute=recompute),
                         train=TrainConfig(steps=3, lr=1e-2, warmup_steps=1, eval_batches=1,
                                           run_dir=str(tmp_path / "runs")))
    one = _pipeline_losses(job(1, False), tmp_path / "p1")
    two = _pipeline_losses(job(2, True), tmp_path / "p2")
    assert two == pytest.approx(one, rel=1e-5), (one, two)


def test_blocks_in_a_module_dict_named_by_model_blocks_train_at_P2(tmp_path):
    """``model.blocks`` naming an ``nn.ModuleDict``: a cut-point before each of its blocks, in the
    dict's order, and at P = 2 the losses plain PyTorch gives (it was refused: not a ModuleList)."""
    job = JobConfig(name="ref-dict", model=ModelConfig(factory="tests.thirdparty.plain_models:DictBlocks",
                                                       blocks="stages"),
                    data=DataConfig(dataset="tests.thirdparty.user_data:make_dataset", tokenizer=None),
                    parallel=ParallelConfig(P=2, D=1, global_batch=8, micro_batch_size=2),
                    train=TrainConfig(steps=3, lr=1e-2, warmup_steps=1, eval_batches=1, run_dir=str(tmp_path / "runs")))
    handle = Job(job)
    assert handle.resolved.spec.identity["kind"] == "import"
    assert _pipeline_losses(job, tmp_path) == pytest.approx(handle.plain_pytorch_losses(3), rel=1e-5)


def test_frames_overwritten_in_place_before_the_first_block_train_at_P2(tmp_path):
    """SpecAugment's ``h[mask] = emb`` on the input projection (Wav2Vec2, HuBERT): a later stage
    got the projection's recorded meta output, a view made under no_grad, and the in-place write
    failed ("a view was created in no_grad mode", helper-67); it trains as plain PyTorch does."""
    from tests.thirdparty.plain_models import MaskedFrames

    job = JobConfig(name="ref-specaug", model=ModelConfig(factory="tests.thirdparty.plain_models:MaskedFrames"),
                    data=DataConfig(dataset="tests.thirdparty.user_data:make_dataset", tokenizer=None),
                    parallel=ParallelConfig(P=2, D=1, global_batch=8, micro_batch_size=2),
                    train=TrainConfig(steps=3, lr=1e-2, warmup_steps=1, eval_batches=1, run_dir=str(tmp_path / "runs")))
    handle = Job(job)
    assert _pipeline_losses(job, tmp_path) == pytest.approx(handle.plain_pytorch_losses(3), rel=1e-5)
    # where the cut-points fell, before any plan (helper-67 could not see it): one row per segment
    segs = handle.segments
    assert list(segs["modules"]) == ["(the model's own), inp", "layers.0.0", "layers.1.0", "layers.2.0", "layers.3.0",
                                     "head"], segs
    model = MaskedFrames()
    assert segs["param_bytes"].sum() == sum(p.numel() * p.element_size() for p in model.parameters())
    assert segs["forward_flops_share"].sum() == pytest.approx(1.0)


def test_bad_steps_and_micro_batch_sizes_are_refused_with_the_valid_ones(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text(TEXT)
    job = Job(JobConfig(name="ref-bad", model=ModelConfig(factory="tests.thirdparty.plain_models:wide_mlp"),
                        data=DataConfig(path=str(f), tokenizer="byte", seq_len=16),
                        parallel=ParallelConfig(P=1, D=1, global_batch=12, micro_batch_size=4),
                        train=TrainConfig(steps=3, run_dir=str(tmp_path / "runs"))))
    with pytest.raises(ValueError, match=r"step 3 is outside the job's steps 0 \.\. 2"):
        job.batch(3)
    with pytest.raises(TypeError, match="step must be an int"):
        job.batch(1.0)
    with pytest.raises(ValueError, match=r"micro_batch_size 5 does not divide the global batch 12.*\[1, 2, 3, 4, 6, 12\]"):
        job.batch(0, micro_batch_size=5)
    with pytest.raises(ValueError, match=r"steps must be an int in 1 \.\. 3"):
        job.plain_pytorch_losses(0)
    job.config.train.precision = "fp16"
    with pytest.raises(ValueError, match="fp16's loss scaler"):
        job.plain_pytorch_losses(1)
    assert [len(job.batch(s)) for s in range(3)] == [3, 3, 3]
    assert not torch.equal(job.batch(0)[0][0][0], job.batch(1)[0][0][0])  # each step its own examples


@pytest.mark.timeout(240)
def test_a_hugging_face_regressor_on_dict_examples_uses_its_own_loss_at_P2(tmp_path):
    """Dict examples with a float ``labels`` score and ``BertForSequenceClassification(num_labels=1)``:
    the forward takes ``labels``, so it gets them and its own loss (MSE for one label — a
    cross-entropy of the logits against a float score would be another objective); the dataset's own
    labels are not taken for text (no "not a causal language model" warning); the losses at P=2 are
    plain PyTorch's."""
    job = JobConfig(name="ref-regress", model=ModelConfig(factory="tests.thirdparty.hf_models:bert_classifier"),
                    data=DataConfig(dataset="tests.thirdparty.user_data:scored_sentences"),
                    parallel=ParallelConfig(P=2, D=1, global_batch=8, micro_batch_size=2),
                    train=TrainConfig(steps=3, lr=3e-3, warmup_steps=1, eval_batches=1, run_dir=str(tmp_path / "runs")))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        handle = Job(job)
    assert handle.resolved.spec.describe().endswith("model(input_ids=input_ids, attention_mask=attention_mask, "
                                               "labels=labels), its own loss")
    got = _pipeline_losses(job, tmp_path)
    ref = handle.plain_pytorch_losses(3)
    assert got == pytest.approx(ref, rel=1e-5), (got, ref)
    from tests.thirdparty.hf_models import bert_classifier

    mine = bert_classifier()
    mine.load_state_dict(handle.initial_weights())
    inputs, labels = handle.batch(0, micro_batch_size=8)[0]
    assert labels is None and inputs["labels"].dtype == torch.float32
    with torch.no_grad():
        mse = torch.nn.functional.mse_loss(mine(input_ids=inputs["input_ids"]).logits.squeeze(-1), inputs["labels"])
    assert mse.item() == pytest.approx(got[0], rel=1e-5)  # the objective is the regression's, computed by hand


@pytest.mark.timeout(240)
@pytest.mark.parametrize("P,recompute,split,paired", [(2, True, False, False), (2, False, True, True),
                                                      (3, False, False, True)])
def test_a_residual_added_outside_the_blocks_trains_across_a_stage_boundary(tmp_path, P, recompute, split, paired):
    """``x = x + layer(x)``: the stage that receives ``x`` at its first cut-point also adds it after
    the block's call, by the object the forward held before the cut (on that stage a meta stand-in):
    the received tensor is substituted there too, and its gradient holds both uses. At P=2 (with
    recompute, or with the backward split) and P=3 (whose balanced split would start the last
    stage after the last block, where ``x`` does not cross: it starts a stage elsewhere) the losses
    are plain PyTorch's. ``paired``: each block a ``ModuleList`` the forward iterates (``for attn, ff
    in self.layers``), never called: its cut-point sits before its first sub-block."""
    f = tmp_path / "t.txt"
    f.write_text(TEXT)
    job = JobConfig(name="ref-outer", model=ModelConfig(factory="tests.thirdparty.plain_models:outer_residual",
                                                        kwargs={"paired": paired}),
                    data=DataConfig(path=str(f), tokenizer="byte", seq_len=16),
                    parallel=ParallelConfig(P=P, D=1, global_batch=8, micro_batch_size=2, recompute=recompute,
                                            split_backward=split),
                    train=TrainConfig(steps=3, lr=3e-3, warmup_steps=1, eval_batches=1, run_dir=str(tmp_path / "runs")))
    handle = Job(job)
    assert handle.resolved.spec.describe().endswith("model(input_ids), loss(output, targets)")
    from varuna_sdk.trainer import model_structure

    assert model_structure(job, handle.resolved).num_segments == 6   # 4 blocks (pairs too): 5 cut-points
    got = _pipeline_losses(job, tmp_path)
    assert got == pytest.approx(handle.plain_pytorch_losses(3), rel=1e-5)


def test_a_boundary_the_outer_residual_cannot_cross_is_still_refused_clearly():
    """After the last block the automatic cut-point carries the block's output only, so the final
    ``x + layer(x)`` needs an ``x`` that a stage starting there would not have: a split there is
    refused, naming the segments; a split before any block is accepted."""
    from varuna_sdk.model import auto_cutpoints
    from varuna_sdk.model.materialize import build_on_meta
    from varuna_sdk.model.partition import (PartitionError, StageMap, balanced_stage_map, check_tensor_flow,
                                            unsplittable_cuts)
    from varuna_sdk.model.tracer import trace_model
    from tests.thirdparty.plain_models import outer_residual

    s = trace_model(build_on_meta(lambda: auto_cutpoints(outer_residual())), (torch.zeros(2, 16, dtype=torch.long),))
    assert s.num_segments == 6 and not s.cross_uses and s.carried_uses
    check_tensor_flow(s, StageMap(((0, 3), (3, 6))))                         # x received at cut-point 2
    check_tensor_flow(s, StageMap(((0, 2), (2, 4), (4, 6))))
    with pytest.raises(PartitionError, match=r"a \[.*\] float32 tensor made by '\w+' in segment \d.* is used in segment 5 \(norm, head\) on stage 1 \(by 'add'\)"):
        check_tensor_flow(s, StageMap(((0, 5), (5, 6))))
    assert unsplittable_cuts(s) == {4}
    assert balanced_stage_map([1.0] * 6, 6 - 1, {4}).ranges[-1] != (5, 6)  # no stage starts after cut-point 4
    for P in (2, 3, 4, 5):
        check_tensor_flow(s, balanced_stage_map([1.0, 1.0, 1.0, 1.0, 1.0, 3.0], P, unsplittable_cuts(s)))
    assert balanced_stage_map([1.0] * 6, 6, {4}).P == 6  # no other split: the check above names the tensor


def test_tokens_per_example_counts_token_ids_not_a_bool_mask(tmp_path):
    """``tokens_per_s`` of a dataset job: an ``input_ids`` field's length (16); examples without
    token ids (floats and a bool mask; floats and an integer class label) have none, so the job
    reports examples/s only — a mask of 12 flags is not 12 tokens (tokens/s was 12 x examples/s),
    nor is a label one token (tokens/s was equal to examples/s)."""
    from varuna_sdk.trainer import tokens_per_example

    def job_of(dataset, **model):
        return Job(JobConfig(name="tpe", model=ModelConfig(**model), data=DataConfig(dataset=dataset),
                             parallel=ParallelConfig(P=1, D=1, global_batch=8, micro_batch_size=2),
                             train=TrainConfig(steps=2, run_dir=str(tmp_path / "runs"))))

    j = job_of("tests.thirdparty.user_data:scored_sentences", factory="tests.thirdparty.hf_models:bert_classifier")
    assert tokens_per_example(j.config, j.resolved) == 16
    j = job_of("tests.thirdparty.user_data:masked_regression", factory="tests.thirdparty.user_data:MaskedMLP",
               targets="target", loss="tests.thirdparty.user_data:mse")
    assert tokens_per_example(j.config, j.resolved) is None
    j = job_of("tests.thirdparty.user_data:make_dataset", factory="tests.thirdparty.user_data:Classifier")
    assert tokens_per_example(j.config, j.resolved) is None
    # uint8 images [1, 16, 16] are pixels, not 256 tokens (tokens/s was 256 x examples/s: helper-59)
    from torch.utils.data import TensorDataset

    images = TensorDataset(torch.randint(0, 255, (64, 1, 16, 16), dtype=torch.uint8), torch.zeros(64, dtype=torch.long))
    conv = lambda: torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(256, 4))  # noqa: E731
    j = Job(model=lambda: _Pixels(conv()), data=images, steps=2, P=1, D=1, global_batch=8, run_dir=str(tmp_path / "px"))
    assert tokens_per_example(j.config, j.resolved) is None


class _Pixels(torch.nn.Module):
    """A model that takes uint8 pixels and scales them itself."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x.float() / 255)


def _aux_job(tmp_path, aux_from: int, P: int) -> JobConfig:
    f = tmp_path / "t.txt"
    f.write_text(TEXT)
    return JobConfig(name="ref-aux", model=ModelConfig(factory="tests.thirdparty.plain_models:aux_output",
                                                       kwargs={"aux_from": aux_from},
                                                       loss="tests.thirdparty.plain_models:aux_loss"),
                     data=DataConfig(path=str(f), tokenizer="byte", seq_len=16),
                     parallel=ParallelConfig(P=P, D=1, global_batch=8, micro_batch_size=2),
                     train=TrainConfig(steps=3, lr=3e-3, warmup_steps=1, eval_batches=1, run_dir=str(tmp_path / "runs")))


@pytest.mark.timeout(240)
def test_a_loss_using_an_output_made_mid_pipeline_shapes_the_split_or_is_refused(tmp_path):
    """A model returning ``(logits, aux)`` whose loss adds ``aux``. Made in block 2 of 4: the
    automatic split keeps block 2 onwards on the last stage (launcher and workers trace the loss
    alike), and P=2 trains as plain PyTorch does. Made in block 0, P=4 cannot keep it: refused
    before any process starts, naming the loss (it used to crash in the last stage's backward)."""
    from varuna_sdk.model.partition import PartitionError

    from varuna_sdk.trainer import check_partition

    job = _aux_job(tmp_path, aux_from=2, P=2)
    handle = Job(job)
    split = check_partition(job, handle.resolved)
    assert split.startswith("stages (segments) [[0, 1"), split  # segment 3 (block 2) on the last stage
    assert "3, 4, 5]]" in split, split
    got = _pipeline_losses(job, tmp_path)
    ref = handle.plain_pytorch_losses(3)
    assert got == pytest.approx(ref, rel=1e-5), (got, ref)
    with pytest.raises(PartitionError, match=r"\(by .* \(in the loss\)\)"):
        Job(_aux_job(tmp_path, aux_from=0, P=4))


@pytest.mark.timeout(240)
def test_a_hugging_face_convnext_on_image_dicts_at_P2_matches_plain_pytorch(tmp_path):
    """ConvNextForImageClassification (its constructor reads ``linspace(...).tolist()``, which failed
    while it was built on meta) on dict examples of ``pixel_values`` and ``labels`` (its own loss),
    split into 2 stages: the same losses as plain PyTorch."""
    job = JobConfig(name="ref-convnext", model=ModelConfig(factory="tests.thirdparty.hf_models:convnext_classifier"),
                    data=DataConfig(dataset="tests.thirdparty.user_data:small_images"),
                    parallel=ParallelConfig(P=2, D=1, global_batch=8, micro_batch_size=2),
                    train=TrainConfig(steps=3, lr=3e-3, warmup_steps=1, eval_batches=1, run_dir=str(tmp_path / "runs")))
    got = _pipeline_losses(job, tmp_path)
    ref = Job(job).plain_pytorch_losses(3)
    assert got == pytest.approx(ref, rel=1e-5), (got, ref)


@pytest.mark.timeout(240)
def test_draws_of_pythons_random_and_of_the_loss_and_int32_ids_with_ones_own_loss_are_as_plain_pytorch(tmp_path):
    """A forward drawing from Python's ``random`` and a loss of one's own drawing from torch's
    generator (dropout on the logits), on int32 class ids, at P=2 × D=2: each was wrong (helper-60)
    — Python's draws were not seeded (losses changed between identical runs, 2e-3 from the
    reference), the loss's draws were the generator's state at the time (5e-2 off, different at
    every call), and int32 ids reached the loss as they are (the workers failed: "expected target
    dtype to be Long"). Now the forward's segments and the loss are each seeded by (seed, step,
    micro-batch, segment), and integer targets are int64: the losses equal plain PyTorch's."""
    job = JobConfig(name="draws", model=ModelConfig(factory="tests.thirdparty.user_data:PythonRandomClassifier",
                                                    loss="tests.thirdparty.user_data:dropout_cross_entropy"),
                    data=DataConfig(dataset="tests.thirdparty.user_data:int32_labels"),
                    parallel=ParallelConfig(P=2, D=2, global_batch=8, micro_batch_size=2),
                    train=TrainConfig(steps=3, lr=1e-2, warmup_steps=1, eval_batches=1,
                                      run_dir=str(tmp_path / "runs")), launch=LaunchConfig(gpus=4))
    got = _pipeline_losses(job, tmp_path)
    handle = Job(job)
    assert handle.batch(0)[0][1].dtype == torch.int64
    first = handle.plain_pytorch_losses(3)
    assert handle.plain_pytorch_losses(3) == first   # the same draws at every call
    assert got == pytest.approx(first, rel=1e-5), (got, first)
