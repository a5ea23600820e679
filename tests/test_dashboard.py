"""The team dashboard (``dashboard/``, issue 6 item 2), end to end in a real browser.

A stand-in job (``tests/dashboard_writer.py``, its own process, the real ``EventLog`` writer and
the real planner/simulator) appends events, heartbeats and one metrics row per step; the
dashboard is served by ``varuna dashboard RUN --port N`` in another process (login from
``VARUNA_DASHBOARD_PASSWORD``); Debian's chromium driven by playwright signs in and checks the
views against the log: VMs in the pool, P x D cells in the partition map, the throughput chart
gaining points, a pre-empted host in the pool and its morph in the morph table. Unauthenticated
access is refused over raw HTTP (page and websocket) and in the browser. Screenshots go to
``test-artifacts/dashboard/``.

A real job (the manager with 2 local gloo workers, tiny GPT-2, 10 steps) is run too, and the
dashboard over its event log is compared with the log and loaded in the browser.

Also, without a browser: the display downsampling against a brute-force reference, the store's
folding of the event-log contract and its incremental reads, bounded chart sources with many
points, and credentials handling. Every wait is bounded; the file takes ~30 s on 2 cores (~25 s busy).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import queue
import re
import secrets
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from varuna_sdk.manager.events import EventLog, Kind

sys.path.insert(0, str(Path(__file__).resolve().parent))  # dashboard_writer

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = ROOT / "test-artifacts" / "dashboard"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
USER = "team"

pytestmark = [pytest.mark.timeout(120),
              # bokeh 3.9 calls DataFrame.reset_index(inplace=True) for Tabulator data (pandas 3.1 warns)
              pytest.mark.filterwarnings("ignore:The inplace keyword in DataFrame.reset_index")]


# ------------------------------------------------------------------------------ processes
class Proc:
    """A child process whose stdout lines are read by a thread (so every wait can be bounded)."""

    def __init__(self, argv: list[str], env: dict | None = None, stdin: bool = False):
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.p.stdout:
            self.output.append(line)
            self.lines.put(line.rstrip("\n"))

    def expect(self, pattern: str, timeout_s: float) -> str:
        """The next stdout line matching ``pattern`` (regex), within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or self.p.poll() is not None and self.lines.empty():
                raise AssertionError(f"no line matching {pattern!r} within {timeout_s} s; output:\n"
                                     + "".join(self.output[-30:]))
            try:
                line = self.lines.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if re.search(pattern, line):
                return line

    def send(self, text: str) -> None:
        self.p.stdin.write(text + "\n")
        self.p.stdin.flush()

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(5)


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/login")
            if c.getresponse().status == 200:
                return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"dashboard did not answer on port {port} within {timeout_s} s")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The stand-in job writing ``RUN/events.db`` (4 VMs, P=2 x D=2) every 0.25 s."""
    run = tmp_path_factory.mktemp("dashjob")
    w = Proc([sys.executable, str(ROOT / "tests" / "dashboard_writer.py"), str(run), "--interval", "0.25",
              "--max-s", "150"], env=_env(), stdin=True)
    try:
        w.expect(r"^ok started gen=0 P=2 D=2", 60)
        yield run, w
    finally:
        try:
            w.send("quit")
        except OSError:
            pass
        w.stop()


@pytest.fixture(scope="module")
def server(job):
    """``varuna dashboard RUN --port N`` in its own process; yields (url, password, process)."""
    run, _ = job
    port = _free_port()
    password = secrets.token_urlsafe(16)
    env = _env()
    env["VARUNA_DASHBOARD_PASSWORD"] = password
    env["VARUNA_DASHBOARD_USER"] = USER
    srv = Proc([sys.executable, "-m", "varuna_sdk.cli", "dashboard", str(run), "--port", str(port),
                "--refresh", "0.5"], env=env)
    try:
        line = srv.expect(r"dashboard of .* at http://", 60)
        assert f"http://localhost:{port}/" in line, line
        _wait_http(port, 30)
        yield f"http://127.0.0.1:{port}", password, srv
    finally:
        srv.stop()
        # the password never reaches the server's output (stdout and stderr, logs included)
        assert password not in "".join(srv.output)


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing: install Debian's chromium (apt-get install -y chromium) for the "
                    "browser tests")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright (Python) is not installed")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, timeout=30_000)
        try:
            yield b
        finally:
            b.close()


# JS: number of rows of a named ColumnDataSource (-1 while the document is not there yet)
_ROWS = """([name, col]) => {
  if (!window.Bokeh || !Bokeh.documents) return -1;
  for (const d of Bokeh.documents) {
    const m = d.get_model_by_name(name);
    if (m) { const data = m.data instanceof Map ? m.data : new Map(Object.entries(m.data));
             const c = data.get(col); return c ? c.length : -1; }
  }
  return -1; }"""
_MAX = _ROWS.replace("return c ? c.length : -1;", "return c && c.length ? Math.max(...Array.from(c)) : -1;")


@contextlib.contextmanager
def _signed_in(browser, source, width: int = 1400, height: int = 900):
    """A page signed in to ``dashboard.server.serve(source)`` (its own server on a free port),
    closed with its server afterwards."""
    from dashboard.server import Credentials, serve

    password = secrets.token_urlsafe(12)
    port = _free_port()
    srv = serve(source, credentials=Credentials({USER: password}), port=port, threaded=True)
    ctx = browser.new_context(viewport={"width": width, "height": height})
    try:
        _wait_http(port, 20)
        page = ctx.new_page()
        _login(page, f"http://127.0.0.1:{port}", password)
        yield page
    finally:
        ctx.close()
        srv.stop()


def _rows(page, name: str, col: str) -> int:
    return page.evaluate(_ROWS, [name, col])


def _login(page, url: str, password: str, user: str = USER) -> None:
    page.goto(url + "/", timeout=30_000)
    assert "/login" in page.url
    page.fill("#username", user)
    page.fill("#password", password)
    page.click("#submit")


# ------------------------------------------------------------------------------ auth
def test_unauthenticated_http_refused(server):
    url, password, _ = server
    port = int(url.rsplit(":", 1)[1])
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", "/")
    r = c.getresponse()
    body = r.read().decode(errors="replace")
    assert r.status in (302, 303), (r.status, body[:200])
    assert re.match(r"^(\./|/)login", r.getheader("Location", ""))
    assert "docs_json" not in body and "Bokeh" not in body  # no document is handed out
    # the websocket that carries the document is refused without the login cookie
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", "/ws", headers={"Upgrade": "websocket", "Connection": "Upgrade",
                                     "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==", "Sec-WebSocket-Version": "13",
                                     "Origin": f"http://127.0.0.1:{port}"})
    r = c.getresponse()
    assert r.status != 101 and r.status >= 300, r.status
    # a wrong password gets no cookie, after a delay
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    t0 = time.monotonic()
    c.request("POST", "/login", body=f"username={USER}&password=wrong-{password[:4]}",
              headers={"Content-Type": "application/x-www-form-urlencoded"})
    r = c.getresponse()
    r.read()
    assert time.monotonic() - t0 >= 0.9
    assert r.status in (302, 303) and "error=" in r.getheader("Location", "")
    assert "user=" not in (r.getheader("Set-Cookie") or "")
    # the right password gets the signed cookie, and with it the page
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("POST", "/login", body=f"username={USER}&password={password}",
              headers={"Content-Type": "application/x-www-form-urlencoded"})
    r = c.getresponse()
    r.read()
    cookies = [v.split(";")[0] for k, v in r.getheaders() if k.lower() == "set-cookie"]
    assert any(ck.startswith("user=") for ck in cookies), cookies
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    c.request("GET", "/", headers={"Cookie": "; ".join(cookies)})
    r = c.getresponse()
    assert r.status == 200 and "Bokeh" in r.read().decode(errors="replace")


def test_browser_without_login_is_refused(server, browser):
    url, password, _ = server
    ctx = browser.new_context(viewport={"width": 1400, "height": 900})
    try:
        page = ctx.new_page()
        page.goto(url + "/", timeout=30_000)
        assert "/login" in page.url
        page.wait_for_selector("#login", timeout=10_000)
        assert page.evaluate("() => !!(window.Bokeh && Bokeh.documents && Bokeh.documents.length)") is False
        page.fill("#username", USER)
        page.fill("#password", "not-the-password")
        page.click("#submit")
        page.wait_for_selector("#error", timeout=15_000)
        assert "Invalid" in page.inner_text("#error")
        page.screenshot(path=str(ARTIFACTS / "login_refused.png"))
    finally:
        ctx.close()


# ------------------------------------------------------------------------------ live views
def test_dashboard_live_in_browser(job, server, browser):
    run, writer = job
    url, password, _ = server
    ctx = browser.new_context(viewport={"width": 1400, "height": 1750})
    try:
        page = ctx.new_page()
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        _login(page, url, password)
        # the partition map draws P x D = 2 x 2 cells; the pool shows the 4 VMs, all up
        page.wait_for_function(f"() => ({_ROWS})(['partition_cells', 'rank']) === 4", timeout=30_000)
        pool = page.locator(".vm")
        pool.first.wait_for(timeout=10_000)
        assert pool.count() == 4
        assert page.locator('.vm[data-status="up"]').count() == 4
        assert page.locator('[data-state="RUNNING"]').count() == 1
        with EventLog.reader(run / "events.db") as log:
            plan = log.events(kind=Kind.PLAN)[-1].payload
            assert sorted(page.evaluate(_ROWS.replace("return c ? c.length : -1;", "return Array.from(c);"),
                                        ["partition_cells", "host"])) == sorted(plan["hosts"])
        # the simulator table lists the plan's ranked rows; the running one is marked
        page.get_by_text("▶ running").first.wait_for(timeout=10_000)
        # the throughput chart gains points while the writer appends
        first = page.evaluate(_MAX, ["throughput", "step"])
        assert first >= 0
        page.wait_for_function(f"() => ({_MAX})(['throughput', 'step']) >= {first + 4}", timeout=20_000)
        with EventLog.reader(run / "events.db") as log:
            assert log.count("metrics") >= first + 4
        page.screenshot(path=str(ARTIFACTS / "dashboard_running.png"))

        # a pre-emption: the host leaves the pool, the job morphs to P=3 x D=1
        writer.send("preempt spot-vm-3")
        writer.expect(r"^ok preempt spot-vm-3 gen=1 P=3 D=1", 30)
        page.wait_for_selector('.vm[data-vm="spot-vm-3"][data-status="pre-empted"]', timeout=20_000)
        assert page.locator('.vm[data-status="up"]').count() == 3
        page.wait_for_function(f"() => ({_ROWS})(['partition_cells', 'rank']) === 3", timeout=20_000)
        morph = page.get_by_text("P=2×D=2 (mbs 4, m 2) → P=3×D=1 (mbs 4, m 4)")
        morph.first.wait_for(timeout=20_000)
        assert page.get_by_text("notice", exact=True).count() >= 1
        assert _rows(page, "morph_marks", "x") == 1
        labels = page.evaluate(_ROWS.replace("return c ? c.length : -1;", "return Array.from(c);"),
                               ["morph_marks", "label"])
        assert labels == ["pre-emption notice"], labels   # the marker says what happened there
        time.sleep(1.5)  # one more refresh, so the screenshot shows the new generation's points
        page.screenshot(path=str(ARTIFACTS / "dashboard_after_morph.png"))
        assert not errors, errors
    finally:
        ctx.close()


# ------------------------------------------------------------------------------ a real job
@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    """A real job: the manager, 2 local gloo worker processes with heartbeats, tiny GPT-2 on bytes,
    P=2 x D=1, 10 steps. The planner gets a synthetic profile of the model's 4 segments (a
    calibration would take ~1 minute here; what the dashboard reads does not depend on it)."""
    from dashboard_writer import profile

    from varuna_sdk.cluster.provider import LocalProvider
    from varuna_sdk.config import DataConfig, JobConfig, LaunchConfig, ModelConfig, ParallelConfig, TrainConfig
    from varuna_sdk.manager.manager import Manager
    from varuna_sdk.manager.state import JobState

    run = tmp_path_factory.mktemp("realjob")
    cfg = JobConfig(name="dash-real", model=ModelConfig(preset="tiny"), data=DataConfig(tokenizer="byte", seq_len=64),
                    parallel=ParallelConfig(P=2, D=1, global_batch=4, micro_batch_size=1),
                    train=TrainConfig(steps=10, eval_batches=1), launch=LaunchConfig(gpus=2))
    cfg.to_yaml(run / "config.yaml")
    provider = LocalProvider(2)
    mgr = Manager(cfg, provider, run_dir=run, profile=profile([1.0, 2.0, 2.0, 3.0]))
    try:
        mgr.start()
        state = mgr.wait(timeout_s=100)
        if state != JobState.SUCCEEDED:
            mgr.cancel()
            mgr.wait(20)
        assert state == JobState.SUCCEEDED, (state, mgr.error)
    finally:
        provider.close()
    return run


def test_dashboard_reads_at_every_width(job, server, browser):
    """Two cards side by side on a laptop, one column below ~1000 px; at 1400, 1024, 800 and 400 px
    nothing is wider than the window (no clipped chart or table needs a sideways scroll of the page)
    and no card's title overlaps another card. Screenshots: test-artifacts/dashboard/width_<px>.png."""
    url, password, _ = server
    ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
    try:
        page = ctx.new_page()
        _login(page, url, password)
        page.locator(".vm").first.wait_for(timeout=60_000)
        page.wait_for_function(f"() => ({_ROWS})(['partition_cells', 'rank']) > 0", timeout=30_000)
        for width in (1400, 1024, 800, 400):
            page.set_viewport_size({"width": width, "height": 1000})
            deadline = time.time() + 10   # the layout settles (charts re-measure after a resize)
            while (problems := _layout_problems(page, width)) and time.time() < deadline:
                time.sleep(0.2)
            assert not problems, (width, problems)
            page.screenshot(path=str(ARTIFACTS / f"width_{width}.png"), full_page=True)
    finally:
        ctx.close()


