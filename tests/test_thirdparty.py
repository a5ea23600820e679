"""Models this project did not write, trained unedited through the pipeline (real spawned gloo
processes), against the same model trained by plain PyTorch from the same initial weights.

- Hugging Face ``MixtralForCausalLM`` (mixture of experts run by ``torch._grouped_mm``) at P = 2;
- Hugging Face ``GPT2LMHeadModel`` (``Conv1D`` without ``reset_parameters``, tied embeddings,
  ``labels=`` → ``.loss``) and ``LlamaForCausalLM`` (rotary ``position_embeddings=(cos, sin)``
  handed to every layer, an ``inv_freq`` buffer made in ``__init__``) at (P, D) = (2, 1), (3, 1)
  and (2, 2), and with the zero-bubble split backward (``split_backward=True``) at P = 2 and 3;
- ``BertForMaskedLM`` (a tied head bias that ``post_init`` replaces with ``bias.data = pad(bias)``) and
  ``DebertaV2ForMaskedLM`` (relative position embeddings of the encoder used by every layer) at P = 2;
  ``BertForMaskedLM`` on text masked by the product (``data.mlm_probability``: BERT's masking with
  the ``[MASK]`` of a word-level ``tokenizer.json``) at (2, 1) and (2, 2), the reference fed the
  same masked examples (``labels`` -100 where nothing is predicted);
- ``GPT2LMHeadModel`` with frozen weights (``requires_grad=False``) on both stages, whole and split;
- Hugging Face ``T5ForConditionalGeneration`` (encoder-decoder; the relative position bias is made
  from weights and crosses cut-points beside the hidden state that uses it) at P = 2, with and
  without the split, and at P = 3, where a stage starts inside the decoder (both stacks are cut);
  ``BartForConditionalGeneration`` at P = 3 likewise;
- plain ``nn.Module`` models: one block object at every depth (weights shared across depth, as in
  ALBERT: the same module runs before stage 1 and within it), and blocks whose MLP is an
  ``nn.Sequential`` longer than the list of blocks (the body is still the list) at P = 2;
- a single-file GPT whose forward is ``(idx, targets) -> (logits, loss)`` (targets consumed by
  the last stage only, a custom LayerNorm, causal-mask buffers) at P = 2, with and without the split.

Each model is named by import path (``tests.thirdparty...``) and its data is a real text file, so
the whole product path runs: ``jobspec`` resolves and checks, the engine trains. After 3 steps
every loss (rtol 1e-5) and every gradient of the last step equals the reference's (fp32:
|a - b| <= 1e-5 * max|b| + 1e-5 * |b| + 1e-7 * the largest gradient element of the model, for
gradients that are 0 in exact arithmetic, e.g. an attention key's bias); the losses of steps 2 and 3 follow from the parameters
AdamW made of the earlier gradients, so they check those too. (Parameters themselves are not
compared elementwise: AdamW's update of an element whose gradient is ~0 takes the sign of
rounding noise.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import _thirdparty_workers as TW
from tests.thirdparty.user_data import wordlevel_tokenizer
from varuna_sdk.pipeline.spawn import spawn_workers
from varuna_sdk.config import DataConfig, JobConfig, ModelConfig, ParallelConfig, TrainConfig

TEXT = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
        "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, "
        "it was the season of Darkness, it was the spring of hope, it was the winter of despair.\n")

MODELS = {
    "hf_gpt2": ("tests.thirdparty.hf_models:gpt2", {"n_layer": 3}, "hf"),
    "hf_llama": ("tests.thirdparty.hf_models:llama", {"n_layer": 3}, "hf"),
    # mixture of experts: grouped_mm experts, whose meta kernel wants bf16 (a stand-in runs on meta)
    "hf_mixtral": ("tests.thirdparty.hf_models:mixtral", {"n_layer": 3}, "hf"),
    "hf_t5": ("tests.thirdparty.hf_models:t5", {"n_layer": 3}, "hf"),
    "hf_bart": ("tests.thirdparty.hf_models:bart", {"n_layer": 2}, "hf"),
    "hf_bert": ("tests.thirdparty.hf_models:bert_mlm", {"n_layer": 3}, "hf"),
    "hf_deberta": ("tests.thirdparty.hf_models:deberta_v2", {"n_layer": 3}, "hf"),
    # masked by the product: data.mlm_probability with a word-level tokenizer.json holding [MASK]
    "hf_bert_mlm": ("tests.thirdparty.hf_models:bert_mlm", {"n_layer": 3}, "hf_mlm"),
    # one layer group called at every depth (a ModuleList of length 1): cut-points found unaided
    "hf_albert_mlm": ("tests.thirdparty.hf_models:albert_mlm", {"n_layer": 4}, "hf_mlm"),
    # frozen weights on both stages (the position embedding, one block's attention projection)
    "hf_gpt2_frozen": ("tests.thirdparty.hf_models:gpt2",
                       {"n_layer": 3, "frozen": ["transformer.wpe.weight", "transformer.h.2.attn.c_attn.weight"]}, "hf"),
    # a head the forward never calls: its gradient stays None (AdamW skips it, no weight decay)
    "hf_gpt2_unused": ("tests.thirdparty.hf_models:gpt2", {"n_layer": 3, "unused_head": True}, "hf"),
    # one block object at every depth (ALBERT-style sharing): it runs before stage 1 and within it
    "shared_depth": ("tests.thirdparty.plain_models:shared_depth", {"n_layer": 4}, "plain"),
    # each block's MLP an nn.Sequential longer than the list of blocks: the body is still the list
    "wide_mlp": ("tests.thirdparty.plain_models:wide_mlp", {"n_layer": 3}, "plain"),
    "sf_gpt": ("tests.thirdparty.singlefile_gpt:make_gpt", {"n_layer": 3, "block_size": 64}, "targets"),
}
# (model, P, D[, "zb"]): "zb" runs the zero-bubble split backward (B, then deferred W), which the
# planner chooses per row for a user's model as it does for ours
SHAPES = {2: [("hf_gpt2", 2, 1), ("hf_llama", 2, 1), ("hf_mixtral", 2, 1), ("sf_gpt", 2, 1), ("hf_llama", 2, 1, "zb"),
              ("sf_gpt", 2, 1, "zb"), ("hf_t5", 2, 1), ("hf_t5", 2, 1, "zb"),
              ("hf_gpt2_frozen", 2, 1), ("hf_gpt2_frozen", 2, 1, "zb"), ("hf_bert", 2, 1),
              ("hf_gpt2_unused", 2, 1, "zb"), ("shared_depth", 2, 1), ("wide_mlp", 2, 1),
              ("hf_deberta", 2, 1), ("hf_bert_mlm", 2, 1), ("hf_albert_mlm", 2, 1)],
          3: [("hf_gpt2", 3, 1), ("hf_llama", 3, 1),     # a middle stage (the single-file GPT: P=2 only)
              ("hf_gpt2", 3, 1, "zb"), ("hf_t5", 3, 1), ("hf_bart", 3, 1)],   # both stacks cut
          4: [("hf_gpt2_unused", 2, 2), ("hf_llama", 2, 2), ("hf_bert_mlm", 2, 2)]}


def _name(model: str, P: int, D: int, *variant: str) -> str:
    return f"{model}-{P}x{D}" + "".join(f"-{v}" for v in variant)


def _case(model: str, P: int, D: int, text: Path, *variant: str) -> dict:
    factory, kwargs, kind = MODELS[model]
    name = _name(model, P, D, *variant)
    data = (DataConfig(path=str(text.parent / "tale_words.txt"), tokenizer=str(text.parent / "words.json"), seq_len=24,
                       mlm_probability=0.15)
            if kind == "hf_mlm" else DataConfig(path=str(text), tokenizer="byte", seq_len=24))
    job = JobConfig(name=name, model=ModelConfig(factory=factory, kwargs=kwargs), data=data,
                    parallel=ParallelConfig(P=P, D=D, global_batch=8, micro_batch_size=2,
                                            split_backward="zb" in variant),
                    train=TrainConfig(lr=3e-3, seed=11))
    return {"name": name, "job": job.to_dict(), "kind": kind, "P": P, "D": D}


def _close(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-12) -> bool:
    """fp32 equality of a gradient: 1e-5 of the tensor's largest element and of each element, and
    ``floor`` (absolute: a gradient that is 0 in exact arithmetic, such as an attention key bias's,
    is rounding noise on both sides)."""
    tol = 1e-5 * float(b.abs().max()) + 1e-5 * b.abs()
    return bool(((a - b).abs() <= tol + floor).all())


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("thirdparty")
    text = root / "tale.txt"
    text.write_text(TEXT * 30)
    wordlevel_tokenizer(TEXT, root / "words.json")
    (root / "tale_words.txt").write_text(TEXT * 200)   # ~60 words a line: enough to hold out a batch
    out = {}
    for world, shapes in SHAPES.items():
        cases = [_case(*shape[:3], text, *shape[3:]) for shape in shapes]
        d = root / f"w{world}"
        d.mkdir()
        spawn_workers(TW.cases_worker, world, args=(str(d), cases), timeout_s=240, work_dir=d, backend="gloo")
        for c in cases:
            out[c["name"]] = (c, [torch.load(d / f"{c['name']}.rank{r}.pt", weights_only=True) for r in range(world)])
    return out


@pytest.mark.timeout(420)
@pytest.mark.parametrize("name", [_name(*shape) for shapes in SHAPES.values() for shape in shapes])
def test_unedited_model_matches_plain_pytorch(results, name):
    case, ranks = results[name]
    ref = TW.reference(case)
    # rounding noise of a gradient that is exactly 0 in exact arithmetic: 1e-7 of the model's largest
    floor = 1e-7 * max(float(g.abs().max()) for g in ref["grads"].values() if g is not None)
    for r, res in enumerate(ranks):
        assert torch.allclose(res["losses"], ref["losses"], rtol=1e-5, atol=0), (name, r, res["losses"], ref["losses"])
        assert res["grads"], (name, r)
        for n, g in res["grads"].items():
            if ref["grads"][n] is None:  # frozen or unused: no gradient, as in plain PyTorch
                assert g is None, (name, r, n)
                continue
            assert _close(g, ref["grads"][n], floor), (name, r, n, float((g - ref["grads"][n]).abs().max()))
    # every parameter of the model is held by some stage, and each stage's share is its own
    held = set().union(*(res["grads"] for res in ranks))
    assert held == set(ref["grads"]), (name, sorted(set(ref["grads"]) ^ held)[:5])
    expected_call = {"hf": "model(input_ids=input_ids, labels=labels), its own loss",
                     "hf_mlm": "model(input_ids=input_ids, labels=labels), its own loss",
                     "targets": "model(input_ids, targets), its own loss",
                     "plain": "model(input_ids), loss(output, targets)"}[case["kind"]]
    assert ranks[0]["call"] == expected_call
