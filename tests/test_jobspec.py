"""Naming a model (``jobspec``): a registered preset, an import path, a callable shipped by value —
resolved and checked before anything starts, with errors that say what to change; objects shipped
by value refused on a version mismatch, naming the VM, before anything is unpickled."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from varuna_sdk.config import ConfigError, DataConfig, JobConfig, ModelConfig, ParallelConfig, TrainConfig
from varuna_sdk.jobspec import resolve_job
from varuna_sdk.runner import JobObjects, launch_job, prepare_run
from varuna_sdk.model.spec import ModelSpecError
from varuna_sdk.shipping import ShippingError, pack_objects, read_objects, write_objects

TEXT = "A small text for a small model, long enough for a few windows of thirty-two bytes each. " * 40


def _job(tmp_path, model: ModelConfig, **par) -> JobConfig:
    f = tmp_path / "t.txt"
    f.write_text(TEXT)
    return JobConfig(name="spec", model=model, data=DataConfig(path=str(f), tokenizer="byte", seq_len=32),
                     parallel=ParallelConfig(**{"P": 2, "D": 1, "global_batch": 4, "micro_batch_size": 2, **par}),
                     train=TrainConfig(steps=2, eval_batches=1, run_dir=str(tmp_path / "runs")))


def test_three_ways_to_name_a_model(tmp_path):
    preset = resolve_job(_job(tmp_path, ModelConfig(preset="tiny")))
    assert preset.spec.name == "GPT-2 tiny" and preset.spec.identity["kind"] == "preset"
    imp = resolve_job(_job(tmp_path, ModelConfig(factory="tests.thirdparty.hf_models:gpt2", kwargs={"n_layer": 2})))
    assert imp.spec.identity["kind"] == "import" and len(imp.spec.identity["code"]) == 16
    assert imp.spec.call.describe() == "model(input_ids=input_ids, labels=labels), its own loss"
    hf = resolve_job(_job(tmp_path, ModelConfig(factory="hf-causal-lm", kwargs={
        "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2})))
    assert hf.spec.vocab_size == 256 and hf.spec.name == "Hugging Face llama"
    job = _job(tmp_path, ModelConfig())
    JobObjects(model=lambda: _Plain()).pack(job)
    val = resolve_job(job)
    assert val.spec.identity["kind"] == "by_value" and val.spec.call.describe() == "model(input_ids), loss(output, targets)"
    # identities differ between models and between arguments: calibration caches never mix them
    other = resolve_job(_job(tmp_path, ModelConfig(factory="tests.thirdparty.hf_models:gpt2", kwargs={"n_layer": 3})))
    assert other.spec.identity != imp.spec.identity


class _Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(256, 16)
        self.layers = nn.ModuleList([nn.Linear(16, 16) for _ in range(2)])
        self.head = nn.Linear(16, 256)

    def forward(self, idx):
        x = self.emb(idx)
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


class _NoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(256, 8)
        self.head = nn.Linear(8, 256)

    def forward(self, idx):
        return self.head(self.emb(idx))


def test_models_that_cannot_run_are_refused_before_anything_starts(tmp_path):
    with pytest.raises(ConfigError, match=r"neither an import path .* nor a registered model \(\['gpt2', 'hf-causal-lm', 'hf-masked-lm'\]\)"):
        resolve_job(_job(tmp_path, ModelConfig(factory="gtp2")))
    with pytest.raises(ConfigError, match="cannot import 'nowhere.models'"):
        resolve_job(_job(tmp_path, ModelConfig(factory="nowhere.models:build")))
    with pytest.raises(ConfigError, match=r"has no 'buld'.*callables there: .*'gpt2'"):
        resolve_job(_job(tmp_path, ModelConfig(factory="tests.thirdparty.hf_models:buld")))
    job = _job(tmp_path, ModelConfig())          # no list of layers: P = 1 only, and P = 2 says what to do
    JobObjects(model=_NoLayers).pack(job)
    assert resolve_job(job).spec.name == "_NoLayers"
    from varuna_sdk.model.partition import PartitionError

    with pytest.raises(PartitionError, match=r"P=2 is larger than the model's 1 segments .*set model.blocks"):
        prepare_run(job)
    assert not (tmp_path / "runs").exists()
    job = _job(tmp_path, ModelConfig(loss="model"))
    JobObjects(model=_Plain).pack(job)
    with pytest.raises(ModelSpecError, match=r"loss='model' but _Plain.forward\('idx',\) takes neither labels nor targets"):
        resolve_job(job)
    job = _job(tmp_path, ModelConfig())
    JobObjects(model=lambda: "not a model").pack(job)
    with pytest.raises(ModelSpecError, match="returned a str, not an nn.Module"):
        resolve_job(job)
    job = _job(tmp_path, ModelConfig())
    JobObjects(model=_Plain, loss=lambda out, y: (_ for _ in ()).throw(ValueError("my loss is broken"))).pack(job)
    with pytest.raises(ModelSpecError, match=r"the loss raised ValueError: my loss is broken \(called on _Plain's output"):
        resolve_job(job)
    for bad, pattern in ((lambda out, y: torch.nn.functional.cross_entropy(out.reshape(-1, 256), y.reshape(-1),
                                                                           reduction="none"),
                          r"loss returned a \(64,\) torch.float32 tensor; it must return a scalar"),  # micro-batch 2 x 32
                         (lambda out, y: 3, "the loss returned a int; it must return a scalar tensor"),
                         (lambda out, y: torch.zeros(()), "does not depend on the model's parameters")):
        job = _job(tmp_path, ModelConfig())
        JobObjects(model=_Plain, loss=bad).pack(job)
        with pytest.raises(ModelSpecError, match=pattern):
            resolve_job(job)
    job = _job(tmp_path, ModelConfig(loss="tests.thirdparty.hf_models:no_such_loss"))   # named, not run
    JobObjects(model=_Plain).pack(job)
    with pytest.raises(ConfigError, match=r"^model.loss: .*has no 'no_such_loss'") as ei:
        resolve_job(job)
    assert "the loss raised" not in str(ei.value)
    job = _job(tmp_path, ModelConfig(init="nowhere.inits:init"))
    JobObjects(model=_Plain).pack(job)
    with pytest.raises(ConfigError, match="cannot import 'nowhere.inits'"):
        resolve_job(job)
    job = _job(tmp_path, ModelConfig())
    JobObjects(model=_Plain, init=lambda mod, name: 1 / 0 if name == "layers.1" else None).pack(job)
    with pytest.raises(ModelSpecError, match=r"model.init raised on module layers.1 \(Linear\): ZeroDivisionError"):
        resolve_job(job)
    job = _job(tmp_path, ModelConfig(factory="tests.thirdparty.hf_models:gpt2", kwargs={"n_lyer": 2}))
    with pytest.raises(ConfigError, match=r"model.kwargs gives the model factory tests.thirdparty.hf_models:gpt2 the "
                                          r"keyword\(s\) 'n_lyer' \(did you mean 'n_layer'\?\), which it does not take; "
                                          r"it takes \(n_layer=3, n_embd=32"):
        resolve_job(job)
    job = _job(tmp_path, ModelConfig(factory="hf-causal-lm", kwargs={"model_type": "llama", "num_layers": 2}))
    with pytest.raises(ConfigError, match=r"LlamaConfig has no field\(s\) \['num_layers'\]; num_layers: did you mean "
                                          r"'num_hidden_layers'\?"):
        resolve_job(job)
    with pytest.raises(ConfigError, match="did you mean 'hf-causal-lm'"):
        resolve_job(_job(tmp_path, ModelConfig(factory="hf-causal-llm")))
    with pytest.raises(ConfigError, match=r"an import path puts ':' between the module and the object: "
                                          r"'tests.thirdparty.hf_models:gpt2'"):   # a dotted name without the colon
        resolve_job(_job(tmp_path, ModelConfig(factory="tests.thirdparty.hf_models.gpt2")))
    with pytest.raises(ConfigError, match=r"data.dataset='mypkg.data.make' must be .*'mypkg.data:make'"):
        JobConfig(data=DataConfig(dataset="mypkg.data.make")).validate()
    with pytest.raises(ConfigError, match="model.factory names the model, so model.preset"):
        _job(tmp_path, ModelConfig(factory="gpt2", preset="tiny")).validate()
    with pytest.raises(ConfigError, match="model.loss='mse'"):
        _job(tmp_path, ModelConfig(loss="mse")).validate()


def test_a_seq_len_far_beyond_the_presets_context_is_warned_with_its_cost():
    """``data.seq_len`` 100000 on the ``tiny`` preset (64 positions) built a 3.2 M-parameter model
    without a word, whose first step did not finish in 85 s: warned, with the parameters and the
    attention cost; a seq_len within 4x, or a block_size the user set, is not warned about."""
    import warnings

    from varuna_sdk.data.tokenizer import get_tokenizer
    from varuna_sdk.jobspec import _gpt2_builder

    tok = get_tokenizer("byte")

    def job(seq_len, **kw):
        return JobConfig(model=ModelConfig(preset="tiny", kwargs=kw), data=DataConfig(tokenizer="byte", seq_len=seq_len))
    with pytest.warns(UserWarning, match=r"data.seq_len=100000 is 1562x the context of the GPT-2 preset 'tiny' \(64 "
                                         r"positions\): .* 3,233,664 parameters instead of 35,712, .*set data.seq_len "
                                         r"to at most 64"):
        _gpt2_builder(job(100000), tok)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _gpt2_builder(job(256), tok)
        _gpt2_builder(job(100000, block_size=100000), tok)


def test_shipped_objects_are_checked_before_unpickling(tmp_path, monkeypatch):
    digest, blob = pack_objects({"factory": _Plain, "loss": None})
    path = tmp_path / "objects.bin"
    path.write_bytes(blob)
    shipped = read_objects(path, where="vm3")
    assert set(shipped.payloads) == {"factory"} and shipped.names["factory"] == "_Plain"

    def rewrite(**versions):
        magic, header, rest = blob.split(b"\n", 2)
        h = json.loads(header)
        h["versions"].update(versions)
        path.write_bytes(magic + b"\n" + json.dumps(h).encode() + b"\n" + rest)

    rewrite(python="3.9.18")
    with pytest.raises(ShippingError, match=r"VM vm3 cannot load .*Python 3\.11\.\d+ here, 3\.9\.18 on the launcher"):
        read_objects(path, where="vm3")
    rewrite(cloudpickle="2.2.1")
    monkeypatch.setenv("VARUNA_HOST", "spot-7")
    with pytest.raises(ShippingError, match=r"VM spot-7 cannot load .*cloudpickle 3\.\d+\.\d+ here, 2\.2\.1 on the launcher"):
        read_objects(path)
    rewrite(torch="2.12.0+cu124")
    with pytest.raises(ShippingError, match=r"torch 2\.13\.0\+cpu here, 2\.12\.0\+cu124"):
        read_objects(path)
    rewrite(torch="2.13.0+cu124")  # a GPU build of the same torch is fine
    read_objects(path)
    path.write_bytes(blob[:-5] + b"xxxxx")
    with pytest.raises(ShippingError, match="the factory payload is damaged"):
        read_objects(path)
    path.write_bytes(b"\x80\x04garbage")
    with pytest.raises(ShippingError, match="is not a varuna objects file"):
        read_objects(path)


@pytest.mark.timeout(240)
def test_a_worker_refuses_mismatched_objects_naming_its_vm(tmp_path):
    """A real worker process (launched by the manager on a local slot) finds objects packed under
    another cloudpickle: the job fails at once, the error names the VM and the versions, and no
    worker is left running."""
    from varuna_sdk.cluster.provider import LocalProvider

    job = _job(tmp_path, ModelConfig(), P=1)
    run = tmp_path / "run"
    digest = write_objects(run, {"factory": _Plain})
    f = run / f"objects-{digest}.bin"
    magic, header, rest = f.read_bytes().split(b"\n", 2)
    h = json.loads(header)
    h["versions"]["cloudpickle"] = "0.0.1"
    f.write_bytes(magic + b"\n" + json.dumps(h).encode() + b"\n" + rest)
    job.model.by_value = f"sha256:{digest}"
    import varuna_sdk.shipping as shipping

    shipping._PACKED.clear()  # this process must read the file too, as a fresh launcher would
    with pytest.raises(ShippingError, match="cloudpickle"):
        launch_job(job, run_dir=run)  # the launcher itself refuses before anything starts
    # now the launcher holds the objects in memory (as after Job(model=...) in a notebook) and only
    # the worker reads the file, whose header says another cloudpickle
    good_digest, _ = pack_objects({"factory": _Plain})
    assert good_digest == digest and digest in shipping._PACKED
    provider = LocalProvider(1)
    try:
        summary = launch_job(job, run_dir=run, provider=provider, calibrate_first=False, max_failures=0,
                             grow=None, straggler=None)
    finally:
        provider.close()
    assert summary["state"] == "FAILED", summary
    assert "VM local0 cannot load the objects shipped by value" in summary["error"], summary["error"]
    assert "cloudpickle 3." in summary["error"] and "0.0.1 on the launcher" in summary["error"]


def _nan_loss(out, targets):
    return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), targets.reshape(-1)) * float("nan")


@pytest.mark.timeout(240)
def test_a_job_whose_loss_is_never_finite_fails_instead_of_succeeding(tmp_path):
    """fp32 has no loss scaler to lower: 3 steps in a row with a non-finite loss end the job with a
    message saying so (none was applied), instead of SUCCEEDED with NaN everywhere."""
    from varuna_sdk.pipeline.spawn import WorkerFailure
    from varuna_sdk.runner import train_local

    job = _job(tmp_path, ModelConfig(), P=1)
    job.train.steps = 8
    with pytest.raises(WorkerFailure, match=r"not finite .* 3 steps in a row in fp32, so no step was applied"):
        train_local(job, run_dir=tmp_path / "run", objects=JobObjects(model=_Plain, loss=_nan_loss))


@pytest.mark.timeout(300)
def test_a_never_finite_loss_fails_under_the_manager_without_retries(tmp_path):
    """Under the manager, with a checkpoint after every step, the retry used to resume after the
    skipped steps with its count at 0 and its message naming other steps: the job ended SUCCEEDED
    with no update applied. Now the count travels in the checkpoint and the failure is not retried."""
    from varuna_sdk.cluster.provider import LocalProvider
    from varuna_sdk.runner import launch_job

    job = _job(tmp_path, ModelConfig(), P=1)
    job.train.steps, job.train.checkpoint_every = 6, 1
    provider = LocalProvider(1)
    try:
        summary = launch_job(job, run_dir=tmp_path / "run", provider=provider, calibrate_first=False,
                             objects=JobObjects(model=_Plain, loss=_nan_loss), max_failures=3, grow=None,
                             straggler=None)
    finally:
        provider.close()
    assert summary["state"] == "FAILED", summary
    assert "training diverged (not retried" in summary["error"], summary["error"]
    assert "steps 1..3 of 6 (metrics.jsonl's \"step\" 0..2): the loss or the gradients were not finite" in summary["error"], \
        summary["error"]
    assert "check the loss function and the data for NaN or inf" in summary["error"]
    assert "enable train.grad_clip" not in summary["error"]  # it is on (1.0): the hint says so
    assert summary["failures"] == 1 and summary["generation"] == 0, summary


def _sometimes_nan_loss(out, targets):
    ce = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), targets.reshape(-1))
    return ce * float("nan") if int(targets.sum()) % 5 == 0 else ce


@pytest.mark.timeout(240)
def test_steps_with_a_non_finite_loss_are_skipped_loudly_and_counted(tmp_path, capfd):
    """A step whose loss is not finite (here: a loss NaN on some batches) applies no update; its log
    line says so (not "overflow", which is fp16's), metrics.jsonl marks it, and the summary counts
    the skipped steps."""
    import json

    from varuna_sdk.runner import train_local

    job = _job(tmp_path, ModelConfig(), P=1, global_batch=2, micro_batch_size=2)
    job.train.steps = 12
    train_local(job, run_dir=tmp_path / "run", objects=JobObjects(model=_Plain, loss=_sometimes_nan_loss))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    skipped = [r["step"] for r in rows if r["skipped"]]
    assert 0 < len(skipped) < len(rows), rows
    assert all(r["loss"] is None or r["loss"] != r["loss"] for r in rows if r["skipped"])
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["skipped_steps"] == len(skipped), summary
    log = capfd.readouterr().out
    assert log.count("SKIPPED: loss or gradients not finite") == len(skipped), log
    assert "overflow" not in log


def _call_shipped(fn) -> str:
    return fn()


def test_by_value_unpickles_only_checked_shipped_objects():
    """Only a ``Shipped`` (packed here, or read from a version- and SHA-256-checked objects file)
    reaches cloudpickle; raw bytes from anywhere else are refused before anything is unpickled. A
    local worker gets it in its job spec (multiprocessing's spawn), where it is checked again —
    versions and digest — before it counts; a tampered one is refused."""
    import dataclasses
    import multiprocessing

    import cloudpickle

    from varuna_sdk.shipping import ByValue, Shipped, ShippingError, _spawned_by_value, find_objects, pack_objects

    evil = cloudpickle.dumps(lambda: "ran")
    with pytest.raises(TypeError, match="ByValue loads only checked shipped objects"):
        ByValue(evil, "factory")
    with pytest.raises(TypeError, match="ByValue loads only checked shipped objects"):
        ByValue(Shipped({"factory": evil}, {}), "factory")   # made by hand: never checked
    digest, _ = pack_objects({"factory": lambda: "ran"})   # the job spec's own path
    ok = ByValue(find_objects(digest), "factory")
    assert ok() == "ran"
    with multiprocessing.get_context("spawn").Pool(1) as pool:   # the job spec of a spawned local worker
        assert pool.apply(_call_shipped, (ok,)) == "ran"
    packed = find_objects(digest)
    tampered = dataclasses.replace(packed, payloads={"factory": evil})   # same digest, other code
    with pytest.raises(ShippingError, match="do not match their digest"):
        _spawned_by_value(tampered, "factory")
    with pytest.raises(ShippingError, match="cannot load"):
        _spawned_by_value(dataclasses.replace(packed, versions={**packed.versions, "cloudpickle": "0.0.1"}), "factory")


def test_a_masked_lm_on_text_is_warned_about(tmp_path):
    """``BertForMaskedLM`` on text gets ``labels=input_ids`` (unmasked: it sees what it predicts):
    a warning says so and what to give it instead; a causal LM gets none."""
    import warnings

    with pytest.warns(UserWarning, match=r"BertForMaskedLM is not a causal language model: .*Set data.mlm_probability: 0.15"):
        resolve_job(_job(tmp_path, ModelConfig(factory="tests.thirdparty.hf_models:bert_mlm", kwargs={"n_layer": 2})))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        resolve_job(_job(tmp_path, ModelConfig(factory="tests.thirdparty.hf_models:gpt2", kwargs={"n_layer": 2})))
        resolve_job(_job(tmp_path, ModelConfig(factory="tests.thirdparty.hf_models:my_llama")))   # a subclass: causal


class _TiedLM(_Plain):
    """``_Plain`` with its head tied to the embedding (one tensor under two names) and a buffer."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(16, 256, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.full((16,), 0.5))


def test_initial_weights_are_the_engines_and_load_into_the_users_own_model(tmp_path):
    """``Job.initial_weights()`` is the state every stage starts from: it loads, strictly, into a
    fresh instance of the user's class (tied weights under both names, buffers too) and equals the
    engine's parameters (built by the training path at P=1) exactly."""
    from varuna_sdk.notebook import Job
    from varuna_sdk.trainer import build_training

    f = tmp_path / "t.txt"
    f.write_text(TEXT)
    cfg = JobConfig(name="init", data=DataConfig(tokenizer="byte", seq_len=32),
                    parallel=ParallelConfig(P=1, D=1, global_batch=4, micro_batch_size=2),
                    train=TrainConfig(steps=2, eval_batches=1, seed=5, run_dir=str(tmp_path / "runs")))
    job = Job(cfg, model=_TiedLM, data=str(f))
    sd = job.initial_weights()
    assert set(sd) == set(_TiedLM().state_dict()) and torch.equal(sd["scale"], torch.full((16,), 0.5))
    mine = _TiedLM()
    mine.load_state_dict(sd)                                 # strict: every name, nothing extra
    assert mine.head.weight is mine.emb.weight and torch.equal(mine.head.weight, sd["emb.weight"])
    engine = build_training(job.config).engine
    got = dict(engine.named_parameters())
    assert set(got) == {n for n, _ in mine.named_parameters()}
    for n, p in got.items():
        assert torch.equal(p.detach(), sd[n]), n
    other = Job(cfg.__class__.from_dict({**cfg.to_dict(), "train": {**cfg.to_dict()["train"], "seed": 6}}),
                model=_TiedLM, data=str(f)).initial_weights()
    assert not torch.equal(other["emb.weight"], sd["emb.weight"])  # the seed decides them


def test_job_takes_config_fields_by_name_and_refuses_an_unknown_or_ambiguous_one(tmp_path):
    """``Job(model=, data=, seq_len=32, global_batch=4, P=1, ...)`` sets those fields of the config
    (a notebook user need not build a JobConfig); an unknown name is refused with the likely one, and
    ``seed`` (data's and train's) asks which, before anything is built."""
    from varuna_sdk.notebook import Job

    f = tmp_path / "t.txt"
    f.write_text(TEXT)
    job = Job(model=_TiedLM, data=str(f), steps=2, tokenizer="byte", seq_len=32, global_batch=4, micro_batch_size=2,
              P=1, D=1, lr=1e-3, data_seed=3, train_seed=4, train_run_dir=str(tmp_path / "runs"))
    c = job.config
    assert (c.data.tokenizer, c.data.seq_len, c.data.seed, c.train.seed, c.train.lr) == ("byte", 32, 3, 4, 1e-3)
    assert (c.parallel.P, c.parallel.D, c.parallel.global_batch, c.parallel.micro_batch_size) == (1, 1, 4, 2)
    assert c.train.run_dir == str(tmp_path / "runs") and not c.parallel.planned
    with pytest.raises(TypeError, match=r"seq_length=64, which is no field .*did you mean seq_len\?"):
        Job(model=_TiedLM, data=str(f), seq_length=64)
    with pytest.raises(TypeError, match=r"seed=1, which names both data.seed and train.seed; pass data_seed= or "
                                        r"train_seed="):
        Job(model=_TiedLM, data=str(f), seed=1)
    with pytest.raises(ConfigError, match="seq_len"):   # the values are checked as a config's are
        Job(model=_TiedLM, data=str(f), tokenizer="byte", seq_len=-1)
    for bad, said in [({"train_steps": 3}, r"train_steps=3: pass it as Job\(steps=...\)"),
                      ({"dataset": "x"}, r"pass it as Job\(data=...\)"), ({"p": 2}, r"did you mean P\?"),
                      ({"learning_rate": 1e-3}, r"did you mean lr\?"), ({"batch_size": 8}, r"did you mean global_batch\?"),
                      ({"seq_len": 16, "data_seq_len": 8}, r"both seq_len= and data_seq_len=, which set the same field"),
                      ({"n_layer": 3}, r"model.n_layer shapes the built-in GPT-2 preset, not a model you bring")]:
        with pytest.raises(TypeError, match=said):
            Job(model=_TiedLM, data=str(f), **bad)


class _MaskedClassifier(nn.Module):
    """A dataset model in Hugging Face's calling style: ``attention_mask`` optional, as users write it."""

    def forward(self, input_ids, attention_mask=None, labels=None):
        return input_ids


class _NeedsMask(nn.Module):
    def forward(self, input_ids, attention_mask):
        return input_ids


def test_a_datasets_attention_mask_reaches_a_forward_that_takes_it_and_an_unknown_field_is_warned_about():
    """Dict examples with ``input_ids`` are not language-model text: every other field the forward
    takes by name goes with them (an ``attention_mask`` was dropped silently — padding ignored — or a
    forward that requires it failed with a TypeError); a field the forward cannot take is warned
    about, not dropped silently."""
    import warnings

    from varuna_sdk.model.spec import infer_call

    batch = {"input_ids": torch.ones(2, 3, dtype=torch.long), "attention_mask": torch.tensor([[1, 1, 0], [1, 0, 0]]),
             "labels": torch.tensor([0, 1]), "note": torch.zeros(2)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        own, _ = infer_call(_MaskedClassifier(), ["input_ids", "attention_mask", "labels"], None)
        given, fn = infer_call(_NeedsMask(), ["input_ids", "attention_mask", "labels"], None)
    assert own.describe() == "model(input_ids=input_ids, attention_mask=attention_mask, labels=labels), its own loss"
    inputs, targets = given.split(batch)
    assert set(inputs) == {"input_ids", "attention_mask"} and torch.equal(inputs["attention_mask"], batch["attention_mask"])
    assert torch.equal(targets, batch["labels"])
    with pytest.warns(UserWarning, match=r"field\(s\) \['note'\] are not parameters of _NeedsMask.forward"):
        call, _ = infer_call(_NeedsMask(), ["input_ids", "attention_mask", "note", "labels"], None)
    assert call.describe() == "model(input_ids=input_ids, attention_mask=attention_mask), loss(output, labels)"


def test_dict_examples_pass_only_the_fields_the_forward_takes_and_warn_about_the_rest():
    """Dict examples without token ids (``x``, ``mask``, an ``idx`` bookkeeping field, ``target``):
    ``model(x=..., mask=...)``, ``idx`` warned about and not passed (it was passed, and the forward
    raised TypeError on it)."""
    import warnings

    from varuna_sdk.model.spec import infer_call

    class TwoInputs(nn.Module):
        def forward(self, x, mask):
            return x * mask

    with pytest.warns(UserWarning, match=r"field\(s\) \['idx'\] are not parameters of TwoInputs.forward"):
        call, _ = infer_call(TwoInputs(), ["x", "mask", "idx", "target"], "cross_entropy", targets="target")
    assert call.describe() == "model(x=x, mask=mask), loss(output, target)"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        call, _ = infer_call(TwoInputs(), ["x", "mask", "target"], "cross_entropy", targets="target")
    assert call.describe() == "model(x=x, mask=mask), loss(output, target)"
    # a targets field not named: the refusal says why the field is the likely one, as the forward has it
    from varuna_sdk.model.spec import ModelSpecError

    class Keywords(nn.Module):
        def forward(self, x, **kw):
            return x
    with pytest.raises(ModelSpecError, match=r"model.targets: 'y' \(the field\(s\) \['y'\] are not parameters of "
                                             r"the forward\)"):
        infer_call(TwoInputs(), ["x", "mask", "y"], torch.nn.functional.mse_loss)
    with pytest.raises(ModelSpecError, match=r"\['y'\] reach the forward only through its \*\*kwargs"):
        infer_call(Keywords(), ["x", "y"], torch.nn.functional.mse_loss)


CELL = '''
import torch
from torch import nn

class CellModel(nn.Module):
    def __init__(self, width=WIDTH):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(width, width) for _ in range(2)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x

def cell_loss(out, y):
    return (out - y).pow(2).mean()
'''


def _run_cell(width: int) -> dict:
    ns = {"__name__": "__main__"}
    exec(compile(CELL.replace("WIDTH", str(width)), "<cell>", "exec"), ns)   # as a notebook cell runs
    return ns


def test_the_same_notebook_cell_run_again_ships_the_same_model_and_a_changed_one_does_not(tmp_path):
    """A class defined in a notebook pickles (cloudpickle) with a random tracker id per class
    object: re-running its unchanged cell (or the whole notebook after a restart) gave another
    objects digest, so a stopped job could not be continued in its folder ("holds a job that
    trains another model") and the calibration cache missed. Same code: same digest and model
    identity; changed code: different."""
    from varuna_sdk.shipping import code_sha256

    first, again, changed = _run_cell(8), _run_cell(8), _run_cell(16)
    assert first["CellModel"] is not again["CellModel"]
    d1, blob1 = pack_objects({"factory": first["CellModel"], "loss": first["cell_loss"]})
    d2, blob2 = pack_objects({"factory": again["CellModel"], "loss": again["cell_loss"]})
    d3, _ = pack_objects({"factory": changed["CellModel"], "loss": changed["cell_loss"]})
    assert blob1 != blob2, "the pickles differ (tracker ids): the digest must not"
    assert d1 == d2 and d3 != d1
    (tmp_path / "a.bin").write_bytes(blob1)
    (tmp_path / "b.bin").write_bytes(blob2)
    a, b = read_objects(tmp_path / "a.bin"), read_objects(tmp_path / "b.bin")   # checked, never unpickled here
    assert a.digest == b.digest == d1
    assert code_sha256(a.payloads["factory"]) == code_sha256(b.payloads["factory"])


def test_data_whose_shape_the_model_cannot_take_is_said_so_not_blamed_on_the_meta_device(tmp_path):
    """16 features into a model built for 7: torch's meta kernel makes the real kernel's shape check,
    and the message called it "a limit of the meta device ... cannot be split into pipeline stages
    yet" (helper-40); it now says the data's and the layers' shapes differ."""
    job = _job(tmp_path, ModelConfig(factory="tests.thirdparty.user_data:Classifier", kwargs={"features": 7}))
    job.data = DataConfig(dataset="tests.thirdparty.user_data:make_dataset", tokenizer=None)
    with pytest.raises(ModelSpecError, match=r"same reduction dim.*shapes of the data and the model's layers do not "
                                             r"match") as e:
        resolve_job(job)
    assert "limit of the meta device" not in str(e.value)


def test_a_named_targets_field_is_the_losss_not_passed_to_a_kwargs_forward():
    """A Hugging Face-style forward (``input_ids``, ``attention_mask``, ``**kwargs``) and dict data
    whose targets field is ``y``: without ``targets=`` the error names ``y`` (it named
    ``input_ids``), and with ``targets="y"`` the loss gets ``y`` and the forward does not (every
    field reached its ``**kwargs``, the targets too) (helper-40)."""
    from varuna_sdk.model.spec import infer_call

    class KwargsForward(nn.Module):
        def forward(self, input_ids, attention_mask=None, **kwargs):
            return input_ids

    def loss(out, y):
        return out.float().mean()

    fields = ["input_ids", "attention_mask", "y"]
    with pytest.raises(ModelSpecError, match=r"model.targets: 'y' \(the field\(s\) \['y'\] reach the forward only "
                                             r"through its \*\*kwargs\)"):
        infer_call(KwargsForward(), fields, loss)
    call, fn = infer_call(KwargsForward(), fields, loss, targets="y")
    assert fn is loss and call.targets == "y"
    assert dict(call.kwargs) == {"input_ids": "input_ids", "attention_mask": "attention_mask"}


def test_a_users_module_that_fails_to_import_says_why_in_one_line(tmp_path, monkeypatch):
    """A user's module with a syntax error, one that raises while importing, and one that imports a
    package that is not installed: each is one ``ConfigError`` saying which (the first two were a
    raw traceback, the third said the module itself was not importable) (helper-42)."""
    from varuna_sdk.jobspec import import_object

    (tmp_path / "broken_syntax.py").write_text("def f(:\n    pass\n")
    (tmp_path / "raises_at_import.py").write_text("raise RuntimeError('settings.toml not found')\n")
    (tmp_path / "needs_a_package.py").write_text("import nonexistent_pkg_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"importing 'broken_syntax' .* raised SyntaxError: .*broken_syntax.py"):
        import_object("broken_syntax:f")
    with pytest.raises(ConfigError, match=r"raised RuntimeError: settings.toml not found \(.*raises_at_import.py, "
                                          r"line 1\)"):
        import_object("raises_at_import:f")
    with pytest.raises(ConfigError, match=r"it imports 'nonexistent_pkg_xyz', which is not installed"):
        import_object("needs_a_package:f")
    with pytest.raises(ConfigError, match=r"cannot import 'no_such_module_here'.*importable from the working folder"):
        import_object("no_such_module_here:f")


def test_a_dataset_of_tensors_has_one_digest_in_every_process():
    """A dataset of tensors passed by value (``Job(data=TensorDataset(...))``): its tensors' storages
    pickle with their memory addresses, so each process packed other bytes and another digest, and
    re-running the same script on a finished run folder was refused as "changed" (helper-40). Two
    processes now give one digest; other data another."""
    import subprocess
    import sys

    prog = ("import torch\nfrom varuna_sdk.shipping import pack_objects\n"
            "g = torch.Generator().manual_seed(0); x = torch.randn(50, 3, generator=g)\n"
            "ds = torch.utils.data.TensorDataset(x, x.flip(-1), x[:, :2] + {add})\n"
            "print(pack_objects({{'dataset': ds}})[0])\n")
    procs = [subprocess.Popen([sys.executable, "-c", prog.format(add=a)], stdout=subprocess.PIPE, text=True)
             for a in (0, 0, 1)]   # three processes at once
    digests = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert digests[0] == digests[1] != digests[2] and len(digests[0]) == 24


def test_layerdrop_is_refused_before_anything_runs(tmp_path):
    """LayerDrop skips blocks at random in training, so stages would see different blocks from one
    micro-batch to the next (calibration failed with an IndexError, workers on meta tensors): refused
    at resolve with the attribute to set; the same model without it resolves."""
    opt = {"model_type": "opt", "num_hidden_layers": 2, "hidden_size": 32, "ffn_dim": 64, "num_attention_heads": 4,
           "word_embed_proj_dim": 32}
    with pytest.raises(ModelSpecError, match=r"uses LayerDrop \(<root>\.config\.layerdrop=0\.4\).*layerdrop=0"):
        resolve_job(_job(tmp_path, ModelConfig(factory="hf-causal-lm", kwargs={**opt, "layerdrop": 0.4})))
    assert resolve_job(_job(tmp_path, ModelConfig(factory="hf-causal-lm", kwargs=opt))).spec.name == "Hugging Face opt"
    bart = {"model_type": "bart", "encoder_layers": 2, "decoder_layers": 2, "d_model": 32, "encoder_ffn_dim": 64,
            "decoder_ffn_dim": 64, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
            "encoder_layerdrop": 0.1, "decoder_layerdrop": 0.2}
    with pytest.raises(ModelSpecError, match=r"encoder_layerdrop=0 and decoder_layerdrop=0"):  # every one at once
        resolve_job(_job(tmp_path, ModelConfig(factory="hf-causal-lm", kwargs=bart)))
    # a hand-written one: blocks skipped at random in training, seen as blocks the dry run never called
    with pytest.raises(ModelSpecError, match=r"forward skipped some of its 6 blocks in the dry run .*\(LayerDrop"):
        resolve_job(_job(tmp_path, ModelConfig(factory="tests.thirdparty.plain_models:RandomSkipLM")))
    assert resolve_job(_job(tmp_path, ModelConfig(factory="tests.thirdparty.plain_models:RandomSkipLM",
                                                  kwargs={"p": 0.0})))


@pytest.mark.timeout(240)
def test_a_finished_run_is_not_rerun_with_a_changed_config(tmp_path):
    """Launching a run folder whose job SUCCEEDED with more steps trained nothing and reported
    SUCCEEDED: refused now, naming the change; the same config again still runs nothing, quietly."""
    from varuna_sdk.runner import train_local

    job = _job(tmp_path, ModelConfig(preset="tiny"), P=1)
    assert train_local(job, run_dir=tmp_path / "run").trained
    assert not train_local(job, run_dir=tmp_path / "run").trained
    more = _job(tmp_path, ModelConfig(preset="tiny"), P=1)
    more.train.steps = 4
    with pytest.raises(ConfigError, match=r"already ended SUCCEEDED after 2 step\(s\); a finished job is not run "
                                          r"again, so this config's changes \(train.steps 2 -> 4\)"):
        train_local(more, run_dir=tmp_path / "run")
    assert "steps: 2" in (tmp_path / "run" / "config.yaml").read_text()


def test_no_tokenizer_for_a_dataset_of_tensors_and_a_clear_refusal_where_one_is_needed(tmp_path):
    """``data.tokenizer: null``: a dataset whose examples are tensors already needs no tokenizer
    (its model resolves, and the YAML loads); text data, and a registered model that takes its
    vocabulary from the tokenizer, are refused naming what to give instead."""
    from varuna_sdk.config import JobConfig as J

    def job(data: DataConfig, model: ModelConfig) -> JobConfig:
        return JobConfig(name="notok", model=model, data=data,
                         parallel=ParallelConfig(P=1, D=1, global_batch=8, micro_batch_size=2),
                         train=TrainConfig(steps=2, eval_batches=1, run_dir=str(tmp_path / "runs")))

    tensors = DataConfig(dataset="tests.thirdparty.user_data:make_dataset", tokenizer=None)
    r = resolve_job(job(tensors, ModelConfig(factory="tests.thirdparty.user_data:Classifier")))
    assert r.data.tokenizer is None and r.spec.call.describe() == "model(example[0]), loss(output, example[1])"
    (tmp_path / "j.yaml").write_text("data: {dataset: 'tests.thirdparty.user_data:make_dataset', tokenizer: null}\n")
    assert J.from_yaml(tmp_path / "j.yaml").validate().data.tokenizer is None
    with pytest.raises(ConfigError, match=r"data.tokenizer is null, but the data is text .* give data.tokenizer"):
        resolve_job(job(DataConfig(corpus="shakespeare", tokenizer=None), ModelConfig()))
    # (helper-59) token ids in a .npy file, and a folder of examples: each told what to give
    import numpy as np

    np.save(tmp_path / "ids.npy", np.arange(100, dtype=np.uint16))
    with pytest.raises(ConfigError, match=r"'.*ids.npy' holds token ids, .* give it as data.tokenizer .*leaving it out "
                                          r"means 'gpt2'.*give them as a dataset"):
        resolve_job(job(DataConfig(path=str(tmp_path / "ids.npy"), tokenizer=None), ModelConfig()))
    (tmp_path / "saved").mkdir()
    with pytest.raises(ConfigError, match=r"is a folder, .*Job\(data=datasets.load_from_disk\(path\)\)"):
        resolve_job(job(DataConfig(path=str(tmp_path / "saved"), tokenizer=None), ModelConfig()))
    windows = DataConfig(dataset="tests.thirdparty.user_data:TokenWindows", tokenizer=None, seq_len=16)
    with pytest.raises(ConfigError, match=r"model gpt2 .* data.tokenizer, which is null: .* model.kwargs.vocab_size"):
        resolve_job(job(windows, ModelConfig(preset="tiny")))
    with pytest.raises(ConfigError, match=r"model.factory hf-causal-lm .* model.kwargs.vocab_size"):
        resolve_job(job(windows, ModelConfig(factory="hf-causal-lm", kwargs={"model_type": "gpt2", "n_layer": 1})))
    assert resolve_job(job(windows, ModelConfig(preset="tiny", kwargs={"vocab_size": 300}))).spec.vocab_size == 300


def _classifier_job(tmp_path, factory: str, P: int) -> JobConfig:
    """A job of ``factory``'s model on ``make_dataset``'s (x, class) examples at P x 1."""
    return JobConfig(name="classify", model=ModelConfig(factory=factory),
                     data=DataConfig(dataset="tests.thirdparty.user_data:make_dataset"),
                     parallel=ParallelConfig(P=P, D=1, global_batch=8, micro_batch_size=2),
                     train=TrainConfig(steps=2, run_dir=str(tmp_path / "runs")))


def test_a_lazy_module_is_refused_before_anything_starts(tmp_path):
    """``nn.LazyLinear`` (a weight without a shape until the first forward) is refused when the job
    is checked, naming the module and the fix (it failed in the workers, blaming Hugging Face)."""
    with pytest.raises(ModelSpecError, match=r"lazy modules .*: head \(LazyLinear\); give their input sizes"):
        resolve_job(_classifier_job(tmp_path, "tests.thirdparty.plain_models:LazyHead", P=1))


def test_int32_labels_for_a_models_own_loss_reach_it_as_int64():
    """``labels`` (or ``targets``) of int32, as NumPy makes them, handed to a forward that computes
    its own loss, arrive as int64, which torch's losses need (calibration failed with "expected
    target dtype to be Long"); so do a loss's integer targets (a loss of one's own failed the same
    way in the workers, helper-60); other fields keep their dtype."""
    from varuna_sdk.model.spec import CallSpec

    batch = {"input_ids": torch.ones(2, 4, dtype=torch.int32), "labels": torch.ones(2, dtype=torch.int32),
             "mask": torch.ones(2, 4, dtype=torch.bool)}
    own = CallSpec(kwargs=(("input_ids", "input_ids"), ("attention_mask", "mask"), ("labels", "labels")))
    inputs, _ = own.split(batch)
    assert inputs["labels"].dtype == torch.int64 and inputs["input_ids"].dtype == torch.int32
    assert inputs["attention_mask"].dtype == torch.bool
    theirs = CallSpec(kwargs=(("input_ids", "input_ids"),), targets="labels")
    assert theirs.split(batch)[1].dtype == torch.int64
    assert CallSpec(kwargs=(("input_ids", "input_ids"),), targets="mask").split(batch)[1].dtype == torch.bool


def test_a_value_dependent_shape_is_refused_saying_it_is_the_meta_devices_limit(tmp_path):
    """``torch.nonzero`` routing (as mixture-of-experts layers do) cannot be traced on the meta
    device: the refusal, before anything starts, says that it is the meta device's limit and names
    such operations (it blamed the model alone)."""
    with pytest.raises(ModelSpecError, match=r"nonzero.* limit of the meta device .*mixture-of-experts routing"):
        resolve_job(_classifier_job(tmp_path, "tests.thirdparty.plain_models:Routed", P=2))


def test_a_hugging_face_model_from_a_config_builds_and_trains_without_transformers_warnings(capfd):
    """GPT-2's special-token ids (50256) do not exist in a 256-id byte vocabulary: they are left
    unset before the config is made (transformers warned of each, on every rank), and the loss
    transformers falls back to is named (it warned ``loss_type=None`` on the first forward with
    labels); a model with the full vocabulary keeps its ids."""
    from varuna_sdk.jobspec import hf_causal_lm

    model = hf_causal_lm("gpt2", n_layer=1, n_embd=32, n_head=2, vocab_size=256, n_positions=32)
    x = torch.randint(0, 256, (2, 16))
    loss = model(input_ids=x, labels=x).loss
    assert torch.isfinite(loss) and model.config.bos_token_id is None and model.config.eos_token_id is None
    assert model.loss_type == "ForCausalLM"
    assert "[transformers]" not in capfd.readouterr().err
    assert hf_causal_lm("gpt2", n_layer=1, n_embd=32, n_head=2, n_positions=32).config.eos_token_id == 50256


def test_the_models_own_loss_is_found_in_every_form_a_forward_returns_it():
    """``loss='model'``: a forward that returns its loss as a bare 0-dim tensor (it was refused as
    "holds no loss"), an ``output.loss``, a ``{"loss": ...}`` or a ``(logits, loss)`` tuple; an
    output with no loss is refused saying how to give one."""
    from varuna_sdk.model.spec import ModelSpecError, model_loss

    loss, logits = torch.tensor(1.5), torch.randn(2, 3)
    assert model_loss(loss) is loss
    assert model_loss({"loss": loss, "logits": logits}) is loss and model_loss((logits, loss)) is loss
    assert model_loss(type("Out", (), {"loss": loss})()) is loss
    with pytest.raises(ModelSpecError, match=r"holds no loss. With loss='model' the forward must compute it"):
        model_loss(logits)
    with pytest.raises(ModelSpecError, match="holds no loss"):
        model_loss(torch.tensor(3))   # an integer scalar is not a loss


class _TakesKwargs(nn.Module):
    """A forward in Hugging Face's style: named inputs, the rest to ``**kwargs`` (which it ignores)."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(256, 8), nn.Linear(8, 256)

    def forward(self, input_ids=None, labels=None, **kwargs):
        if input_ids is None:
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        return self.head(self.emb(input_ids))


def _misnamed_fields():
    g = torch.Generator().manual_seed(0)
    return [{"ids": torch.randint(0, 256, (8,), generator=g), "labels": torch.randint(0, 256, (8,), generator=g)}
            for _ in range(100)]


def test_a_field_that_went_to_the_forwards_kwargs_is_named_with_the_parameter_it_likely_means():
    """Dict examples with ``ids`` for a forward taking ``input_ids`` (and ``**kwargs``): the model's own
    error ("specify input_ids") is followed by the field that went to ``**kwargs`` and its likely
    parameter, before anything starts."""
    from varuna_sdk.notebook import Job

    with pytest.raises(ModelSpecError, match=r"specify exactly one of input_ids.*field\(s\) 'ids' \(its parameter "
                                             r"'input_ids'\?\) are no parameter of the forward"):
        Job(model=_TakesKwargs, data=_misnamed_fields, tokenizer=None, global_batch=4, P=1, D=1)


def test_data_too_small_for_a_held_out_and_a_training_batch_says_what_can_work(tmp_path):
    """300 tokens, seq_len 32, global batch 8: no data.val_fraction holds out a mini-batch (257
    tokens) and trains on another, so the message says val_fraction 0 or a smaller batch (it said
    "a larger data.val_fraction", then at 0.9 "got 30" tokens without saying 30 was the training
    share); 5 examples and val_fraction 0 are not told to lower val_fraction (helper-59)."""
    from varuna_sdk.data.sources import DataError

    (tmp_path / "t.txt").write_text("abcdefghij" * 30)

    def job(val_fraction: float, **data) -> JobConfig:
        return JobConfig(name="small", data=DataConfig(tokenizer="byte", seq_len=32, val_fraction=val_fraction, **data),
                         parallel=ParallelConfig(P=1, D=1, global_batch=8, micro_batch_size=2),
                         train=TrainConfig(steps=2, eval_batches=1, run_dir=str(tmp_path / "runs")))

    for vf in (0.5, 0.9):
        with pytest.raises(DataError, match=r"has 300 tokens: too few to hold out a mini-batch of 8 sequences of "
                                            r"seq_len=32 \(257 tokens\) .*set data.val_fraction: 0 \(train on all 300"):
            resolve_job(job(vf, path=str(tmp_path / "t.txt")))
    assert resolve_job(job(0.0, path=str(tmp_path / "t.txt"))) is not None
    few = job(0.0, dataset="tests.thirdparty.user_data:make_dataset", dataset_kwargs={"n": 5})
    few.model = ModelConfig(factory="tests.thirdparty.user_data:Classifier")
    few.data.tokenizer = None
    with pytest.raises(DataError, match=r"leaves 5 examples .*use more data, or a smaller parallel.global_batch$"):
        resolve_job(few)


def test_targets_under_another_name_are_named_in_the_refusal_without_calling_them_taken():
    """Fields ``{num, cat, y}`` and ``forward(num, cat)``: the refusal said the fields "hold none the
    model does not already take", which is false (``y`` is not taken); it now says none is named as
    targets are, and names ``y`` (helper-59)."""
    from varuna_sdk.model.spec import infer_call

    class TwoInputs(nn.Module):
        def forward(self, num, cat):
            return num

    with pytest.raises(ModelSpecError, match=r"the loss needs targets, but no field of the data \(\['num', 'cat', 'y'\]\) "
                                             r"is named as targets are .*model.targets: 'y'"):
        infer_call(TwoInputs(), ["num", "cat", "y"], None)
    assert infer_call(TwoInputs(), ["num", "cat", "y"], None, targets="y")[0].targets == "y"

    class Ids(nn.Module):
        def forward(self, input_ids):
            return input_ids

    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")   # 'label', the targets, was said "not passed to the model" (helper-60)
        assert infer_call(Ids(), ["input_ids", "label"], None)[0].targets == "label"


def test_an_encoder_decoder_with_a_loss_of_ones_own_is_told_its_labels_went_to_the_loss():
    """T5 with ``loss=fn`` on ``{input_ids, labels}``: the labels go to the loss, so the forward has
    no decoder inputs and fails with Hugging Face's own words; the refusal now says why and what to
    give (helper-58: Whisper)."""
    import torch.nn.functional as F

    from tests.thirdparty.hf_models import t5
    from varuna_sdk.notebook import Job

    def own(out, y):
        return F.cross_entropy(out.logits.flatten(0, 1), y.flatten())

    g = torch.Generator().manual_seed(0)
    ds = [{"input_ids": torch.randint(3, 200, (12,), generator=g), "labels": torch.randint(3, 200, (8,), generator=g)}
          for _ in range(32)]
    with pytest.raises(ModelSpecError, match=r"With a loss of your own, the field\(s\) \['labels'\] go to the loss, "
                                             r"not to the forward.*give decoder_input_ids in the data"):
        Job(model=t5, data=ds, loss=own, steps=2, global_batch=8, P=1, D=1)
