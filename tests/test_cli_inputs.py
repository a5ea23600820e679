"""Bad input to the ``varuna`` command line (and the notebook ``Job``) is refused before any work,
with exit status 2 and one line saying what to pass instead: an empty run folder, a profile
output path that cannot be written, a ``--job-id`` that is not the run folder's name, NCCL asked
for where there is no CUDA, ``varuna plan``'s profile and ``--gpus-per-vm`` mistakes, a negative
``varuna stop --wait``, a folder of runs given to ``stop``/``logs``; and the messages and notes
that said the wrong thing (plan's units and extrapolation note, a host file's word count, a
corrupt checkpoint file, a calibration under load said twice). The CLI cases run the installed
``varuna`` command in a subprocess, but ``varuna plan``'s, which call its ``main`` in this process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

VARUNA = str(Path(sys.executable).parent / "varuna")

TINY = """name: tiny-inputs
model: {preset: tiny, n_layer: 2}
data: {tokenizer: byte, seq_len: 16}
parallel: {P: 2, D: 1, global_batch: 4, micro_batch_size: 2}
train: {steps: 3, eval_batches: 1}
launch: {gpus: 2}
"""


def _varuna(*args: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([VARUNA, *args], capture_output=True, text=True, cwd=cwd, timeout=timeout)


def _varuna_here(*args: str) -> subprocess.CompletedProcess:
    """``varuna ARGS`` run in this process (the same ``main`` as the command, without the 2-3 s
    of a new interpreter importing torch): for the ``varuna plan`` cases."""
    import contextlib
    import io

    from varuna_sdk.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess([VARUNA, *args], code, out.getvalue(), err.getvalue())


@pytest.fixture
def cfg(tmp_path) -> Path:
    (tmp_path / "job.yaml").write_text(TINY)
    return tmp_path / "job.yaml"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("cmd", ["train", "launch"])
@pytest.mark.parametrize("run_dir", ["", "  "])
def test_an_empty_run_dir_is_refused_and_nothing_is_written_in_the_current_folder(cfg, tmp_path, cmd, run_dir):
    here = tmp_path / "here"
    here.mkdir()
    out = _varuna(cmd, str(cfg), "--run-dir", run_dir, *(["--local", "2"] if cmd == "launch" else []), cwd=here)
    assert out.returncode == 2, out
    assert "the run folder is empty" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert list(here.iterdir()) == [], list(here.iterdir())   # no events.db, .job-secret, checkpoints here


def test_a_notebook_job_refuses_an_empty_run_dir_or_a_file_at_construction(cfg, tmp_path):
    from varuna_sdk.config import ConfigError
    from varuna_sdk.notebook import Job

    with pytest.raises(ConfigError, match=r"Job\(run_dir=''\): the run folder is empty") as e:
        Job(str(cfg), run_dir="")
    assert "--run-dir" not in str(e.value)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match=r"Job\(run_dir='.*afile'\) is a file, not a folder") as e:
        Job(str(cfg), run_dir=str(tmp_path / "afile"))
    assert "--run-dir" not in str(e.value)
    with pytest.raises(ConfigError, match=r"is under '.*afile', a file"):
        Job(str(cfg), run_dir=str(tmp_path / "afile" / "run"))


@pytest.mark.timeout(120)
def test_calibrate_checks_its_output_path_before_calibrating(cfg, tmp_path):
    (tmp_path / "afile").write_text("x")
    for path, says in ((tmp_path / "no" / "such" / "p.json", "does not exist; make it first"),
                       (tmp_path, "is a folder"),
                       (tmp_path / "afile" / "p.json", "is a file, not a folder")):
        out = _varuna("calibrate", str(cfg), "-o", str(path), timeout=60)
        assert out.returncode == 2, out
        assert says in out.stderr and "Traceback" not in out.stderr, out.stderr
        assert "segments at micro-batch sizes" not in out.stdout, out.stdout   # nothing was calibrated


@pytest.mark.timeout(120)
def test_launch_refuses_a_job_id_that_is_not_the_run_folders_name(cfg, tmp_path):
    """A job launched under another id would not be found by the next launch on its folder, which
    would then start a finished job again; so the id must be the folder's name."""
    run = tmp_path / "runs" / "lb"
    out = _varuna("launch", str(cfg), "--run-dir", str(run), "--local", "2", "--job-id", "other")
    assert out.returncode == 2, out
    assert "--job-id other is not the run folder's name ('lb')" in out.stderr, out.stderr
    assert "--job-id lb" in out.stderr and not run.exists(), out.stderr
    out = _varuna("launch", str(cfg), "--local", "2", "--job-id", "other")
    assert out.returncode == 2 and "--run-dir DIR/other" in out.stderr, out


