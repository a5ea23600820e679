"""Dashboard responsiveness: time to first render, update latency, and server CPU with 100k points.

Setup (everything real): the benchmark process is the job — it writes the event log through the
real ``EventLog`` writer (``tests/dashboard_writer.Job``: plans from the real planner, one metrics
row + one heartbeat per rank per step); ``varuna dashboard RUN`` serves it from its own process
(default 1 s refresh, login required); Debian's chromium, driven by playwright, is the viewer.

Figures, for a fresh job (~50 steps) and for one with ``--points`` (default 100,000) steps:
- **first render**: navigation (signed in) -> every view drawn: the partition map has its P x D
  cells, the VM pool its cards, the throughput / loss / timeline sources have data, and every
  Bokeh root view reports ``has_finished()``. Median of ``--renders`` navigations. The server
  reads the whole log when it starts (before listening); the first session after the login
  (``first_session_s`` in the JSON, from submitting the form) is reported apart.
- **update latency**: one metrics row appended (``time.time()`` before the write) -> the browser
  sees its step in the throughput chart's data source (a 10 ms in-page poll, ``Date.now()``).
  Median of ``--samples``, appends at random phases of the refresh period.
- **server CPU**: the server process's CPU time (``/proc/PID/stat``) over ``--cpu-window`` seconds
  with one browser session open on the 100k-step job, while the job appends 2 steps/s, and idle.

- **jobs table**: ``varuna dashboard ROOT`` over a folder of ``--runs`` (default 50) run folders
  (``tests/dashboard_writer.write_run``: config, states, a plan, 20-200 metric rows, morphs and an
  estimate warning on some, worker logs): navigation -> every job's row drawn. Median of
  ``--renders``; the server's first session after sign-in apart.

Targets (absolute, not ratios: what a user waits for): first render < 5 s, update < 2 s (the
refresh period is 1 s), CPU < 25 % of one core while streaming, jobs table of 50 runs < 3 s.
Ratio = value / target.

Run: ``.venv/bin/python benchmarks/bench_dashboard.py [--quick] [--points N]``. Needs
``/usr/bin/chromium`` and playwright; writes ``benchmarks/results/dashboard.json``.
"""

from __future__ import annotations

import os
import random
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tests"))
import common  # noqa: E402

common.setup_path()

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
USER = "bench"
TARGET_RENDER_S, TARGET_UPDATE_S, TARGET_CPU_PCT, TARGET_JOBS_S = 5.0, 2.0, 25.0, 3.0

# every view drawn (see the module doc); arg: [P*D, number of VMs]
ALL_DRAWN = """([cells, vms]) => {
  if (!window.Bokeh || !Bokeh.documents || !Bokeh.documents.length || !Bokeh.index) return false;
  const rows = (name) => { for (const d of Bokeh.documents) { const m = d.get_model_by_name(name);
      if (m) { const v = Object.values(m.data)[0]; return v ? v.length : 0; } } return -1; };
  if (rows('partition_cells') !== cells || rows('throughput') <= 0 || rows('loss') <= 0) return false;
  if (rows('timeline_F') <= 0 || rows('stage_compute') <= 0) return false;
  const roots = Bokeh.index.roots || [];
  if (!roots.length || !roots.every(v => v.has_finished())) return false;
  return true; }"""
