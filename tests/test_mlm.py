"""Masked-LM examples from text (``data.mlm_probability``, ``varuna_sdk.data.mlm``): BERT's masking
rates, labels only where a token is predicted, the same examples whatever the number of
replicas, held-out batches masked too, and bad settings refused before anything starts. That
the pipeline trains a masked LM on them exactly as plain PyTorch does is in test_thirdparty
(``hf_bert_mlm`` at 2x1 and 2x2)."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.thirdparty.user_data import wordlevel_tokenizer
from varuna_sdk.config import ConfigError, DataConfig, JobConfig, ModelConfig, ParallelConfig
from varuna_sdk.data.mlm import IGNORE_INDEX, TRAIN, MLMMasking
from varuna_sdk.data.sources import DataError
from varuna_sdk.jobspec import resolve_data, resolve_job

TEXT = "the quick brown fox jumps over the lazy dog while the cat sleeps on a warm mat by the door\n"


def test_bert_rates_labels_and_at_least_one_prediction_per_example():
    """round(15 % of T) chosen in every example (BERT's num_to_predict), of those 80 % [MASK], 10 % a
    random token, 10 % kept; labels the original id exactly where chosen and -100 elsewhere; the
    draws depend only on (seed, key)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 1000, (400, 64), generator=g)
    m = MLMMasking(probability=0.15, mask_id=2, vocab_size=1000, seed=7)
    masked, labels = m.apply(ids, [(TRAIN, 5, k) for k in range(400)])
    chosen = labels != IGNORE_INDEX
    assert torch.equal(labels[chosen], ids[chosen])
    assert torch.equal(masked[~chosen], ids[~chosen])               # nothing else changes
    assert bool((chosen.sum(dim=1) == round(0.15 * 64)).all())          # 10 of 64 in every example
    positions = chosen.float().mean(dim=0)                              # ... anywhere in it, uniformly
    assert float(positions.min()) > 0.08 and float(positions.max()) < 0.24, positions
    n = int(chosen.sum())
    as_mask = int((masked[chosen] == 2).sum())
    kept = int((masked[chosen] == ids[chosen]).sum())
    assert abs(as_mask / n - 0.8) < 0.02 and abs(kept / n - 0.1) < 0.02, (as_mask / n, kept / n)
    again, labels2 = m.apply(ids[10:20], [(TRAIN, 5, k) for k in range(10, 20)])
    assert torch.equal(again, masked[10:20]) and torch.equal(labels2, labels[10:20])
    other, _ = m.apply(ids[10:20], [(TRAIN, 6, k) for k in range(10, 20)])   # another step: other masks
    assert not torch.equal(other, masked[10:20])
    # a short example still predicts one token (no micro-batch with nothing to predict: a NaN loss)
    _, few = MLMMasking(0.01, 2, 1000, 0).apply(ids[:50, :4], [(TRAIN, 0, k) for k in range(50)])
    assert bool((few != IGNORE_INDEX).any(dim=1).all())
    with pytest.raises(ValueError, match="takes ids \\[n, T\\] and n keys"):
        m.apply(ids[:3], [(TRAIN, 0, 0)])


def _job(tmp_path, **data) -> JobConfig:
    (tmp_path / "words.txt").write_text(TEXT * 300)
    tok = wordlevel_tokenizer(TEXT, tmp_path / "words.json")
    d = {"path": str(tmp_path / "words.txt"), "tokenizer": tok, "seq_len": 16, "mlm_probability": 0.15, **data}
    return JobConfig(name="mlm", model=ModelConfig(factory="tests.thirdparty.hf_models:bert_mlm",
                                                     kwargs={"n_layer": 2}),
                     data=DataConfig(**d), parallel=ParallelConfig(P=1, D=1, global_batch=8, micro_batch_size=2))


def test_a_steps_examples_are_the_same_for_any_number_of_replicas_and_held_out_ones_are_masked(tmp_path):
    job = _job(tmp_path).validate()
    data = resolve_data(job)
    loader, val = data.loaders(16, 8, job.data.seed, 0.05, 2)
    mask_id = data.tokenizer.token_id("[MASK]")
    assert data.mlm is not None and data.mlm.mask_id == mask_id
    for step in (0, 3):
        whole = loader.batch(step)
        for D in (2, 4, 8):
            parts = [loader.replica_batch(step, r, D) for r in range(D)]
            for f in ("input_ids", "labels", "targets"):
                assert torch.equal(torch.cat([p[f] for p in parts]), whole[f]), (step, D, f)
        assert torch.equal(whole["labels"], whole["targets"])
        assert bool((whole["input_ids"] == mask_id).any()) and bool((whole["labels"] == IGNORE_INDEX).any())
    assert val and all(bool((v["labels"] == IGNORE_INDEX).any()) and bool((v["input_ids"] == mask_id).any())
                       for v in val)
    # the plain (unmasked) stream is what the masks were drawn over
    plain = resolve_data(_job(tmp_path, mlm_probability=None).validate())
    p_loader, _ = plain.loaders(16, 8, job.data.seed, 0.05, 2)
    raw = p_loader.batch(3)["input_ids"]
    got = loader.batch(3)
    chosen = got["labels"] != IGNORE_INDEX
    assert torch.equal(got["labels"][chosen], raw[chosen]) and torch.equal(got["input_ids"][~chosen], raw[~chosen])


