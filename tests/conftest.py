"""Shared fixtures: run a list of training jobs in one set of spawned gloo workers and load the
per-rank results (``torch.load(weights_only=True)``)."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Callable

import pytest
import torch

from varuna_sdk.pipeline.spawn import spawn_workers

_counter = itertools.count()


@pytest.fixture(autouse=True)
def _no_zygote_outlives_its_test():
    """A test that drives a ``Generation`` without a ``Manager`` leaves its run's zygote
    (``cluster.zygote``, ~300 MB) to the process's exit, since only the manager ends it: ended
    after every test instead."""
    yield
    from varuna_sdk.cluster.localproc import close_zygotes

    close_zygotes()


@pytest.fixture(scope="session", autouse=True)
def _own_cache_dir(tmp_path_factory):
    """Calibrations and tokenized corpora of this test session in a folder of its own (unless
    ``VARUNA_SDK_CACHE_DIR`` is set): a profile cached in ``~/.cache`` by an earlier run on a
    loaded machine made the planner predict, for every later run, that a second replica adds no
    speed, and the grow the spot-VM tests expect never came. Worker processes inherit it."""
    import os

    if os.environ.get("VARUNA_SDK_CACHE_DIR"):
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VARUNA_SDK_CACHE_DIR", str(tmp_path_factory.mktemp("varuna-cache")))
        yield


@pytest.fixture
def own_cache(tmp_path, monkeypatch) -> Path:
    """A cache folder of this test's own (``VARUNA_SDK_CACHE_DIR``): its models are calibrated
    afresh and its corpora tokenized afresh. The machine's network figures are the session's
    (``profiles/hosts`` links to the session cache's), as they are one machine's for every model:
    a calibration after the session's first runs only the model's own probes."""
    import os

    shared = Path(os.environ["VARUNA_SDK_CACHE_DIR"]) / "profiles" / "hosts"
    shared.mkdir(parents=True, exist_ok=True)
    mine = tmp_path / "cache"
    (mine / "profiles").mkdir(parents=True)
    (mine / "profiles" / "hosts").symlink_to(shared, target_is_directory=True)
    monkeypatch.setenv("VARUNA_SDK_CACHE_DIR", str(mine))
    return mine


@pytest.fixture(scope="session")
def run_suite(tmp_path_factory) -> Callable[..., dict]:
    """``run_suite(world, jobs, timeout_s=150) -> {job name: [result of rank 0, rank 1, ...]}``.

    Every job runs on the same ``world`` spawned processes, one after another (each job's
    P × D must equal ``world``), so the ~3 s torch import is paid once per world size.
    """
    from _workers import suite_worker

    def run(world: int, jobs: list[dict], timeout_s: float = 150.0) -> dict[str, list[dict]]:
        out = tmp_path_factory.mktemp(f"suite{world}_{next(_counter)}")
        for job in jobs:
            par = job["par"]
            assert par.get("P", 1) * par.get("D", 1) == world, job["name"]
        spawn_workers(suite_worker, world, args=(str(out), jobs), timeout_s=timeout_s, work_dir=out,
                      backend="gloo")
        return {job["name"]: [torch.load(Path(out) / f"{job['name']}.rank{r}.pt", weights_only=True)
                              for r in range(world)] for job in jobs}

    return run


@pytest.fixture
def ssh_hosts(request, tmp_path_factory):
    """``SSHDHosts`` (tests/ssh_hosts.py): real sshd "VMs" on loopback addresses; ``.add()`` a
    host, ``.remove(host)`` pre-empts it (kills its sshd and everything it started). Every host
    is removed by a finalizer, even when the test fails. Skips when sshd is not installed."""
    from ssh_hosts import test_hosts_fixture

    return test_hosts_fixture(request, tmp_path_factory)