# in-page poll of the throughput source: window.__seen[step] = Date.now() when a step first shows
WATCH = """() => { window.__seen = {}; setInterval(() => {
  for (const d of Bokeh.documents) { const m = d.get_model_by_name('throughput');
    if (!m) continue; const s = m.data.step; if (!s || !s.length) continue;
    const last = s[s.length - 1]; if (!(last in window.__seen)) window.__seen[last] = Date.now(); } }, 10); }"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Served:
    """``varuna dashboard RUN --port N`` in a subprocess (password from the environment)."""

    def __init__(self, run: Path):
        self.port = free_port()
        self.password = secrets.token_urlsafe(16)
        env = dict(os.environ, VARUNA_DASHBOARD_PASSWORD=self.password, VARUNA_DASHBOARD_USER=USER,
                   PYTHONPATH=str(ROOT))
        self.p = subprocess.Popen([sys.executable, "-m", "varuna_sdk.cli", "dashboard", str(run), "--port",
                                   str(self.port)], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if self.p.poll() is not None:
                    raise RuntimeError("dashboard server exited:\n" + self.p.stdout.read())
                time.sleep(0.2)
        raise RuntimeError("dashboard server did not start within 60 s")

    def stop(self) -> None:
        self.p.terminate()
        try:
            self.p.wait(10)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait(5)


def make_job(run: Path, prefill: int):
    """The stand-in job (tests/dashboard_writer.Job) with ``prefill`` back-dated steps + 20 live."""
    from dashboard_writer import Job
    from varuna_sdk.manager.events import EventLog

    run.mkdir(parents=True, exist_ok=True)
    (run / "config.yaml").write_text("name: gpt2-dashboard-bench\n")
    log = EventLog(run / "events.db")
    job = Job(log, [f"spot-vm-{i}" for i in range(4)])
    t0 = time.perf_counter()
    job.start(prefill)
    for _ in range(20):
        job.write_step()
    return job, log, time.perf_counter() - t0


def submit_login(page, url: str, password: str) -> float:
    """Open the sign-in form and submit it; returns ``time.perf_counter()`` at the submit."""
    page.goto(url + "/", timeout=60_000)
    page.fill("#username", USER)
    page.fill("#password", password)
    t0 = time.perf_counter()
    page.click("#submit")
    return t0


def login(ctx, url: str, password: str, cells: int, vms: int) -> float:
    """Sign in; seconds from submitting the form to every view drawn (the server's first session)."""
    page = ctx.new_page()
    try:
        t0 = submit_login(page, url, password)
        page.wait_for_function(ALL_DRAWN, arg=[cells, vms], timeout=60_000, polling=20)
        return time.perf_counter() - t0
    finally:
        page.close()


def first_render(ctx, url: str, cells: int, vms: int) -> tuple[float, int]:
    """Seconds from navigation to every view drawn; and the throughput points the browser got."""
    page = ctx.new_page()
    try:
        t0 = time.perf_counter()
        page.goto(url + "/", timeout=60_000)
        page.wait_for_function(ALL_DRAWN, arg=[cells, vms], timeout=60_000, polling=20)
        dt = time.perf_counter() - t0
        n = page.evaluate("() => { for (const d of Bokeh.documents) { const m = d.get_model_by_name('throughput');"
                          " if (m) return m.data.step.length; } return -1; }")
        assert page.locator(".vm").count() == vms
        return dt, n
    finally:
        page.close()


def update_latencies(ctx, url: str, job, samples: int, cells: int, vms: int) -> list[float]:
    """Seconds from appending a metrics row to its step showing in the browser's chart source."""
    page = ctx.new_page()
    try:
        page.goto(url + "/", timeout=60_000)
        page.wait_for_function(ALL_DRAWN, arg=[cells, vms], timeout=60_000, polling=20)
        page.evaluate(WATCH)
        rng = random.Random(1)
        out = []
        for _ in range(samples):
            time.sleep(rng.uniform(0.2, 1.3))  # random phase against the 1 s refresh
            step = job.step
            t_append = time.time()
            job.write_step()
            seen = page.wait_for_function(f"() => window.__seen[{step}] || false", timeout=15_000, polling=20)
            out.append(seen.json_value() / 1000.0 - t_append)
        return out
    finally:
        page.close()


def cpu_share(pid: int, window_s: float, job=None, steps_per_s: float = 2.0) -> float:
    """Percent of one core the process used over ``window_s`` (the job appending if given)."""
    stop = threading.Event()

    def stream():
        while not stop.wait(1.0 / steps_per_s):
            job.write_step()

    th = threading.Thread(target=stream, daemon=True) if job is not None else None
    if th:
        th.start()
    c0, t0 = cpu_seconds(pid), time.monotonic()
    time.sleep(window_s)
    c1, t1 = cpu_seconds(pid), time.monotonic()
    stop.set()
    if th:
        th.join(5)
    return 100.0 * (c1 - c0) / (t1 - t0)


def make_runs(root: Path, n: int) -> None:
    """``n`` run folders in ``root``: a mix of states, lengths and morphs (``write_run``)."""
    from dashboard_writer import write_run

    states = ("SUCCEEDED", "RUNNING", "FAILED", "STOPPED", "RUNNING")
    for i in range(n):
        total = 200
        write_run(root, f"job-{i:03d}", states[i % len(states)], 20 + (i * 37) % 180, total, morph=i % 3 == 0)


def jobs_renders(ctx, url: str, password: str, n: int, renders: int) -> tuple[float, list[float]]:
    """Sign-in to the jobs table drawn (the first session), then ``renders`` navigations to it."""
    page = ctx.new_page()

    def drawn() -> None:   # (the table is in a Panel pane's shadow DOM: a locator pierces it)
        page.locator("tr[data-job]").nth(n - 1).wait_for(timeout=60_000)
        assert page.locator("tr[data-job]").count() == n

    try:
        t0 = submit_login(page, url, password)
        drawn()
        first = time.perf_counter() - t0
        times = []
        for _ in range(renders):
            t0 = time.perf_counter()
            page.goto(url + "/", timeout=60_000)
            drawn()
            times.append(time.perf_counter() - t0)
        return first, times
    finally:
        page.close()


def main() -> int:
    def extra(ap):
        ap.add_argument("--points", type=int, default=None, help="steps of history in the big job (default 100000)")
        ap.add_argument("--renders", type=int, default=None, help="first renders per job (default 5)")
        ap.add_argument("--samples", type=int, default=None, help="update-latency samples per job (default 12)")
        ap.add_argument("--cpu-window", type=float, default=None, help="seconds per CPU measurement (default 20)")
        ap.add_argument("--runs", type=int, default=50, help="run folders in the jobs-table measurement (default 50)")

    args = common.parse_args(__doc__.split("\n")[0], extra)
    points = args.points or (5_000 if args.quick else 100_000)
    renders = args.renders or (2 if args.quick else 5)
    samples = args.samples or (4 if args.quick else 12)
    window = args.cpu_window or (5.0 if args.quick else 20.0)
    if not Path(CHROMIUM).exists():
        print(f"{CHROMIUM} is missing: install Debian's chromium to run this benchmark", file=sys.stderr)
        return 2
    from playwright.sync_api import sync_playwright

    load = [common.load_average()]
    idle = common.wait_for_idle(args.wait_idle)
    figures, detail = [], {}
    with tempfile.TemporaryDirectory(prefix="varuna-dash-bench-") as tmp, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, timeout=60_000)
        try:
            for label, prefill in (("fresh job", 30), (f"{points // 1000}k steps", points)):
                job, log, write_s = make_job(Path(tmp) / label.replace(" ", "_"), prefill)
                cells = job.plan["P"] * job.plan["D"]
                srv = Served(Path(tmp) / label.replace(" ", "_"))
                try:
                    ctx = browser.new_context(viewport={"width": 1400, "height": 1750})
                    first_s = login(ctx, srv.url, srv.password, cells, 4)  # the server's first session
                    times = [first_render(ctx, srv.url, cells, 4) for _ in range(renders)]
                    lat = update_latencies(ctx, srv.url, job, samples, cells, 4)
                    d = {"steps": job.step, "write_history_s": write_s, "first_session_s": first_s,
                         "render_s": common.stats([t for t, _ in times]),
                         "points_in_browser": times[-1][1], "update_s": common.stats(lat)}
                    r = common.median([t for t, _ in times])
                    u = common.median(lat)
                    figures.append(common.Figure(f"first render, {label} (target < {TARGET_RENDER_S:g} s)", r, "s",
                                                 ratio=r / TARGET_RENDER_S, target="< 1", detail=d["render_s"]))
                    figures.append(common.Figure(f"  sign-in to all views drawn, first viewer, {label}", first_s, "s"))
                    figures.append(common.Figure(f"update latency, {label} (target < {TARGET_UPDATE_S:g} s)", u, "s",
                                                 ratio=u / TARGET_UPDATE_S, target="< 1", detail=d["update_s"]))
                    if prefill == points:
                        page = ctx.new_page()  # one session open, as a viewer would leave it
                        page.goto(srv.url + "/", timeout=60_000)
                        page.wait_for_function(ALL_DRAWN, arg=[cells, 4], timeout=60_000, polling=50)
                        time.sleep(2)
                        cpu_idle = cpu_share(srv.p.pid, window / 2)
                        cpu = cpu_share(srv.p.pid, window, job=job)
                        page.close()
                        d.update(cpu_idle_pct=cpu_idle, cpu_streaming_pct=cpu, cpu_window_s=window)
                        figures.append(common.Figure(
                            f"server CPU, {label}, 1 viewer, 2 steps/s (target < {TARGET_CPU_PCT:g} % of a core)",
                            cpu, "%", ratio=cpu / TARGET_CPU_PCT, target="< 1",
                            detail={"idle_pct": cpu_idle, "window_s": window}))
                        figures.append(common.Figure(f"  server CPU, {label}, 1 viewer, no new rows", cpu_idle, "%"))
                    detail[label] = d
                    ctx.close()
                finally:
                    srv.stop()
                    log.close()
            root = Path(tmp) / "runs"
            make_runs(root, args.runs)
            srv = Served(root)
            try:
                ctx = browser.new_context(viewport={"width": 1400, "height": 1750})
                first_s, times = jobs_renders(ctx, srv.url, srv.password, args.runs, renders)
                ctx.close()
            finally:
                srv.stop()
            r = common.median(times)
            label = f"jobs table, {args.runs} runs"
            detail[label] = {"runs": args.runs, "first_session_s": first_s, "render_s": common.stats(times)}
            figures.append(common.Figure(f"first render, {label} (target < {TARGET_JOBS_S:g} s)", r, "s",
                                         ratio=r / TARGET_JOBS_S, target="< 1", detail=detail[label]["render_s"]))
            figures.append(common.Figure(f"  sign-in to the jobs table drawn, {label}", first_s, "s"))
        finally:
            browser.close()
    load.append(common.load_average())
    common.print_table("Dashboard: first render, update latency, server CPU", figures)
    notes = ("Absolute targets (ratio = value / target). Refresh period 1 s: an appended row waits on average "
             "half a period for the server's next read, then one websocket message and a redraw. The big job "
             "is drawn as at most 2000 min/max-downsampled points per series (points_in_browser). Chromium "
             "headless, software rendering, on the same 2 CPUs as the server, the job and playwright.")
    common.write_results("dashboard", figures, notes,
                         machine=common.machine_info(load_average=load, idle_before=idle),
                         extra={"detail": detail, "quick": args.quick}, out=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