def test_a_masked_lm_with_masking_is_not_warned_about_and_without_it_is(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolve_job(_job(tmp_path).validate())
    with pytest.warns(UserWarning, match="not a causal language model.*data.mlm_probability"):
        resolve_job(_job(tmp_path, mlm_probability=None).validate())


def test_bad_masking_settings_are_refused_before_anything_starts(tmp_path):
    with pytest.raises(ConfigError, match=r"data.mlm_probability=1.5 must be in \(0, 1\)"):
        _job(tmp_path, mlm_probability=1.5).validate()
    with pytest.raises(ConfigError, match=r"needs a mask token, and the tokenizer 'gpt2' has no '\[MASK\]' or "
                                          r"'<mask>'.*data.mask_token"):
        resolve_data(_job(tmp_path, tokenizer="gpt2").validate())
    with pytest.raises(ConfigError, match=r"has no '<special>'"):
        resolve_data(_job(tmp_path, mask_token="<special>").validate())
    job = _job(tmp_path, path=None, dataset="tests.thirdparty.user_data:make_dataset").validate()
    with pytest.raises(DataError, match="masks token data .* gives examples: mask them in the dataset"):
        resolve_data(job)


@pytest.mark.timeout(240)
def test_varuna_train_yaml_trains_a_hugging_face_masked_lm_on_masked_text(tmp_path, capsys):
    """``model.factory: hf-masked-lm`` (a BERT from its config) with ``data.mlm_probability`` on a
    text file and a word-level tokenizer.json, from YAML, at P=2: it trains to SUCCEEDED and the
    held-out masked-token perplexity falls (the same model given unmasked labels is warned about);
    a model type with no masked-LM head is refused before anything starts."""
    import json
    import subprocess
    import sys

    import yaml

    from varuna_sdk.cli import main

    (tmp_path / "words.txt").write_text(TEXT * 300)
    tok = wordlevel_tokenizer(TEXT, tmp_path / "words.json")
    cfg = {"name": "bert-mlm",
           "model": {"factory": "hf-masked-lm", "kwargs": {"model_type": "bert", "num_hidden_layers": 2,
                                                           "hidden_size": 32, "num_attention_heads": 2,
                                                           "intermediate_size": 64, "max_position_embeddings": 32}},
           "data": {"path": str(tmp_path / "words.txt"), "tokenizer": tok, "seq_len": 16, "mlm_probability": 0.15},
           "parallel": {"P": 2, "D": 1, "global_batch": 8, "micro_batch_size": 2},
           "train": {"steps": 300, "lr": 0.005, "warmup_steps": 10, "eval_batches": 4, "checkpoint_every": 1000},
           "launch": {"gpus": 2}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["train", str(tmp_path / "job.yaml"), "--run-dir", str(tmp_path / "run")]) == 0, capsys.readouterr()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 300 and summary["P"] == 2
    # masked tokens of held-out text: ~vocabulary-sized at the start (22 words), falling (plain PyTorch with
    # transformers' DataCollatorForLanguageModeling falls alike: ~14 after 300 steps of this model)
    assert summary["ppl_end"] < 0.75 * summary["ppl_start"], summary
    # without masking: warned about once (by the launcher; the workers that resolve the job again are quiet)
    unmasked = {**cfg, "data": {k: v for k, v in cfg["data"].items() if k != "mlm_probability"},
                "train": {**cfg["train"], "steps": 2}}
    (tmp_path / "unmasked.yaml").write_text(yaml.safe_dump(unmasked))
    said = subprocess.run([sys.executable, "-m", "varuna_sdk.cli", "train", str(tmp_path / "unmasked.yaml"),
                           "--run-dir", str(tmp_path / "run1")], capture_output=True, text=True, timeout=180)
    assert said.returncode == 0, said.stdout + said.stderr
    assert (said.stdout + said.stderr).count("BertForMaskedLM is not a causal language model") == 1, said.stderr
    assert "varuna: warning: BertForMaskedLM is not a causal" in said.stderr and "infer_call(" not in said.stderr
    cfg["model"]["kwargs"]["model_type"] = "gpt2"                        # no masked-LM head in transformers
    (tmp_path / "gpt2.yaml").write_text(yaml.safe_dump(cfg))
    capsys.readouterr()
    assert main(["train", str(tmp_path / "gpt2.yaml"), "--run-dir", str(tmp_path / "run2")]) == 2
    err = capsys.readouterr().err
    assert "hf-masked-lm: model_type 'gpt2' has no masked-LM head in transformers (it has a causal-LM head: use " \
           "model.factory hf-causal-lm); model types that have one: albert, bart, bert" in err, err
    cfg["model"]["kwargs"]["model_type"] = "bertt"
    (tmp_path / "bertt.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["train", str(tmp_path / "bertt.yaml"), "--run-dir", str(tmp_path / "run3")]) == 2
    err = capsys.readouterr().err
    assert "transformers has no model_type 'bertt'; did you mean 'bert'?" in err, err


def test_the_loss_of_a_mini_batch_does_not_depend_on_its_micro_batch_size(tmp_path):
    """Every example predicts the same number of tokens, so the mean of the micro-batches' mean
    masked-LM losses (what a pipeline and gradient accumulation compute) is the mini-batch's mean
    over its predicted tokens at any micro-batch size: a morph to another micro-batch size keeps
    the loss and its gradients (a Hugging Face BERT's own loss, computed here by plain PyTorch)."""
    from tests.thirdparty.hf_models import bert_mlm

    job = _job(tmp_path).validate()
    loader, _ = resolve_data(job).loaders(16, 8, job.data.seed, 0.05, 1)
    batch = loader.batch(2)
    torch.manual_seed(0)
    model = bert_mlm(n_layer=2).eval()
    with torch.no_grad():
        by_mb = {b: sum(model(input_ids=batch["input_ids"][i:i + b], labels=batch["labels"][i:i + b]).loss.item()
                        for i in range(0, 8, b)) / (8 // b) for b in (1, 2, 4, 8)}
    assert max(by_mb.values()) - min(by_mb.values()) < 1e-5, by_mb


def test_a_tokenizer_larger_than_the_model_is_refused_though_the_text_fits(tmp_path):
    """The text's ids fit the model, but the mask token (added last) and the random replacements
    (any id of the tokenizer) do not: refused before anything starts, not an IndexError in a worker."""
    from tokenizers import Tokenizer

    job = _job(tmp_path)
    tok = Tokenizer.from_file(wordlevel_tokenizer(TEXT, tmp_path / "plain.json"))
    size = tok.get_vocab_size()
    tok.add_special_tokens(["[SEP]", "[CLS]"])      # two ids the text never holds, at the top
    tok.save(str(tmp_path / "bigger.json"))
    job.data.tokenizer = str(tmp_path / "bigger.json")
    job.model.kwargs = {"n_layer": 2, "vocab_size": size + 1}   # the text's ids and [MASK] fit, [CLS] does not
    with pytest.raises(DataError, match=rf"data.mlm_probability: the tokenizer has {size + 2} ids .* beyond the "
                                        rf"model's vocabulary of {size + 1} ids .* at least {size + 2} token embeddings"):
        resolve_job(job.validate())


def test_masking_a_causal_lm_is_warned_about_and_a_continued_run_keeps_its_masking(tmp_path):
    from varuna_sdk.runner import check_continuation

    job = _job(tmp_path)
    job.model = ModelConfig(factory="hf-causal-lm", kwargs={"model_type": "gpt2", "n_layer": 2, "n_embd": 32,
                                                            "n_head": 2, "n_positions": 32})
    with pytest.warns(UserWarning, match="masks text for a masked language model .* GPT2LMHeadModel is a causal LM"):
        resolve_job(job.validate())
    run = tmp_path / "run"
    run.mkdir()
    (run / "events.db").write_bytes(b"")
    _job(tmp_path).validate().to_yaml(run / "config.yaml")
    check_continuation(_job(tmp_path).validate(), run)           # the same settings: continued
    with pytest.raises(ConfigError, match=r"data.mlm_probability: 0.15 in the run, 0.3 here"):
        check_continuation(_job(tmp_path, mlm_probability=0.3).validate(), run)
    with pytest.raises(ConfigError, match=r"data.seed: 0 in the run, 5 here"):
        check_continuation(_job(tmp_path, seed=5).validate(), run)


def test_a_model_from_a_config_pads_with_the_tokenizers_own_padding_id(tmp_path):
    """RoBERTa's config says pad_token_id=1, which in the user's tokenizer is [UNK] (a real token
    that would then get no position and no embedding gradient): a model built from a config takes
    the tokenizer's [PAD]/<pad> id, unless model.kwargs set one."""
    from varuna_sdk.jobspec import MODELS

    job = _job(tmp_path)
    job.model = ModelConfig(factory="hf-masked-lm", kwargs={"model_type": "roberta", "num_hidden_layers": 1,
                                                            "hidden_size": 32, "num_attention_heads": 2,
                                                            "intermediate_size": 64, "max_position_embeddings": 40})
    job.validate()
    data = resolve_data(job)
    pad = data.tokenizer.token_id("[PAD]")
    model = MODELS["hf-masked-lm"](job, data.tokenizer).factory()
    assert pad == 0 and model.config.pad_token_id == pad and model.roberta.embeddings.word_embeddings.padding_idx == pad
    job.model.kwargs["pad_token_id"] = 2
    assert MODELS["hf-masked-lm"](job, data.tokenizer).factory().config.pad_token_id == 2