def _layout_problems(page, width: int) -> list:
    """What is wrong with the layout at ``width`` ([] when nothing): cards side by side iff the
    window is at least ~1000 px; titles apart; no sideways scroll."""
    boxes = {t: page.locator("h3", has_text=t).first.bounding_box() for t in
             ("VM pool", "Partition map", "Throughput", "Loss", "Simulator estimates", "Recent events")}
    if not all(boxes.values()):
        return [("a card title is not shown", boxes)]
    problems = []
    if (abs(boxes["VM pool"]["y"] - boxes["Partition map"]["y"]) < 5) is not (width >= 1000):
        problems.append(("VM pool / Partition map side by side iff >= 1000 px", boxes))
    if (abs(boxes["Throughput"]["y"] - boxes["Loss"]["y"]) < 5) is not (width >= 1000):
        problems.append(("Throughput / Loss side by side iff >= 1000 px", boxes))
    for a, b in (("VM pool", "Partition map"), ("Throughput", "Loss")):   # titles never overlap
        A, B = boxes[a], boxes[b]
        apart = A["x"] + A["width"] <= B["x"] or B["x"] + B["width"] <= A["x"] or \
            A["y"] + A["height"] <= B["y"] or B["y"] + B["height"] <= A["y"]
        if not apart:
            problems.append(("titles overlap", a, A, b, B))
    overflow = page.evaluate("() => document.documentElement.scrollWidth - window.innerWidth")
    if overflow > 2:
        problems.append(f"the page is {overflow} px wider than a {width} px window")
    return problems


