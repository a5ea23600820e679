"""Every parser of a file or config a user (or an attacker with write access to one) hands us —
job YAML, host files, spot traces — turns any input into either a valid result or one clear error
of its own type (``ConfigError``, ``HostFileError``, ``TraceError``): never another exception, a
hang or unbounded memory. Property-based (hypothesis, bounded example counts) plus the inputs that
broke it before: YAML aliases that expand to gigabytes, NaN / infinity / strings / huge values in
numeric fields (which passed ``validate()`` and failed inside workers), a job name that put the run
folder outside ``run_dir``, raw tracebacks from the CLI, and a trace count row that demanded
unbounded memory.
"""

from __future__ import annotations

import dataclasses
import math
import resource
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from varuna_sdk import cli
from varuna_sdk.cluster.hostfile import HostFileError, HostFileProvider, parse_host_file
from varuna_sdk.cluster.spot import TraceError, load_trace
from varuna_sdk.config import (RULES, ConfigError, Flag, Int, JobConfig, Num, Plain, Text)

FAST = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
SECTIONS = {"model": "ModelConfig", "data": "DataConfig", "parallel": "ParallelConfig", "train": "TrainConfig",
            "launch": "LaunchConfig"}


def test_every_field_of_every_section_has_a_rule():
    job = JobConfig()
    for name in SECTIONS:
        section = getattr(job, name)
        assert {f.name for f in dataclasses.fields(section)} == set(RULES[type(section)]), name


def _bad_values(rule) -> list:
    if isinstance(rule, Int):
        return [math.nan, "1", 1.5, True, rule.hi + 1, rule.lo - 1, [], 10 ** 400]
    if isinstance(rule, Num):
        return [math.nan, math.inf, -math.inf, "0.5", True, [0.1], {"a": 1}, 1e308 * 10]
    if isinstance(rule, Text):
        return [5, ["a"], {"a": "b"}, "x" * 5000, True] + ([] if rule.optional or rule.choices else [None]) + (
            ["surely-not-a-choice"] if rule.choices else ["", "   "])
    if isinstance(rule, Flag):
        return ["yes", 1, 0.0, []]
    if isinstance(rule, Plain):
        return {"map": ["s", [1], {"k": math.nan}, {1: 2}, {"k": {"k": {"k": {"k": {"k": {"k": {"k": {"k": {"k": 1}}}}}}}}},
                       {f"k{i}": i for i in range(5000)}],
                "names": ["s", [1], [""], ["x" * 5000]],
                "index_lists": ["s", [0, 1], [[-1]], [["0"]], [[True]]],
                "inputs": ["s", [], [1], {"a": 1}],
                "targets": [5, "", "   ", [], ["a", "a"], [1], ["a", ""], {"a": "b"}, "x" * 5000, True],
                "blocks": [5, "", "   ", [], ["a"], ["a", "a"], [1, 2], ["a", ""], {"a": "b"}, "x" * 5000, True],
                "stage_flags": ["yes", 1, [], [1, 0], ["true"], {"a": True}],
                "stage_counts": ["s", -3, 1 << 21, 2.5, True, [], [-1], [1.5], [True], [1 << 21]]}[rule.kind]
    raise AssertionError(rule)


CASES = [(section, fname, bad) for section, cls in SECTIONS.items()
         for fname, rule in RULES[getattr(JobConfig(), section).__class__].items()
         for bad in _bad_values(rule)]


@pytest.mark.parametrize("section,fname,bad", CASES, ids=[f"{s}.{f}-{i}" for i, (s, f, _) in enumerate(CASES)])
def test_a_bad_value_in_any_field_is_a_config_error_naming_it(section, fname, bad):
    job = JobConfig()
    setattr(getattr(job, section), fname, bad)
    with pytest.raises(ConfigError) as e:
        job.validate()
    assert f"{section}.{fname}" in str(e.value), str(e.value)
    assert len(str(e.value)) < 600


@pytest.mark.parametrize("name", ["../outside", "a/b", "/abs", "..", ".hidden", "", "x" * 101, "na\x00me", 7,
                                  "ünicode"])
def test_a_job_name_cannot_place_the_run_folder_outside_run_dir(name):
    with pytest.raises(ConfigError, match=r"name=.* must be 1-100 ASCII letters \(a-z, A-Z\), digits"):
        JobConfig(name=name).validate()