@pytest.mark.timeout(120)
def test_nccl_without_cuda_is_refused_before_starting(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: NCCL can run")
    (tmp_path / "job.yaml").write_text(TINY.replace("launch: {gpus: 2}", "launch: {gpus: 2, backend: nccl}"))
    run = tmp_path / "run"
    for cmd in (["train"], ["launch", "--local", "2"]):
        out = _varuna(cmd[0], str(tmp_path / "job.yaml"), "--run-dir", str(run), *cmd[1:])
        assert out.returncode == 2, out
        assert "launch.backend: nccl" in out.stderr and "no CUDA GPU" in out.stderr, out.stderr
        assert "launch.backend: auto" in out.stderr and not run.exists(), out.stderr


# ------------------------------------------------------------------------------ varuna plan
@pytest.fixture
def plan_files(tmp_path):
    sys.path.insert(0, str(Path(__file__).parent))
    from test_planner import HEAVY, _job, synthetic_profile

    prof = synthetic_profile(HEAVY, sizes=(1, 2, 4), param_bytes=4e8)   # 8 segments: _job's model
    path = tmp_path / "profile.json"
    prof.to_json(path)

    def config(**parallel) -> str:
        cfg = tmp_path / f"job-{len(list(tmp_path.glob('job-*')))}.yaml"
        _job(**parallel).to_yaml(cfg)
        return str(cfg)

    return prof, str(path), config


@pytest.mark.timeout(120)
def test_plan_writes_the_configs_own_plan_in_the_tables_units(plan_files):
    import re

    _, path, config = plan_files
    out = _varuna_here("plan", config(P=2, D=2), "--gpus", "4", "--profile", path, "--global-batch", "32000000")
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("with parallel.P=2"))
    m = re.search(r"([\d.]+) (ms|s|min|h) per mini-batch", line)
    assert m and m.group(2) == "h" and float(m.group(1)) < 1000, line   # not "3600000.0 ms"


@pytest.mark.timeout(120)
def test_the_extrapolation_note_is_printed_only_when_a_row_shown_uses_such_a_size(plan_files):
    from varuna_sdk.planner.plan import plan

    prof, path, config = plan_files
    cfg = config()
    out = _varuna_here("plan", cfg, "--gpus", "8", "--profile", path, "--top", "100")
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.split()[:4] == ["rank", "P", "D", "mbs"])
    sizes = [int(ln.split()[3]) for ln in lines[head + 1:] if ln.split() and ln.split()[0].isdigit()]
    k = next(i for i, b in enumerate(sizes) if b > 4)   # the rows before it use sizes the profile measured
    assert k >= 1, sizes
    note = "note: micro-batch sizes above 4 are extrapolated from the profile"
    for top, said in ((k, False), (k + 1, True)):
        out = _varuna_here("plan", cfg, "--gpus", "8", "--profile", path, "--top", str(top))
        assert out.returncode == 0, out.stderr[-2000:]
        assert (note in out.stdout) is said, (top, out.stdout)
    # a search whose feasible rows all use measured sizes has no such note at all
    only = plan(prof, 8, 32, shared_egress=True, micro_batch_sizes=[1, 2, 4])
    assert not any("extrapolated" in n for n in only.notes) and "extrapolated" not in only.table(top=50)


@pytest.mark.timeout(120)
def test_plan_names_a_bad_profile_file_and_the_command_that_makes_one(plan_files, tmp_path):
    _, _, config = plan_files
    cfg = config()
    for name, text, says in (("notjson.yaml", "a: b\n", "is not JSON"),
                             ("empty.json", "{}", "profile version None is not 1"),
                             ("list.json", "[1]", "holds a JSON list, not a profile")):
        (tmp_path / name).write_text(text)
        out = _varuna_here("plan", cfg, "--gpus", "4", "--profile", str(tmp_path / name))
        assert out.returncode == 2, out
        err = out.stderr
        assert f"--profile {tmp_path / name}" in err and says in err, err
        assert f"`varuna calibrate {cfg} -o {tmp_path / name}`" in err and "calibrate()" not in err, err
        assert "Traceback" not in err


@pytest.mark.timeout(60)
def test_plan_refuses_gpus_that_are_not_whole_vms(plan_files):
    _, path, config = plan_files
    out = _varuna_here("plan", config(), "--gpus", "4", "--gpus-per-vm", "3", "--profile", path)
    assert out.returncode == 2, out
    assert "--gpus 4 is not a multiple of --gpus-per-vm 3" in out.stderr and "3 or 6" in out.stderr, out.stderr