def test_closed_tabs_leave_no_traceback_in_the_server_output(server):
    """After the browser tabs above were opened and closed, the server has printed no traceback
    (Tornado's "stream closed" / websocket errors when a tab goes away)."""
    _, _, srv = server
    time.sleep(2.0)   # the last tab's websocket is torn down
    out = "".join(srv.output)
    assert "Traceback" not in out and "ERROR" not in out, out[-3000:]


def test_real_job_event_log(real_run, browser):
    """The dashboard over the event log a real job wrote: the views match the log."""
    from dashboard.app import Dashboard
    from dashboard.store import TelemetryStore

    with EventLog.reader(real_run / "events.db") as log:
        plan = log.events(kind=Kind.PLAN)[-1].payload
        metrics = log.metrics()
    dash = Dashboard(TelemetryStore(real_run))
    P, D = plan["P"], plan["D"]
    assert (P, D) == (2, 1) and len(dash.cells.data["rank"]) == P * D
    assert dash.cells.data["host"] == plan["hosts"]
    assert set(dash.store.vms) == set(plan["hosts"])
    assert list(dash.tput.data["step"]) == [m["step"] for m in metrics] and len(metrics) == 10
    assert list(dash.loss.data["value"]) == pytest.approx([m["loss"] for m in metrics])
    n_tl = sum(len(src.data["left"]) for src in dash.gantt_src.values())
    assert n_tl == len(plan["timeline"]) > 0
    assert [y for y in dash.stage_src.data["y"] if y.endswith("measured")] == ["stage 0 · measured",
                                                                               "stage 1 · measured"]
    assert 'data-state="SUCCEEDED"' in dash.header.object
    dash.store.close()
    # and served, in the browser
    with _signed_in(browser, real_run, height=1900) as page:
        page.locator(".vm").first.wait_for(timeout=60_000)  # first render: 30 s was missed on a loaded 2-core box
        page.wait_for_function(f"() => ({_ROWS})(['partition_cells', 'rank']) === {P * D}", timeout=30_000)
        page.wait_for_function(f"() => ({_ROWS})(['throughput', 'step']) === {len(metrics)}", timeout=10_000)
        assert page.locator('.vm[data-status="up"]').count() == len(plan["hosts"])
        page.wait_for_timeout(500)
        page.screenshot(path=str(ARTIFACTS / "real_job.png"))


