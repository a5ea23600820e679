"""Per-layer checkpoints (paper §4.2, §4.5): reshard round trip across stage maps, torn writes
never loaded, loss trajectory preserved across stop/resume morphs and a sudden loss, fsspec URL
stores, keep-last-K, weights_only loading, and the config fields.

Multi-process cases run real spawned gloo workers (``pipeline.spawn.spawn_workers``) on a tiny
8-block GPT-2 (fp32, dropout 0.1); results come back as files loaded with ``weights_only=True``.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import _ckpt_workers as W
from varuna_sdk.checkpoint import (CheckpointError, StageCheckpointer, Store, complete_checkpoints, default_staging_dir,
                                   latest_complete, load_verified)
from varuna_sdk.checkpoint.store import MANIFEST, manifest_checksum
from varuna_sdk.checkpoint.writer import PHASES
from varuna_sdk.pipeline.spawn import WorkerFailure, spawn_workers
from varuna_sdk.config import ConfigError, JobConfig
from varuna_sdk.trainer import StopAtStep, build_training, run_worker

TESTS = Path(__file__).resolve().parent


def _spawn(target, world: int, args: tuple, work: Path, timeout_s: float = 150.0) -> None:
    spawn_workers(target, world, args=args, timeout_s=timeout_s, work_dir=work, backend="gloo")


def _merge(dumps: list[dict]) -> tuple[dict, dict]:
    """Union over ranks of {name: tensor} and {name: optimizer state}; every copy of a name (replicas,
    tied weights) must be bitwise identical."""
    params, optim = {}, {}
    for d in dumps:
        for n, t in d["params"].items():
            if n in params:
                assert torch.equal(params[n], t), f"copies of {n} differ"
            params[n] = t
        for n, st in d["optim"].items():
            if n in optim:
                assert optim[n].keys() == st.keys() and all(torch.equal(optim[n][k], st[k]) for k in st), n
            optim[n] = st
    return params, optim


def _losses(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


# ---- reshard round trip ----------------------------------------------------------------------
@pytest.mark.timeout(400)
def test_reshard_round_trip_is_bitwise(tmp_path):
    """Save at (P=4, D=2) after 2 AdamW steps, then load -> save at (2, 3), (8, 1), (1, 1) and back
    at (4, 2): every parameter, AdamW state tensor, step and data position identical to the state
    that was saved; every rank shares the writing (no file written twice). The hops run one after
    another in one set of 8 spawned gloo processes, each hop with its own process group."""
    from varuna_sdk.pipeline.spawn import free_port

    chain = [(4, 2), (2, 3), (8, 1), (1, 1), (4, 2)]
    urls = [str(tmp_path / "store0"), (tmp_path / "store1").as_uri()] + [str(tmp_path / f"store{i}") for i in range(2, 5)]
    ports: set[int] = set()
    while len(ports) < len(chain) + 1:  # distinct: a rank that skips a hop must not reach another hop's store
        ports.add(free_port())
    spawn_port, *ports = ports
    spawn_workers(W.reshard_chain_worker, 8, args=(chain, urls, str(tmp_path), ports, 2), timeout_s=300,
                  work_dir=tmp_path, backend="gloo", port=spawn_port)
    dumps = [[torch.load(tmp_path / f"hop{i}" / f"rank{r}.pt", weights_only=True) for r in range(P * D)]
             for i, (P, D) in enumerate(chain)]

    ref_params, ref_optim = _merge(dumps[0])
    assert len(ref_params) == len(build_training(JobConfig.from_dict(W.tiny_job(1, 1, global_batch=6).to_dict()))
                                  .engine.named_parameters())
    assert all(st["step"].item() == 2 for st in ref_optim.values())  # AdamW state is not trivial
    for (P, D), ranks in zip(chain[1:], dumps[1:]):
        params, optim = _merge(ranks)
        assert params.keys() == ref_params.keys(), (P, D)
        for n, t in ref_params.items():
            assert params[n].dtype == t.dtype and torch.equal(params[n], t), (P, D, n)
        for n, st in ref_optim.items():
            assert optim[n].keys() == st.keys(), (P, D, n)
            for k, v in st.items():
                assert torch.equal(optim[n][k], v), (P, D, n, k)
        assert {(d["step"], d["position"]) for d in ranks} == {(2, 2)}, (P, D)

    # the (4, 2) checkpoint: both replicas wrote segment files, each file once, no replica copies
    info = latest_complete(urls[0])
    assert (info.step, info.P, info.D, info.manifest["world"]) == (2, 4, 2, 8)
    per_rank = {}
    for meta in info.manifest["files"].values():
        per_rank[meta["rank"]] = per_rank.get(meta["rank"], 0) + meta["size"]
    assert set(per_rank) == set(range(8)), per_rank  # every rank of both replicas shares the writing
    wte = info.manifest["items"]["wte.weight"]  # the tied embedding: held by stages 0 and 3
    assert len({wte["tensor"], *wte["optim"]}) == 3, wte  # its tensor and AdamW slots by 3 different ranks
    param_bytes = sum(t.numel() * t.element_size() for t in ref_params.values())
    assert 3 * param_bytes <= info.total_bytes < 3.3 * param_bytes  # params + exp_avg + exp_avg_sq, once
    assert latest_complete(urls[1]).path.startswith("file://")


# ---- torn checkpoints ------------------------------------------------------------------------
@pytest.mark.timeout(180)
def test_writer_killed_at_every_phase_never_yields_a_partial_checkpoint(tmp_path):
    """A writer process is killed (os._exit) at each phase of writing checkpoint 2 after checkpoint
    1 completed: before the manifest is whole, checkpoint 1 is what ``latest_complete`` finds and
    what loads; after it, checkpoint 2. The next writer cleans the torn leftovers (keep=1)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    procs = {}
    for phase in PHASES:
        store = tmp_path / phase
        code = f"import _ckpt_workers as W; W.torn_write({str(store)!r}, {str(tmp_path / 'stage' / phase)!r}, [1, 2], keep=1)"
        procs[phase] = subprocess.Popen([sys.executable, "-c", code], env={**env, "VARUNA_CKPT_CRASH": f"{phase},step=2"},
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    for phase, p in procs.items():
        out = p.communicate(timeout=120)[0].decode()
        assert p.returncode == 17, (phase, p.returncode, out)  # killed by the hook, not finished

    for phase in PHASES:
        url = str(tmp_path / phase)
        store = Store(url)
        info = latest_complete(url)
        survived = 2 if phase in ("published", "pruning") else 1
        assert info is not None and info.step == survived, phase
        names = store.checkpoint_names()
        if survived == 1:
            torn = [n for n in names if n.startswith("step-00000002")]
            if torn:  # a torn checkpoint 2 exists but is never complete
                with pytest.raises(CheckpointError) as ei:
                    store.read_manifest(torn[0])
                expected = "not valid JSON" if phase == "manifest-half" else "has no MANIFEST.json"
                assert expected in str(ei.value), (phase, str(ei.value))
        if phase == "pruning":  # checkpoint 1's manifest was deleted first: never seen as complete again
            assert [i.step for i in complete_checkpoints(url)] == [2]
        for r in range(2):
            got = load_verified(store, info, f"seg-{r:05d}.pt")  # torch.load(weights_only=True), hash checked
            assert torch.equal(got["params"][f"w{r}"], W.torn_payload(survived, r)["params"][f"w{r}"]), phase

        W.torn_write(url, str(tmp_path / "stage2" / phase), [3], keep=1)  # the next writer, no crash
        assert [i.step for i in complete_checkpoints(url)] == [3]
        assert store.checkpoint_names() == [latest_complete(url).name], phase  # torn leftovers pruned


def test_object_store_url_publishes_verifies_and_prunes(tmp_path):
    """An fsspec store that is not a local folder (``memory://``: whole-object puts, no renames):
    two ranks' writers publish, the manifest verifies, files read back with their SHA-256 checked,
    and keep=2 leaves the two newest."""
    import fsspec

    url = "memory://varuna-ckpt-test"
    W.torn_write(url, str(tmp_path / "stage"), [1, 2, 3], keep=2)
    assert [i.step for i in complete_checkpoints(url)] == [3, 2]
    info = latest_complete(url)
    assert info.path == f"{url}/{info.name}" and info.manifest["world"] == 2
    store = Store(url)
    assert not store.local and store.checkpoint_names() == sorted(i.name for i in complete_checkpoints(url))
    got = load_verified(store, info, "seg-00001.pt")
    assert torch.equal(got["params"]["w1"], W.torn_payload(3, 1)["params"]["w1"])
    fsspec.filesystem("memory").rm(f"/varuna-ckpt-test/{info.name}/seg-00000.pt")
    with pytest.raises(CheckpointError, match="file 'seg-00000.pt' listed in the manifest is missing"):
        store.read_manifest(info.name)
    assert latest_complete(url).step == 2
    fsspec.filesystem("memory").rm("/varuna-ckpt-test", recursive=True)


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    """A (P=1, D=1) run in this process: stopped at step 2, then resumed to step 4 with a
    checkpoint every 2 steps (keep 3): checkpoints at steps 2 and 4."""
    tmp = tmp_path_factory.mktemp("single")
    job = W.tiny_job(1, 1, steps=4, checkpoint_every=2, keep_checkpoints=3).to_dict()
    first = run_worker(0, 1, job, str(tmp), should_stop=StopAtStep(2))
    second = run_worker(0, 1, job, str(tmp), generation=1)
    return tmp, job, first, second


@pytest.mark.timeout(120)
def test_single_process_stop_and_resume(single_run):
    tmp, job, first, second = single_run
    assert (first.status, first.step, first.resumed_from) == ("stopped", 2, None)
    assert (second.status, second.step, second.resumed_from, second.steps_run) == ("completed", 4, 2, 2)
    rows = _losses(tmp)
    assert [(r["step"], r["generation"]) for r in rows] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    assert json.loads((tmp / "outcome.json").read_text())["status"] == "completed"
    # the summary's training time covers both generations (it was the last one's only)
    summary = json.loads((tmp / "summary.json").read_text())
    assert summary["train_time_s"] >= 0.95 * sum(r["step_time_s"] for r in rows), (summary, rows)
    assert summary["skipped_steps"] == 0
    assert [i.step for i in complete_checkpoints(tmp / "checkpoints")] == [4, 2]
    assert not [f for f in (tmp / ".checkpoint-staging").rglob("*") if f.is_file()]  # all staged files published
    fresh = dict(job, train={**job["train"], "resume": False})
    with pytest.raises(CheckpointError, match="resume is false but the checkpoint store .*newest at step 4"):
        run_worker(0, 1, fresh, str(tmp))


@pytest.mark.timeout(120)
def test_corrupt_file_is_detected_and_resume_falls_back(single_run, tmp_path):
    """Flip one byte of a segment file of the newest checkpoint (same size, so the cheap listing
    check passes): reading it names the file, and resume agrees on the previous complete one."""
    import shutil

    src, job, _, _ = single_run
    url = tmp_path / "store"
    shutil.copytree(src / "checkpoints", url)
    newest = latest_complete(url)
    fname = sorted(f for f in newest.manifest["files"] if f.startswith("seg-00003-"))[0]
    victim = url / newest.name / fname
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    assert latest_complete(url).name == newest.name  # sizes still match
    with pytest.raises(CheckpointError, match=f"'{fname}' is corrupt"):
        Store(url).read_verified(newest.name, fname, newest.manifest)
    tr = build_training(JobConfig.from_dict(job))
    ckpt = StageCheckpointer(tr.engine, tr.optimizer, str(url), default_staging_dir(tmp_path, 0))
    info, common = ckpt.resume()
    assert info.step == 2 and common["step"] == 2 and tr.engine.step_count == 2


@pytest.mark.timeout(120)
def test_loading_never_unpickles_arbitrary_objects(single_run, tmp_path):
    """A segment file holding a pickled object (re-signed in the manifest, as an attacker with write
    access to the store could) is refused by ``torch.load(weights_only=True)``: its code never runs."""
    import shutil

    src, job, _, _ = single_run
    url = tmp_path / "store"
    shutil.copytree(src / "checkpoints", url)
    info = latest_complete(url)
    flag = tmp_path / "pwned"
    fname = sorted(f for f in info.manifest["files"] if f.startswith("seg-00000-"))[0]
    evil = url / info.name / fname
    torch.save({"x": _Evil(str(flag))}, evil)
    man = json.loads((url / info.name / MANIFEST).read_text())
    man["files"][fname].update(size=evil.stat().st_size, sha256=hashlib.sha256(evil.read_bytes()).hexdigest())
    man["checksum"] = manifest_checksum(man)
    (url / info.name / MANIFEST).write_text(json.dumps(man))
    tr = build_training(JobConfig.from_dict(job))
    ckpt = StageCheckpointer(tr.engine, tr.optimizer, str(url), default_staging_dir(tmp_path, 0))
    with pytest.raises(CheckpointError, match=f"'{fname}' does not load"):
        ckpt.read(latest_complete(url))
    assert not flag.exists()


class _Evil:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (Path(self.path).touch, ())


# ---- correctness across morphs ---------------------------------------------------------------
#: the morphs below train with an optimizer other than the default AdamW whose state has 4 entries
#: per parameter (step, square_avg, momentum_buffer, grad_avg): each must move with its parameter
MORPH_OPTIMIZER = dict(optimizer="RMSprop", optimizer_kwargs={"momentum": 0.9, "centered": True})


@pytest.fixture(scope="module")
def reference_losses(tmp_path_factory) -> list[float]:
    """Per-step losses of an uninterrupted (P=2, D=2) run of 6 steps (``MORPH_OPTIMIZER``); they
    equal the unpartitioned model's trained by plain PyTorch with the same optimizer."""
    from varuna_sdk.notebook import Job

    out = tmp_path_factory.mktemp("reference")
    _spawn(run_worker, 4, (W.tiny_job(2, 2, **MORPH_OPTIMIZER).to_dict(), str(out)), out)
    rows = _losses(out)
    assert [r["step"] for r in rows] == list(range(6))
    losses = [r["loss"] for r in rows]
    assert losses == pytest.approx(Job(W.tiny_job(2, 2, **MORPH_OPTIMIZER)).plain_pytorch_losses(6), rel=1e-5)
    return losses


@pytest.mark.timeout(300)
def test_stop_resume_morphs_keep_the_loss_trajectory(tmp_path, reference_losses):
    """(P=2,D=2) stops after step 2 (only rank 3 is asked), (P=3,D=1) resumes and stops after step
    4 (only rank 1 is asked), (P=2,D=2) resumes to the end: the per-step losses equal the
    uninterrupted run's (1e-5 relative), each step exactly once, the optimizer's state (RMSprop's
    four entries) moving with each parameter to its new stage. Store: a file:// URL."""
    run = tmp_path / "run"
    url = (tmp_path / "store").as_uri()
    plan = [((2, 2), StopAtStep(2, ranks=(3,))), ((3, 1), StopAtStep(4, ranks=(1,))), ((2, 2), None)]
    for gen, ((P, D), stop) in enumerate(plan):
        job = W.tiny_job(P, D, checkpoint_url=url, **MORPH_OPTIMIZER).to_dict()
        _spawn(run_worker, P * D, (job, str(run), None, stop, gen), run)
        outcome = json.loads((run / "outcome.json").read_text())
        if stop is not None:
            assert (outcome["status"], outcome["step"]) == ("stopped", stop.step), outcome
            assert latest_complete(url).name == outcome["checkpoint"]
            assert latest_complete(url).manifest["generation"] == gen
        else:
            assert (outcome["status"], outcome["step"], outcome["resumed_from"]) == ("completed", 6, 4), outcome
    rows = _losses(run)
    assert [(r["step"], r["generation"], r["P"], r["D"]) for r in rows] == [
        (0, 0, 2, 2), (1, 0, 2, 2), (2, 1, 3, 1), (3, 1, 3, 1), (4, 2, 2, 2), (5, 2, 2, 2)]
    assert [r["loss"] for r in rows] == pytest.approx(reference_losses, rel=1e-5)


@pytest.mark.timeout(300)
def test_sudden_loss_resumes_at_the_last_complete_checkpoint(tmp_path, reference_losses):
    """A (P=2,D=2) run checkpointing every 2 steps loses rank 1 without notice (os._exit after step
    index 4); relaunched at (P=3,D=1) it starts exactly at the newest complete checkpoint's step,
    with the uninterrupted losses from there on; keep_checkpoints=2 leaves the 2 newest."""
    run = tmp_path / "run"
    store = tmp_path / "store"
    common = dict(checkpoint_every=2, keep_checkpoints=2, checkpoint_url=str(store), **MORPH_OPTIMIZER)
    with pytest.raises(WorkerFailure):
        _spawn(run_worker, 4, (W.tiny_job(2, 2, **common).to_dict(), str(run), W.DieAtStep(4, rank=1)), run)
    last = latest_complete(store)
    assert last is not None and last.step in (2, 4), last
    _spawn(run_worker, 3, (W.tiny_job(3, 1, **common).to_dict(), str(run), None, None, 1), run)
    outcome = json.loads((run / "outcome.json").read_text())
    assert (outcome["status"], outcome["resumed_from"], outcome["step"]) == ("completed", last.step, 6)
    gen1 = [r for r in _losses(run) if r["generation"] == 1]
    assert [r["step"] for r in gen1] == list(range(last.step, 6))
    assert [r["loss"] for r in gen1] == pytest.approx(reference_losses[last.step:], rel=1e-5)
    assert [i.step for i in complete_checkpoints(store)] == [6, 4]
    assert len(Store(store).checkpoint_names()) == 2  # torn and old ones deleted


# ---- configuration ---------------------------------------------------------------------------
def test_checkpoint_config_round_trip_and_validation(tmp_path):
    job = W.tiny_job(2, 2, checkpoint_every=5, checkpoint_url="file:///shared/ckpt", keep_checkpoints=2, resume=False)
    back = JobConfig.from_yaml_text(job.to_yaml())
    assert back == job and back.train.checkpoint_every == 5 and back.train.resume is False
    assert JobConfig.from_yaml_text("train:\n  steps: 3\n").train.checkpoint_url is None
    bad = [("checkpoint_every", -1, "checkpoint_every=-1 must be an integer >= 0"),
           ("checkpoint_every", 2.5, "checkpoint_every=2.5 must be an integer"),
           ("keep_checkpoints", 0, "keep_checkpoints=0 must be an integer >= 1"),
           ("resume", "yes", "resume='yes' must be true or false"),
           ("checkpoint_url", "", "must be a path or an fsspec URL"),
           ("checkpoint_url", "nosuchfs://b/x", "fsspec cannot open nosuchfs:// URLs")]
    for field, value, message in bad:
        j = W.tiny_job(1, 1)
        setattr(j.train, field, value)
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
            j.validate()
