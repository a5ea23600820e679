"""Checkpoints against odd, forged and failing stores (real files, real training in this process).

Shown: a manifest whose checksum verifies but whose structure is odd is skipped with its reason
(it used to kill the worker), and so is one not signed with the job's secret; every fallback says
which checkpoint was skipped and why; a write that fails on a full disk removes its partial files
and its local staging; a read-only store is refused before the first step; a job secret persists
in the run folder (0600) so a later generation verifies what an earlier one signed. Property-based:
any manifest bytes give a verified manifest or a ``CheckpointError``.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import _ckpt_workers as W
from varuna_sdk.checkpoint import CheckpointError, complete_checkpoints
from varuna_sdk.checkpoint.store import (FORMAT, MANIFEST, Store, check_manifest_schema, manifest_checksum,
                                         manifest_key, manifest_mac)
from varuna_sdk.checkpoint.writer import CheckpointWriter
from varuna_sdk.cluster.hosts import Secret
from varuna_sdk.trainer import run_worker

pytestmark = pytest.mark.timeout(180)
SECRET = "s3cret-of-this-job-0123456789"


@pytest.fixture(scope="module")
def signed_run(tmp_path_factory):
    """A (P=1, D=1) run signed with SECRET: checkpoints at steps 2 and 4."""
    tmp = tmp_path_factory.mktemp("signed")
    job = W.tiny_job(1, 1, steps=4, checkpoint_every=2, keep_checkpoints=3).to_dict()
    out = run_worker(0, 1, job, str(tmp), secret=SECRET)
    assert out.status == "completed"
    return tmp, job


def _forge(store_dir: Path, name: str, body: dict, key: bytes | None = None) -> None:
    body = {"format": FORMAT, **body}
    if key is not None:
        body["mac"] = manifest_mac(key, body)
    body["checksum"] = manifest_checksum(body)
    (store_dir / name).mkdir(parents=True, exist_ok=True)
    (store_dir / name / MANIFEST).write_text(json.dumps(body))


ODD = [
    {"step": 9, "world": 1, "files": []},
    {"step": 9, "world": 1, "files": {"../../etc/passwd": {"size": 1, "sha256": "0" * 64, "rank": 0}}},
    {"step": 9, "world": 1, "files": {"a.pt": {"size": "big", "sha256": "0" * 64, "rank": 0}}},
    {"step": "9", "world": 1, "files": {}},
    {"step": 9, "world": 1, "files": {}, "P": 0},
    {"step": 9, "world": 1, "files": {}, "items": {"w": {"tensor": "missing.pt"}}},
    {"step": 9, "world": 1, "files": {}, "items": []},
    {"step": 9, "world": 1, "files": {}, "created": "yesterday"},
]


@pytest.mark.parametrize("body", ODD, ids=range(len(ODD)))
def test_a_checksummed_but_odd_manifest_is_skipped_with_its_reason(tmp_path, body):
    _forge(tmp_path, "step-00000009-odd", body)
    skipped: list = []
    assert complete_checkpoints(tmp_path, skipped=skipped) == []
    assert len(skipped) == 1 and "is malformed" in skipped[0][1], skipped


def test_an_odd_or_unsigned_newer_checkpoint_is_skipped_and_the_fallback_said(signed_run, tmp_path, capsys):
    src, job = signed_run
    store = tmp_path / "run" / "checkpoints"
    shutil.copytree(src / "checkpoints", store)
    newest = complete_checkpoints(store, manifest_key(SECRET))[0]
    assert newest.step == 4 and "mac" in newest.manifest
    # a newer checkpoint whose checksum verifies but whose items point nowhere (used to kill the worker)
    _forge(store, "step-00000005-aaaa", {"step": 5, "world": 1, "files": {}, "items": {"x": {"tensor": "gone.pt"}}},
           key=manifest_key(SECRET))
    # ... and a newer one, well-formed, copied from the real one but not signed with the job's secret
    forged = dict(newest.manifest)
    forged.pop("mac")
    shutil.copytree(store / newest.name, store / "step-00000006-bbbb")
    _forge(store, "step-00000006-bbbb", {**forged, "step": 6})
    more = dict(job, train={**job["train"], "steps": 6, "checkpoint_url": str(store)})
    capsys.readouterr()
    out = run_worker(0, 1, more, str(tmp_path / "run"), secret=SECRET)
    said = capsys.readouterr().out
    assert out.resumed_from == 4, said
    assert f"skipped checkpoint step-00000006-bbbb (checkpoint 'step-00000006-bbbb' in '{store}': MANIFEST.json is " \
           f"not signed with this job's secret" in said
    assert "skipped checkpoint step-00000005-aaaa (" in said and "is malformed: item 'x'" in said
    assert f"falling back to {newest.name}" in said
    # without the secret (a run without a manager) the signed ones still verify by checksum
    assert "step-00000006-bbbb" in {i.name for i in complete_checkpoints(store)}
    assert "step-00000006-bbbb" not in {i.name for i in complete_checkpoints(store, manifest_key(SECRET))}


def test_a_read_only_store_is_refused_before_the_first_step(tmp_path):
    if os.geteuid() == 0:
        ro = "/proc/varuna-cannot-write-here"   # root ignores file modes; /proc refuses anyone
    else:
        d = tmp_path / "ro"
        d.mkdir()
        d.chmod(stat.S_IRUSR | stat.S_IXUSR)
        ro = str(d / "ckpt")
    job = W.tiny_job(1, 1, steps=2, checkpoint_url=ro).to_dict()
    with pytest.raises(CheckpointError, match=r"checkpoint store .* is not writable .*checked before the first step"):
        run_worker(0, 1, job, str(tmp_path / "run"))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()   # no step ran


def test_a_full_disk_leaves_no_partial_files_and_no_staging(tmp_path):
    """A real size-limited file system would need root to mount; a store whose second file write
    fails with ENOSPC (the error a full disk gives) exercises the same clean-up path."""
    store_dir = tmp_path / "store"

    class FullDisk(Store):
        writes = 0

        def put_file(self, local_path, rel, move=True):
            FullDisk.writes += 1
            if FullDisk.writes >= 2:
                dest = self.path(rel)
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                with open(dest + ".tmp-part", "wb") as f:   # what a write cut short leaves ...
                    f.write(b"half")
                os.unlink(dest + ".tmp-part")               # ... and Store.put_file now removes
                raise OSError(28, "No space left on device")
            super().put_file(local_path, rel, move)

    w = CheckpointWriter(str(store_dir), 0, 1, tmp_path / "staging" / "rank-00000")
    w.store = FullDisk(str(store_dir))
    import torch
    w.save("step-00000002-abcd", 2, {"a.pt": {"t": torch.ones(1000)}, "b.pt": {"t": torch.ones(1000)}}, {"P": 1, "D": 1})
    with pytest.raises(CheckpointError, match="No space left on device"):
        w.wait()
    assert not (store_dir / "step-00000002-abcd").exists(), list(store_dir.rglob("*"))
    assert not (tmp_path / "staging").exists() or not list((tmp_path / "staging").rglob("*"))


def test_store_writes_remove_their_temporary_file_on_failure(tmp_path, monkeypatch):
    store = Store(str(tmp_path))

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(OSError):
        store.write_bytes("x/obj", b"data" * 100)
    src = tmp_path / "local.bin"
    src.write_bytes(b"z" * 100)
    with pytest.raises(OSError):
        store.put_file(str(src), "x/file", move=False)
    assert [p.name for p in (tmp_path / "x").iterdir()] == []   # no .tmp-* left


def test_the_job_secret_persists_with_mode_0600(tmp_path):
    p = tmp_path / ".job-secret"
    a = Secret.load_or_create(p)
    assert stat.S_IMODE(p.stat().st_mode) == 0o600 and len(a.reveal()) >= 32
    assert Secret.load_or_create(p).reveal() == a.reveal()
    p.chmod(0o644)
    with pytest.raises(PermissionError, match="readable by others"):
        Secret.load_or_create(p)


_plain = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
                      lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                      max_leaves=15)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=200), body=st.dictionaries(
    st.sampled_from(["step", "world", "files", "items", "P", "D", "created", "format", "checksum", "mac"]), _plain))
def test_any_manifest_is_verified_or_a_checkpoint_error(tmp_path_factory, raw, body):
    d = tmp_path_factory.mktemp("m")
    for name, data in (("step-00000001-raw", raw), ("step-00000002-body", None)):
        (d / name).mkdir()
        if data is None:
            b = {"format": FORMAT, **body}
            try:
                b["checksum"] = manifest_checksum(b)
                data = json.dumps(b).encode()
            except (TypeError, ValueError):
                data = b"{}"
        (d / name / MANIFEST).write_bytes(data)
    store = Store(str(d), manifest_key(SECRET))
    for name in ("step-00000001-raw", "step-00000002-body"):
        try:
            m = Store(str(d)).read_manifest(name)
        except CheckpointError:
            continue
        assert check_manifest_schema(m) is None
        with pytest.raises(CheckpointError, match="not signed"):   # nobody forged a MAC here
            store.read_manifest(name)