# ------------------------------------------------------------------------------ no browser
def test_minmax_indices_keep_extremes():
    from dashboard.store import minmax_indices

    rng = np.random.default_rng(0)
    y = rng.normal(size=10_007)
    y[5_000] = 50.0  # a spike a stride would likely miss
    y[7_777] = -50.0
    y[100:130] = np.nan
    idx = minmax_indices(y, 400)
    assert len(idx) <= 400 and idx[0] == 0 and idx[-1] == len(y) - 1
    assert np.all(np.diff(idx) > 0)
    assert 5_000 in idx and 7_777 in idx
    # reference: every bucket's nan-min and nan-max are among the picks
    buckets = (400 - 2) // 2
    edges = np.linspace(0, len(y), buckets + 1).astype(int)
    picked = set(idx.tolist())
    for a, b in zip(edges[:-1], edges[1:]):
        seg = y[a:b]
        if np.isnan(seg).all():
            continue
        assert a + int(np.nanargmin(seg)) in picked and a + int(np.nanargmax(seg)) in picked
    assert list(minmax_indices(y[:300], 400)) == list(range(300))
    with pytest.raises(ValueError, match="max_points"):
        minmax_indices(y, 2)


def test_store_folds_the_event_contract(tmp_path):
    from dashboard.store import TelemetryStore, resolve_event_log

    with pytest.raises(FileNotFoundError, match="events.db"):
        resolve_event_log(tmp_path)
    log = EventLog(tmp_path / "events.db")
    for h in ("a", "b", "c"):
        log.append(Kind.HOST_ADDED, host=h, payload={"gpus": 2, "price_per_hour": 1.5})
    log.append(Kind.PLAN, payload={"generation": 0, "P": 3, "D": 1, "hosts": ["a", "b", "c"],
                                   "predicted_step_s": 0.5, "num_micro_batches": 4})
    store = TelemetryStore(tmp_path)
    assert store.refresh(force=True)
    assert [v.status for v in store.vms.values()] == ["up"] * 3 and store.vms["a"].gpus == 2
    assert store.ranks_of("b") == [(1, 1, 0)]
    assert not store.refresh(force=True)  # nothing new: nothing re-read
    log.append(Kind.PREEMPTION_NOTICE, host="b", payload={"deadline": 123.0, "lead_s": 30})
    log.append(Kind.STRAGGLER, rank=2, payload={"rank": 2, "slowdown": 1.9, "action": "kept"})
    for s in range(10):
        log.append_metric(s, {"step": s, "loss": 5.0 - s * 0.1, "step_time_s": 0.5 + 0.01 * s, "generation": 0})
        log.append_heartbeat({"step": s, "fwd_s": 0.01, "bwd_s": 0.02, "recompute_s": 0.011, "micro_batches": 4,
                              "step_time_s": 0.5, "wait_s": 0.03}, host="a", rank=0)
    assert store.refresh(force=True)
    assert store.vms["b"].status == "notice" and store.vms["b"].notice_deadline == 123.0
    assert store.vms["c"].straggler["slowdown"] == 1.9  # rank 2 -> host c through the plan
    assert len(store.metrics) == 10
    # measured step time: median of the generation's steps after the 2 warm-up steps
    assert store.measured_step_s() == pytest.approx(float(np.median([0.5 + 0.01 * s for s in range(2, 10)])))
    assert store.stage_compute()[0] == {"F": pytest.approx(0.04), "R": pytest.approx(0.044),
                                        "B": pytest.approx(0.08), "wait": 0.03, "step": 0.5, "ranks": 1}
    log.append(Kind.HOST_REMOVED, host="b", payload={"reason": "preempted"})
    log.append(Kind.HOST_LOST, host="c", payload={"reason": "heartbeats stopped"})
    log.append(Kind.PLAN, payload={"generation": 1, "P": 1, "D": 1, "hosts": ["a"]})
    for s in range(10, 15):
        log.append_metric(s, {"step": s, "loss": 4.0, "generation": 1})
    store.refresh(force=True)
    assert store.vm_counts() == {"up": 1, "notice": 0, "pre-empted": 1, "lost": 1, "released": 0, "stragglers": 1}
    assert store.generation_spans() == {0: (0.0, 9.0), 1: (10.0, 14.0)}
    log.append(Kind.HOST_ADDED, host="b")  # the cloud gives it back
    store.refresh(force=True)
    assert store.vms["b"].status == "up"
    from dashboard.views import pool_html

    assert "4 GPUs up" in pool_html(store) and "CPU-only" not in pool_html(store)
    log.append(Kind.HOST_ADDED, host="d", payload={"gpus": 0})   # a CPU-only VM: one worker, no GPU
    store.refresh(force=True)
    assert "4 GPUs up · 1 CPU-only VM (one worker each)" in pool_html(store), pool_html(store)
    log.close()
    store.close()