def test_yaml_aliases_are_refused_before_they_expand(tmp_path):
    lol = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 9):
        lol.append(f"{chr(97 + i)}: &{chr(97 + i)} [" + ", ".join([f"*{chr(96 + i)}"] * 10) + "]")
    f = tmp_path / "laughs.yaml"
    f.write_text("\n".join(lol) + "\n")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"laughs.yaml: line 2: YAML alias \*a is not allowed"):
        JobConfig.from_yaml(f)
    assert time.monotonic() - t0 < 10.0   # refused, not expanded (expanding takes minutes)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 50_000  # KiB: nothing expanded


@pytest.mark.parametrize("text,pattern", [
    ("train: {steps: 5\n", r"bad.yaml: line 2, column 1: not valid YAML"),
    ("train:\n  steps: [1, 2\n", r"bad.yaml: line \d+, column \d+: not valid YAML"),
    ("!!python/object:os.system {}\n", r"bad.yaml: line 1, column 1: not valid YAML"),
    ("train: {steps: .nan}\n", r"train.steps=nan must be an integer >= 1"),
    ("train: {lr: .inf}\n", r"train.lr=inf must be a finite number in \(0, 10\]"),
    ("train: {lr: '1e-3'}\n", r"train.lr='1e-3' must be a finite number"),
    ("parallel: {global_batch: 1e400}\n", r"parallel.global_batch=.* must be an integer"),
    ("name: ../../etc\n", r"name='../../etc' must be 1-100 ASCII letters"),
    ("train: 5\n", r"config section 'train' must be a mapping"),
    ("- a\n- b\n", r"a job config must be a mapping"),
    ("model: {kwargs: {n: .nan}}\n", r"model.kwargs.n=nan: values must be finite"),
])
def test_the_cli_prints_one_clear_line_and_exits_2(tmp_path, capsys, text, pattern):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    assert cli.main(["train", str(f)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("varuna: ") and "Traceback" not in err and err.count("\n") == 1, err
    import re
    assert re.search(pattern, err), err


def test_oversized_and_binary_config_files_are_refused(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text("# " + "x" * (1 << 20) + "\n")
    with pytest.raises(ConfigError, match="is 104857[0-9] bytes; a job config is at most 1048576 bytes"):
        JobConfig.from_yaml(big)
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\xff\xfe\x00train")
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        JobConfig.from_yaml(binary)


_plain = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
                      lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                      max_leaves=12)


@FAST
@given(text=st.text(max_size=300))
def test_any_yaml_text_is_a_config_or_a_config_error(text):
    try:
        JobConfig.from_yaml_text(text).validate()
    except ConfigError:
        pass


@FAST
@given(data=st.dictionaries(st.sampled_from(list(SECTIONS) + ["name"]),
                            st.dictionaries(st.sampled_from(sorted({f for r in RULES.values() for f in r})), _plain,
                                            max_size=4) | _plain, max_size=4))
def test_any_config_mapping_is_a_config_or_a_config_error(data):
    try:
        JobConfig.from_dict(data).validate()
    except ConfigError:
        pass


@FAST
@given(text=st.text(max_size=200), structured=st.lists(
    st.tuples(st.text(min_size=1, max_size=8), st.sampled_from(["127.0.0.1", "h:22", "h:99999", "h:x", "[::1]:2", ":"]),
              st.lists(st.sampled_from(["gpus=2", "gpus=²", "gpus=" + "9" * 5000, "user=u", "bogus=1", "label.x=y",
                                        "gpus=-1", "python=/p", "=", "port=1"]), max_size=3)), max_size=5))
def test_any_host_file_is_hosts_or_a_host_file_error(text, structured):
    lines = [text] + [" ".join([n, a, *o]) for n, a, o in structured]
    for t in lines:
        try:
            hosts = parse_host_file(t)
        except HostFileError:
            continue
        assert all(h.name and h.address for h in hosts)


def test_host_file_provider_refuses_binary_and_oversized_files(tmp_path):
    f = tmp_path / "hosts"
    f.write_bytes(b"\xff\xfe vm0 127.0.0.1\n")
    with pytest.raises(HostFileError, match="is not UTF-8 text"):
        HostFileProvider(f)
    f.write_text("#" * (2 << 20))
    with pytest.raises(HostFileError, match="is larger than 1048576 bytes"):
        HostFileProvider(f)


@FAST
@given(rows=st.lists(st.one_of(
    st.tuples(st.integers(-5, 10 ** 7), st.sampled_from(["add", "remove", "up"]), st.sampled_from(["n0", "n1", "-x", ""])),
    st.tuples(st.integers(-5, 10 ** 7), st.integers(-3, 10 ** 12)),
    st.text(max_size=30)), max_size=12))
def test_any_trace_is_a_trace_or_a_trace_error(tmp_path_factory, rows):
    f = tmp_path_factory.mktemp("trace") / "t.csv"
    f.write_text("\n".join(",".join(map(str, r)) if isinstance(r, tuple) else r for r in rows) + "\n")
    try:
        tr = load_trace(f)
    except TraceError:
        return
    assert len(tr.events) <= 1_000_000


def test_a_count_row_cannot_demand_unbounded_memory(tmp_path):
    f = tmp_path / "t.csv"
    f.write_text("0,2\n10,1000000000000\n")
    t0 = time.monotonic()
    with pytest.raises(TraceError, match=r"t.csv:2: count 1000000000000 must be in 0..100000"):
        load_trace(f)
    assert time.monotonic() - t0 < 10.0   # refused before allocating (allocating takes minutes or fails)
    f.write_text("".join(f"{i},{100_000 if i % 2 else 0}\n" for i in range(40)))
    with pytest.raises(TraceError, match="more than 1000000 events"):
        load_trace(f)
    for bad in (math.nan, math.inf, -1.0):
        with pytest.raises(TraceError):
            load_trace(f, compress=bad)
    with pytest.raises(TraceError, match="finite"):
        load_trace(f, start_s=math.nan)


def test_run_folders_stay_inside_run_dir(tmp_path):
    from varuna_sdk.runner import prepare_run
    job = JobConfig(name="../escape")
    job.train.run_dir = str(tmp_path / "runs")
    with pytest.raises(ConfigError, match="name='../escape'"):
        prepare_run(job)
    assert not (tmp_path / "escape").exists() and not list(Path(tmp_path).glob("escape*"))


TINY = "model: {preset: tiny}\ndata: {tokenizer: byte, seq_len: 16}\ntrain: {steps: 1, eval_batches: 1}\n"


@pytest.mark.parametrize("text,pattern", [
    ("", r"is empty; start from `varuna config > job.yaml`"),
    (TINY + "train: {steps: 3}\n", r"line 4: key 'train' appears twice \(first on line 3\)"),
    ("model: {preset: null, factory: 'os:system', kwargs: {command: 'touch {marker}'}}\n",
     r"'os:system' names the standard library module 'os'"),
    ("model: {preset: null, factory: 'subprocess:run', kwargs: {args: ['touch', '{marker}']}}\n",
     r"names the standard library module 'subprocess'"),
    (TINY.replace("steps: 1", "steps: 1, run_dir: '{afile}'"), r"cannot create the run folder .*afile is a file"),
    (TINY.replace("steps: 1", "steps: 1, run_dir: /proc/varuna-nope"), r"cannot create the run folder /proc/varuna-nope"),
    (TINY.replace("steps: 1", "steps: 1, checkpoint_url: 'ftp://nonexistent.invalid/x'"),
     r"train.checkpoint_url='ftp://nonexistent.invalid/x' cannot be opened from here"),
])
def test_found_by_a_breaker_each_is_one_line_before_any_work(tmp_path, capsys, monkeypatch, text, pattern):
    """Inputs a fresh helper found to run code, write tracebacks or train the wrong job."""
    import re
    monkeypatch.chdir(tmp_path)
    marker, afile = tmp_path / "PWNED", tmp_path / "afile"
    afile.write_text("a file")
    f = tmp_path / "job.yaml"
    f.write_text(text.replace("{marker}", str(marker)).replace("{afile}", str(afile)))
    assert cli.main(["train", str(f)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("varuna: ") and "Traceback" not in err and re.search(pattern, err), err
    assert not marker.exists(), "a config ran a command"
    assert not (tmp_path / "runs").exists()     # no run folder: nothing started


def test_plan_refuses_more_gpus_than_it_searches(capsys):
    assert cli.main(["plan", "--gpus", "1000000000"]) == 2
    assert "--gpus 1000000000 is more than the planner searches (4096)" in capsys.readouterr().err