@pytest.mark.parametrize("cmd", ["plan", "calibrate", "status", "stop", "logs", "train", "launch"])
def test_every_command_documents_its_exit_status(cmd):
    out = _varuna(cmd, "--help", timeout=60)
    assert out.returncode == 0, out
    text = out.stdout.split("exit status:", 1)
    assert len(text) == 2, f"varuna {cmd} --help says nothing of its exit status"
    assert "  0 " in text[1] and "  2 " in text[1], text[1]


# ------------------------------------------------------------------------------ stop, logs
def test_stop_refuses_a_negative_wait(tmp_path):
    out = _varuna("stop", str(tmp_path), "--wait", "-5", timeout=60)
    assert out.returncode == 2 and "--wait: -5 must be a number of seconds >= 0" in out.stderr, out


def _fake_run(path: Path) -> Path:
    path.mkdir(parents=True)
    from varuna_sdk.manager.events import EventLog

    EventLog(path / "events.db").close()
    return path


@pytest.mark.parametrize("cmd", ["stop", "logs"])
def test_stop_and_logs_say_what_a_path_that_is_no_run_folder_is(tmp_path, cmd):
    out = _varuna(cmd, str(tmp_path / "nonexistent"), timeout=60)
    assert out.returncode == 2 and "does not exist" in out.stderr and "holds no events.db" not in out.stderr, out
    runs = tmp_path / "runs"
    for name in ("job-a", "job-b"):
        _fake_run(runs / name)
    out = _varuna(cmd, str(runs), timeout=60)
    assert out.returncode == 2, out
    assert "is a folder of runs" in out.stderr and "2 run folder(s)" in out.stderr, out.stderr
    assert "job-a" in out.stderr and "job-b" in out.stderr and f"varuna {cmd} {runs}/job-" in out.stderr, out.stderr


# ------------------------------------------------------------------------------ messages
def test_a_host_file_line_with_bad_options_is_described_as_written():
    from varuna_sdk.cluster.hostfile import HostFileError, parse_host_file

    with pytest.raises(HostFileError, match=r"'=' is not a key=value option \(no key\)"):
        parse_host_file("garbage line here = =")
    with pytest.raises(HostFileError, match=r"got 3 words before its 1 key=value option\(s\) \('a b c'\)"):
        parse_host_file("a b c gpus=1")


def test_a_corrupt_checkpoint_file_says_whether_its_size_or_its_bytes_differ(tmp_path):
    import hashlib

    from varuna_sdk.checkpoint.store import CheckpointError, Store

    store = Store(str(tmp_path))
    store.fs.makedirs(f"{store.root}/ck", exist_ok=True)
    data = b"x" * 1000
    manifest = {"files": {"seg.pt": {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}}}
    (tmp_path / "ck" / "seg.pt").write_bytes(b"y" + data[1:])   # one byte flipped
    with pytest.raises(CheckpointError, match=r"its size matches the manifest's \(1000 bytes\) but its SHA-256 differs"):
        store.read_verified("ck", "seg.pt", manifest)
    (tmp_path / "ck" / "seg.pt").write_bytes(data[:-1])
    with pytest.raises(CheckpointError, match=r"it has 999 bytes, the manifest says 1000"):
        store.read_verified("ck", "seg.pt", manifest)


@pytest.mark.timeout(180)
def test_the_manager_says_a_calibration_under_load_once(tmp_path, monkeypatch):
    """A calibration made under load is said once per launch: the manager's log line and WARNING
    event, not also a ``UserWarning`` from ``calibrate_job``."""
    import warnings

    import varuna_sdk.profiling.job as pj
    from test_cost_model import _fake_network
    from varuna_sdk.cluster.provider import LocalProvider
    from varuna_sdk.config import DataConfig, JobConfig, LaunchConfig, ModelConfig, ParallelConfig
    from varuna_sdk.manager.events import Kind
    from varuna_sdk.manager.manager import Manager

    monkeypatch.setattr(pj, "default_cache_dir", lambda: tmp_path / "cache")
    monkeypatch.setattr(pj, "busy_fraction", lambda *a, **k: 0.95)
    pj.store_host_network(tmp_path / "cache" / "profiles" / "hosts", 1, _fake_network())
    job = JobConfig(name="busy", model=ModelConfig(preset="tiny", n_layer=1, n_embd=16, n_head=2),
                    data=DataConfig(tokenizer="byte", seq_len=8), parallel=ParallelConfig(global_batch=4),
                    launch=LaunchConfig(gpus=1))
    with LocalProvider(1) as provider:
        mgr = Manager(job, provider, run_dir=tmp_path / "run")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mgr.profile()
        said = [e.payload["message"] for e in mgr.log.events(kind=Kind.WARNING)]
    assert len([s for s in said if "calibrated while other work kept 95%" in s]) == 1, said
    assert not [w for w in caught if "calibrated while other work" in str(w.message)], [str(w.message) for w in caught]