def test_chart_sources_stay_bounded(tmp_path):
    """Thousands of steps are drawn as at most 2 x max_points points; new rows are streamed."""
    from dashboard.app import Dashboard
    from dashboard.store import TelemetryStore

    log = EventLog(tmp_path / "events.db")
    for s in range(12_000):
        log.append_metric(s, {"step": s, "loss": 3.0 + (s == 6000) * 5, "examples_per_s": 20.0, "generation": 0},
                          time_s=1e9 + s)
    dash = Dashboard(TelemetryStore(tmp_path, min_interval_s=0), max_points=500)
    step = np.asarray(dash.tput.data["step"])
    assert len(step) <= 500 and step[0] == 0 and step[-1] == 11_999
    assert 8.0 in list(dash.loss.data["value"])  # the loss spike survives downsampling
    for s in range(12_000, 12_600):
        log.append_metric(s, {"step": s, "loss": 3.0, "examples_per_s": 21.0, "generation": 0})
        if s % 100 == 0:
            dash.update()
    dash.update()
    n = len(dash.tput.data["step"])
    assert n <= 1000 and dash.tput.data["step"][-1] == 12_599
    log.close()
    dash.store.close()


def test_credentials(tmp_path):
    from dashboard.server import Credentials, load_credentials

    c = Credentials({"ann": "correct horse battery"})
    assert c.check("ann", "correct horse battery")
    assert not c.check("ann", "correct horse batterY") and not c.check("bob", "correct horse battery")
    assert "correct" not in repr(c) and "correct" not in str(c)
    for weak in ("short", "aaaaaaaaaaaaaaaa", "abababab1212"):   # too short; too few different characters
        with pytest.raises(ValueError, match="too weak: use at least 12 characters with at least 6 different"):
            Credentials({"ann": weak})
    f = tmp_path / "users.json"
    f.write_text(json.dumps({"ann": "correct horse battery"}))
    f.chmod(0o644)
    with pytest.raises(PermissionError, match="chmod 600"):
        Credentials.from_file(f)
    f.chmod(0o600)
    assert Credentials.from_file(f).check("ann", "correct horse battery")
    run = tmp_path / "run"
    EventLog(run / "events.db").close()
    c1, where = load_credentials(run, env={})
    made = run / "dashboard-credentials.json"
    assert str(made) in where and stat.S_IMODE(made.stat().st_mode) == 0o600
    pw = json.loads(made.read_text())["varuna"]
    assert pw not in where and c1.check("varuna", pw)
    c2, _ = load_credentials(run, env={})  # the second start reuses the file
    assert c2.check("varuna", pw)
    c3, where = load_credentials(run, env={"VARUNA_DASHBOARD_PASSWORD": "from-the-env-123"})
    assert c3.check("varuna", "from-the-env-123") and "from-the-env-123" not in where


def test_text_from_the_log_is_escaped(tmp_path):
    """Host names, reasons and states come from the log: they are shown as text, never as HTML."""
    from dashboard.app import Dashboard
    from dashboard.store import TelemetryStore

    evil = '<img src=x onerror="alert(1)">'
    with EventLog(tmp_path / "events.db") as log:
        log.append(Kind.HOST_ADDED, host=evil, payload={"gpus": 1, "labels": {"instance_type": evil}})
        log.append(Kind.JOB_STATE, payload={"state": evil, "reason": evil})
        log.append(Kind.HOST_REMOVED, host=evil, payload={"reason": evil})
    dash = Dashboard(TelemetryStore(tmp_path))
    for html_ in (dash.pool.object, dash.header.object):
        assert "<img" not in html_ and "&lt;img src=x onerror=&quot;alert(1)&quot;&gt;" in html_
    dash.store.close()


def test_malformed_payloads_do_not_break_the_views(tmp_path):
    """Payloads are the writer's contract, but a wrong one must not take the dashboard down."""
    from dashboard.app import Dashboard
    from dashboard.store import TelemetryStore

    with EventLog(tmp_path / "events.db") as log:
        log.append(Kind.PLAN, payload={"generation": "x", "P": "two", "D": None, "boundaries": 3, "rows": [1, None],
                                       "timeline": "nope", "hosts": {"a": 1}, "mem_per_stage_bytes": ["?"]})
        log.append(Kind.MORPH, payload={"cause": None, "old": None, "new": 5, "from_step": "7"})
        log.append(Kind.STRAGGLER, payload={"rank": "r"})
        log.append(Kind.PREEMPTION_NOTICE, host="h", payload={"deadline": "soon"})
        log.append_metric(0, {"loss": "nan?", "examples_per_s": None, "generation": "g"})
        log.append_heartbeat({"step": "s", "fwd_s": "x"}, host="h", rank=0)
        dash = Dashboard(TelemetryStore(tmp_path, min_interval_s=0))
        assert dash._failed == set()
        assert len(dash.cells.data["rank"]) == 0 and dash.store.vms["h"].status == "notice"
        assert "no morph yet" not in dash.morph_table.value.to_string()  # the morph row is shown
        log.append(Kind.PLAN, payload={"generation": 1, "P": 1, "D": 1, "hosts": ["h"]})
        log.append_metric(1, {"loss": 2.0, "examples_per_s": 3.0, "generation": 1})
        dash.update()
        assert len(dash.cells.data["rank"]) == 1 and dash._failed == set()
        dash.store.close()


@pytest.mark.timeout(240)
def test_live_real_job_morph_in_browser(tmp_path, browser):
    """The served dashboard against a RUNNING job under the real manager (local workers on the
    spot emulator): the VM pool shows the 3 VMs, the partition map draws the plan's P x D cells,
    the throughput chart gains points, then a VM in use is pre-empted with a notice: the pool
    shows it pre-empted and the morph table gains the notice morph — all read live from the
    job's event log. (Synthetic profile for the planner, as above: a calibration takes ~1 min.)"""
    from dashboard.server import Credentials, serve
    from dashboard_writer import profile

    from varuna_sdk.cluster.spot import SpotEmulator
    from varuna_sdk.config import DataConfig, JobConfig, LaunchConfig, ModelConfig, ParallelConfig, TrainConfig
    from varuna_sdk.manager.manager import Manager

    run = tmp_path / "run"
    cfg = JobConfig(name="dash-live", model=ModelConfig(preset="tiny", n_layer=2), data=DataConfig(tokenizer="byte", seq_len=64),
                    parallel=ParallelConfig(P=None, D=None, global_batch=12, micro_batch_size=1),
                    train=TrainConfig(steps=100000, eval_batches=1, checkpoint_every=20), launch=LaunchConfig(gpus=3))
    emu = SpotEmulator(capacity=3, backend="local", notice_s=None).start()
    mgr = Manager(cfg, emu, run_dir=run, profile=profile([1.0, 2.0, 2.0, 3.0]), heartbeat_interval_s=1.0,
                  grow=None, straggler=None, generation_options={"sink": None})
    password = secrets.token_urlsafe(12)
    port = _free_port()
    srv = None
    ctx = browser.new_context(viewport={"width": 1400, "height": 1900})
    try:
        mgr.start()
        deadline = time.time() + 60
        while not (run / "events.db").exists() and time.time() < deadline:
            time.sleep(0.2)
        srv = serve(run, credentials=Credentials({USER: password}), port=port, threaded=True)
        _wait_http(port, 20)
        page = ctx.new_page()
        _login(page, f"http://127.0.0.1:{port}", password)
        page.locator(".vm").nth(2).wait_for(timeout=60_000)     # (locators pierce Panel's shadow DOM)
        assert page.locator(".vm").count() == 3 and page.locator('.vm[data-status="up"]').count() == 3
        with EventLog.reader(run / "events.db") as log:
            plan = log.events(kind=Kind.PLAN)[-1].payload
        page.wait_for_function(f"() => ({_ROWS})(['partition_cells', 'rank']) === {plan['P'] * plan['D']}",
                               timeout=30_000)
        page.wait_for_function(f"() => ({_MAX})(['throughput', 'step']) >= 3", timeout=90_000)
        header = page.locator(".hdr").first.inner_text()
        assert "free (local)" in header and "/ 100,000 (" in header and "ETA" in header, header
        first = page.evaluate(_MAX, ["throughput", "step"])
        page.wait_for_function(f"() => ({_MAX})(['throughput', 'step']) >= {first + 3}", timeout=60_000)
        page.screenshot(path=str(ARTIFACTS / "live_job_running.png"))
        victim = plan["hosts"][-1]
        emu.remove_now(victim, notice_s=3.0)
        page.wait_for_selector(f'.vm[data-vm="{victim}"][data-status="pre-empted"]', timeout=60_000)
        deadline, morphs = time.time() + 90, []
        while not morphs and time.time() < deadline:   # recorded once the new plan's first step is done
            time.sleep(0.5)
            with EventLog.reader(run / "events.db") as log:
                morphs = log.events(kind=Kind.MORPH)
        assert morphs and morphs[0].payload["cause"] == "notice" and morphs[0].host == victim
        page.locator(".tabulator-cell", has_text="→").first.wait_for(timeout=30_000)   # old → new plan row
        assert page.locator(".tabulator-cell", has_text="notice").count() >= 1
        time.sleep(1.5)
        page.screenshot(path=str(ARTIFACTS / "live_job_after_morph.png"))
    except BaseException:
        for pg in ctx.pages:
            pg.screenshot(path=str(ARTIFACTS / "live_job_FAILED.png"))
        raise
    finally:
        ctx.close()
        if srv is not None:
            srv.stop()
        mgr.cancel()
        mgr.wait(60)
        emu.close()


def test_jobs_table_of_a_folder_of_runs_in_browser(tmp_path, browser):
    """``varuna dashboard RUNS`` over a folder of three runs: the jobs page lists each (state, step of
    the total with its percentage, ETA for the running one, morphs), a job's name opens its own
    dashboard, and a name that is not a run folder inside (``..``) shows nothing of the disk."""
    from dashboard_writer import write_run

    root = tmp_path / "runs"
    write_run(root, "alpha", "SUCCEEDED", 40, 40)
    write_run(root, "beta", "RUNNING", 30, 120, morph=True)
    write_run(root, "gamma", "FAILED", 5, 50)
    with _signed_in(browser, root) as page:
        page.locator("tr[data-job]").nth(2).wait_for(timeout=30_000)
        rows = {r.get_attribute("data-job"): r.inner_text() for r in page.locator("tr[data-job]").all()}
        assert set(rows) == {"alpha", "beta", "gamma"}, rows
        assert "SUCCEEDED" in rows["alpha"] and "40/40 (100 %)" in rows["alpha"]
        assert "RUNNING" in rows["beta"] and "30/120 (25 %)" in rows["beta"] and "45 s" in rows["beta"], rows["beta"]
        assert "FAILED" in rows["gamma"] and "5/50 (10 %)" in rows["gamma"]
        page.screenshot(path=str(ARTIFACTS / "jobs_table.png"))
        page.click("text=beta")
        page.wait_for_url("**/job?run=beta", timeout=30_000)
        page.locator(".tabulator-cell", has_text="notice").first.wait_for(timeout=30_000)   # its morph table
        # ... explained in a sentence: the VM, what happened, the plans, downtime, what was lost
        said = page.locator(".tabulator-cell", has_text="VM vm1 got a pre-emption notice").first.inner_text()
        assert "P=2 x D=1 on vm0" in said and "6.5 s down" in said and "nothing lost" in said, said
        assert "fastest predicted of 4" in said and "P=1 x D=2 9.5 ex/s" in said, said   # why this plan
        assert "stop 1.5 s" in said and "first step 2.5 s" in said and "wait for VMs" not in said, said
        assert page.locator("text=all jobs").count() >= 1
        # the estimate that no longer holds, why it may be, and the re-calibrated one
        warn = page.locator("[data-drift]").first.inner_text()
        assert "25% slower than predicted 0.400 s" in warn and "load was 3.2 on 2 cores" in warn, warn
        assert "re-calibrated from the job's heartbeats: 0.490 s per step" in warn, warn
        # the workers' output, the newest generation first, escaped (the page shows "<ok>" as text)
        logs = page.locator("pre.logs").first
        logs.wait_for(timeout=30_000)
        assert "generation 1 step 29 <ok>" in logs.inner_text(), logs.inner_text()[-300:]
        page.screenshot(path=str(ARTIFACTS / "jobs_table_job_page.png"), full_page=True)
        page.goto(page.url.split("/job?")[0] + "/job?run=..", timeout=30_000)
        page.locator("text=No run named").wait_for(timeout=30_000)


def test_cost_so_far_from_the_providers_prices(tmp_path):
    """Billing runs from a VM's host_added to its host_removed at its $/h; the saving is against the
    same VM-hours at the on-demand price; local slots are free; example prices say so."""
    from dashboard.store import TelemetryStore

    t0 = 1_000_000.0
    prices = {"price_per_hour": "0.9", "on_demand_per_hour": "3.0", "prices": "example", "instance_type": "p3"}
    with EventLog(tmp_path / "events.db") as log:
        log.append(Kind.HOST_ADDED, host="vm0", payload={"labels": prices}, time_s=t0)
        log.append(Kind.HOST_ADDED, host="vm1", payload={"labels": prices}, time_s=t0)
        log.append(Kind.HOST_REMOVED, host="vm1", payload={"reason": "preempted"}, time_s=t0 + 1800)
        log.append(Kind.HOST_ADDED, host="vm1", payload={"labels": prices}, time_s=t0 + 3600)
    st = TelemetryStore(tmp_path / "events.db")
    st.refresh(force=True)
    c = st.cost(now=t0 + 7200)          # vm0: 2 h, vm1: 0.5 h + 1 h = 3.5 VM-hours
    assert c["spent"] == pytest.approx(3.5 * 0.9) and c["on_demand"] == pytest.approx(3.5 * 3.0)
    assert c["per_hour"] == pytest.approx(1.8) and c["example"] is True and c["local"] is False
    # the jobs table, `varuna status` and Job.list() bill the same run the same way (manager.billing)
    from varuna_sdk.manager.billing import cost_text
    from varuna_sdk.manager.runs import read_run

    assert read_run(tmp_path, now=t0 + 7200).cost == c
    assert cost_text(c, short=True) == "$3.15, -70%*"
    assert cost_text(c) == "$3.15 spent · $1.80/h · saves 70% vs on-demand (example prices)"
    with EventLog(tmp_path / "local.db") as log:
        log.append(Kind.HOST_ADDED, host="local0", payload={"labels": {"kind": "local"}}, time_s=t0)
    local = TelemetryStore(tmp_path / "local.db")
    local.refresh(force=True)
    assert local.cost() == {"local": True}


def test_a_drifted_estimate_is_flagged_from_the_metrics_when_no_manager_recalibrated(tmp_path):
    """A log with no estimate_drift event (a run without the manager's drift rule) still gets the
    warning from its own metrics; within 15 % it gets none. Measured waiting is its own part of
    the per-stage chart, not backward."""
    from dashboard.app import Dashboard
    from dashboard.store import TelemetryStore

    with EventLog(tmp_path / "events.db") as log:
        log.append(Kind.PLAN, payload={"generation": 0, "P": 2, "D": 1, "hosts": ["a", "b"], "predicted_step_s": 0.2,
                                       "num_micro_batches": 4})
        for s in range(10):
            log.append_metric(s, {"step": s, "loss": 3.0, "step_time_s": 0.3, "generation": 0})
            for r in (0, 1):
                log.append_heartbeat({"step": s, "fwd_s": 0.01, "bwd_s": 0.02, "recompute_s": 0.0, "wait_s": 0.05,
                                      "micro_batches": 4, "step_time_s": 0.3, "stage": r}, host="ab"[r], rank=r)
    dash = Dashboard(TelemetryStore(tmp_path))
    html_ = dash.compare.object
    assert "data-drift" in html_ and "50% slower than predicted 0.200 s for 5 steps" in html_, html_
    assert "no re-calibration recorded" in html_
    src = dash.stage_src.data
    i = src["y"].index("stage 1 · measured")
    assert src["wait"][i] == pytest.approx(0.05) and src["B"][i] == pytest.approx(0.08), src
    assert src["other"][i] == pytest.approx(0.3 - 0.04 - 0.08 - 0.05), src
    dash.store.close()
    with EventLog(tmp_path / "ok.db") as log:
        log.append(Kind.PLAN, payload={"generation": 0, "P": 1, "D": 1, "hosts": ["a"], "predicted_step_s": 0.28})
        for s in range(10):
            log.append_metric(s, {"step": s, "loss": 3.0, "step_time_s": 0.3, "generation": 0})
    dash = Dashboard(TelemetryStore(tmp_path / "ok.db"))
    assert "data-drift" not in dash.compare.object
    dash.store.close()


def test_the_smoothed_loss_continues_where_it_stopped():
    from dashboard.format import ema

    x = np.array([np.nan, 4.0, 3.0, np.nan, 2.0, 1.0, 1.5])
    full = ema(x, 5)
    assert np.isnan(full[0]) and full[1] == 4.0 and full[3] == full[2]     # a skipped step carries it on
    assert np.allclose(ema(x[4:], 5, start=full[3]), full[4:])            # streamed = drawn from history
    a = 2 / 6
    assert full[2] == pytest.approx(4.0 + a * (3.0 - 4.0))
