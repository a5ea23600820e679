"""``varuna demo``: the demo GPT-2 job, trained on emulated spot VMs that replay a slice of a real
pre-emption trace, morphing as they go and come back (paper §4.2, §4.6, §7.2).

What runs: the demo job (``demo_config``: a 4-block GPT-2, d=128, real 50,257-token BPE, on
Shakespeare, global batch 16) under the morph manager (``manager.Manager``) on a
``cluster.spot.SpotEmulator`` with **local slots** (workers are subprocesses of this machine; no
sshd is needed) that replays ``DEMO_SLICE``: the window 20560-21500 s (5 h 42 min 40 s to
5 h 58 min 20 s) of the AWS p3 trace recorded by Bamboo (NSDI'23; a copy ships in
``varuna_sdk/data/spot-traces/`` with its MIT licence), time compressed 7x (940 s of trace in
134 s). The emulator holds at most 4 VMs; the trace says which VM goes or comes back and when.
The replay starts (its t = 0) once the job's first step is done, so that it meets a job that
trains however long the workers took to start on a busy machine.
The trace records no pre-emption notices: the demo gives a 10 s notice (wall clock) before each
removal, except the removals at trace time 21240 s, which it replays as **sudden losses** (a
scripted choice, printed as such). On this slice the pool goes 4 → 3 → 4 → 1 → 2 VMs: a
shrink with notice, a VM back with no predicted gain (no morph), a sudden loss of 3 VMs, and a
grow. The first generation runs the job's fixed P=2 × D=2; after each morph the planner chooses
for the VMs then available (on a 2-core machine it predicts at most 2 workers are useful for
this model, and uses fewer workers than the pool when that is faster).

Output: the replayed VM events, the manager's state changes, rank 0's progress every 10 steps,
then the morph table (time, cause, old → new plan, downtime, steps lost), the held-out
perplexity at start and end, and the command that serves the dashboard of the run.

Owns ``demo_config``, ``TraceSlice``, ``DEMO_SLICE``, ``trace_path``, ``run_spot_demo``,
``SpotDemoResult``, ``morph_table``. Sits at the top with ``cli`` (imports ``manager``,
``cluster``, ``trainer``, ``launch``); nothing in the SDK imports it but ``cli``.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .cluster.spot import SpotEmulator, Trace, TraceEvent, load_trace
from .config import ConfigError, JobConfig, ModelConfig, ParallelConfig, TrainConfig

TRACES_DIR = Path(__file__).resolve().parent / "data" / "spot-traces"
"""Traces shipped with the SDK (a copy of Bamboo's ``aws-p3-trace.csv``, MIT licence)."""


# The spot demo trains longer than the fixed one: the slice's last event (a VM coming back, the
# grow) comes ~123 s after the replay starts, and on a quiet 2-core machine 120 steps end first.
SPOT_DEMO_STEPS = 160


def demo_config(steps: int = 120) -> JobConfig:
    """The demo job: a 4-layer GPT-2 (d=128, real 50,257-token BPE) on Shakespeare, P=2 × D=2,
    global batch 16 (micro-batch 2 × m=4 × D=2), ``steps`` optimizer steps."""
    return JobConfig(
        name="gpt2-shakespeare-demo",
        model=ModelConfig(preset="cpu-demo", dropout=0.0),
        parallel=ParallelConfig(P=2, D=2, global_batch=16, micro_batch_size=2, policy="varuna"),
        train=TrainConfig(steps=steps, lr=2e-3, min_lr=2e-4, warmup_steps=10, eval_batches=4),
    )


def trace_path(name: str) -> Path:
    """Path of a trace shipped in ``varuna_sdk/data/spot-traces/``. Raises ``FileNotFoundError``
    naming the traces that are there."""
    p = TRACES_DIR / name
    if not p.is_file():
        have = sorted(x.name for x in TRACES_DIR.glob("*.csv"))
        raise FileNotFoundError(f"no trace {name!r} in {TRACES_DIR}; shipped traces: {have}")
    return p


@dataclass(frozen=True)
class TraceSlice:
    """A replayable slice of a spot trace.

    ``file``: a trace in ``varuna_sdk/data/spot-traces/`` (or any path); ``start_s``/``end_s``:
    the window in trace seconds; ``compress``: trace seconds per wall second; ``notice_s``: wall
    seconds of pre-emption notice before a removal; ``sudden_at_s``: trace times (seconds) whose
    removals come without notice (sudden losses); ``capacity``: the most VMs held at once."""

    file: str
    start_s: float
    end_s: float
    compress: float
    notice_s: float = 10.0
    sudden_at_s: tuple[float, ...] = ()
    capacity: int = 4

    def path(self) -> Path:
        """The trace file: ``file`` itself when it is absolute or an existing file, else that name among the shipped
        traces (``trace_path``, which raises ``FileNotFoundError`` listing them)."""
        p = Path(self.file)
        return p if p.is_absolute() or p.is_file() else trace_path(self.file)

    def load(self) -> Trace:
        """The windowed, compressed trace (``cluster.spot.load_trace``); raises ``TraceError``,
        or ``ConfigError`` when a ``sudden_at_s`` time has no removal in the window."""
        tr = load_trace(self.path(), start_s=self.start_s, end_s=self.end_s, compress=self.compress)
        removals = {e.trace_ms for e in tr.events if e.kind == "remove"}
        for t in self.sudden_at_s:
            if round(t * 1000) not in removals:
                raise ConfigError(f"sudden_at_s={t}: the trace {self.file} has no removal at {t} s inside the "
                                  f"window [{self.start_s}, {self.end_s}) s; pick a time of a 'remove' row")
        return tr

    def emulator(self, *, hold: bool = False, pace: Callable[[], bool] | None = None, **kwargs) -> SpotEmulator:
        """A ``SpotEmulator`` replaying this slice (``kwargs``: ``backend``, ``root``...). With
        ``hold=True`` only the VMs up at the window start come up on ``start()``; the rest of
        the slice replays from ``begin_replay()`` on (its t=0). ``pace``: the replay clock stands
        still while it returns False (the demo: until the job trains again after a morph), so every
        event of the slice meets a running job however slow the machine."""
        return _SliceEmulator(self.load(), capacity=self.capacity, notice_s=self.notice_s,
                              sudden_ms={round(t * 1000) for t in self.sudden_at_s}, hold=hold, pace=pace,
                              **kwargs)

    def wall_s(self, trace_s: float) -> float:
        """Wall seconds after the replay starts at which trace time ``trace_s`` comes."""
        return (trace_s - self.start_s) / self.compress

    def describe(self) -> str:
        """What comes from the trace and what the demo adds, in a few lines."""
        tr = self.load()
        n = tr.counts()
        sudden = ", ".join(f"{t:.0f} s (at {self.wall_s(t):.0f} s wall)" for t in self.sudden_at_s) or "none"
        return (f"trace: {self.path().name} (AWS spot, recorded by Bamboo, NSDI'23), window {self.start_s:.0f}-"
                f"{self.end_s:.0f} s ({_hms(self.start_s)} to {_hms(self.end_s)}) compressed {self.compress:g}x: "
                f"{self.end_s - self.start_s:.0f} s of trace in {tr.duration_s:.0f} s; {n['add']} adds (incl. the "
                f"nodes up at the window start) and {n['remove']} removals of {len({e.node for e in tr.events})} "
                f"nodes; the emulator holds at most {self.capacity} VMs (the first nodes up, a freed VM going to the "
                f"next node added; the others' events are ignored)\n"
                f"  from the trace: which VM goes or comes back, and when. Scripted by the demo (the trace records "
                f"no notices): a {self.notice_s:g} s pre-emption notice before every removal, except those at trace "
                f"time {sudden}, replayed as sudden losses")


class _SliceEmulator(SpotEmulator):
    """``SpotEmulator`` with two additions the demo needs: trace removals at the ``sudden_ms``
    trace times come without a notice (the emulator gives every removal the same ``notice_s``),
    and with ``hold=True`` the replay clock stands at 0 after ``start()`` (the hosts up at the
    window start are up) until ``begin_replay()`` — so that the slice is replayed against a job
    that trains, however long its workers took to start on a busy machine.

    (A notice due less than ``notice_s`` after the replay start comes at once, held or not.)
    Both hook the emulator's private ``_trace_notice`` / ``_now`` (``cluster.spot`` owns them)."""

    _recheck_s = 0.25

    def __init__(self, trace: Trace, *, sudden_ms: set[int], hold: bool = False,
                 pace: Callable[[], bool] | None = None, **kwargs):
        super().__init__(trace, **kwargs)
        self.sudden_ms = set(sudden_ms)
        self._go: float | None = None if hold else time.monotonic()
        self.pace = pace
        self._paused_at: float | None = None
        self._paused_s = 0.0          # replay clock stood still this long (pace said not ready)

    def _trace_notice(self, e: TraceEvent) -> None:  # no notice for a sudden loss
        if e.trace_ms not in self.sudden_ms:
            super()._trace_notice(e)

    def _now(self) -> float:  # replay seconds; 0 while held; standing still while ``pace()`` is False
        if self._go is None:
            return 0.0
        mono = time.monotonic()
        if self.pace is not None and self._go is not None:
            ready = bool(self.pace())
            if not ready and self._paused_at is None:
                self._paused_at = mono
            elif ready and self._paused_at is not None:
                self._paused_s += mono - self._paused_at
                self._paused_at = None
        at = self._paused_at if self._paused_at is not None else mono
        return at - max(self._go, self._t0_mono or self._go) - self._paused_s

    def begin_replay(self) -> float:
        """Start the replay clock now (no-op if running); returns the Unix time of replay t=0."""
        if self._go is None:
            self._go = time.monotonic()
            with self._cv:
                self._cv.notify_all()
        return time.time() - self._now()


DEMO_SLICE = TraceSlice(file="aws-p3-trace.csv", start_s=20560.0, end_s=21500.0, compress=7.0, notice_s=10.0,
                        sudden_at_s=(21240.0,), capacity=4)
"""The demo's slice of the AWS p3 trace: with 4 VMs, at replay time 18.6 s a notice for one VM
(taken at 28.6 s), at 71.4 s a VM back, at 97.1 s three VMs lost at once (no notice), at 122.9 s
one back; the window ends at 134.3 s."""


@dataclass
class SpotDemoResult:
    """How the spot demo ended: ``state`` (``JobState`` value), ``morphs`` (``MorphRecord``
    dicts), ``ppl_start``/``ppl_end`` (held-out perplexity; None if the job did not finish or
    is no language model on text), ``loss_start``/``loss_end`` (held-out loss; None without),
    ``run_dir``, ``t0`` (Unix seconds when the replay started), ``vm_events`` (wall seconds after
    ``t0``, kind, VM, reason), ``error``, ``wall_s``; ``earlier_morphs``: morphs of a continued
    run made before this demo started (``morphs`` holds this demo's only: their times are after
    ``t0``'s replay start)."""

    state: str
    morphs: list[dict]
    run_dir: Path
    t0: float
    ppl_start: float | None = None
    ppl_end: float | None = None
    loss_start: float | None = None
    loss_end: float | None = None
    vm_events: list[tuple[float, str, str, str]] = field(default_factory=list)
    error: str | None = None
    wall_s: float = 0.0
    earlier_morphs: int = 0


def _hms(s: float) -> str:
    h, rem = divmod(int(round(s)), 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m{sec:02d}s"


def _plan(p: dict | None) -> str:
    if not p:
        return "-"
    return f"P={p['P']} x D={p['D']} ({p['gpus']} worker{'s' if p['gpus'] != 1 else ''})"


def _hosts(p: dict | None) -> str:
    return ",".join(p.get("hosts") or []) if p else "-"


PACE_STEPS = 5   # the demo's replay waits, after each morph, until the new plan trained this many steps


def _trains_again(mgr, steps: int) -> bool:
    """The job runs under its latest plan, which has trained ``steps`` steps (the demo's pace)."""
    if not mgr.settled:
        return False
    s = mgr.summary()
    base = s["morphs"][-1]["resume_step"] if s["morphs"] else 0
    return s["last_step"] is not None and s["last_step"] + 1 - base >= steps


def example_vm_prices() -> dict[str, str]:
    """Host labels that price an emulated VM as the trace's 1-GPU V100 spot VM (``planner.rows.Prices``'
    example figures: spot and on-demand $ per hour), marked ``prices=example`` so that the dashboard's
    cost says they are an example."""
    from .planner.rows import Prices

    p = Prices()
    return {"price_per_hour": f"{p.spot_per_gpu_hour:g}", "on_demand_per_hour": f"{p.on_demand_per_gpu_hour:g}",
            "prices": "example", "instance_type": "1-GPU V100 VM (emulated)"}


def morph_table(morphs: list[dict], t0: float | None = None) -> str:
    """The morph history as an aligned text table: time (seconds after ``t0``; Unix time when
    ``t0`` is None), cause, VM that caused it, old plan → new plan (P × D, workers, VMs used),
    downtime (cause seen → first step of the new plan finished, seconds), steps lost, step the
    new plan resumed at."""
    rows = [("#", "time", "cause", "VM", "old plan -> new plan", "VMs used", "downtime", "steps lost", "resumed at")]
    for i, m in enumerate(morphs, 1):
        t = m["time"] - t0 if t0 is not None else m["time"]
        rows.append((str(i), f"{t:.1f} s", m["cause"], m.get("host") or "-",
                     f"{_plan(m.get('old'))} -> {_plan(m.get('new'))}",
                     f"{_hosts(m.get('old'))} -> {_hosts(m.get('new'))}",
                     "-" if m.get("downtime_s") is None else f"{m['downtime_s']:.1f} s",
                     str(m.get("steps_lost", 0)), f"step {m.get('resume_step', 0)}"))
    if len(rows) == 1:
        return "(no morph)"
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


class _DemoSink:
    """Worker output for the demo: rank 0's ``[varuna]`` lines and every ``every``-th step, and
    the exception line of a worker's traceback (survivors of a sudden loss print one when their
    peer's socket closes); everything still goes to ``RUN_DIR/gen<g>/workers.log``."""

    _EXC = re.compile(r"^(\[rank\d+\]: )?[A-Za-z_.]*(Error|Exception|PeerLost)\b.*:")

    def __init__(self, out: Callable[[str], None], every: int = 10):
        self.out, self.every = out, every

    def __call__(self, stream: str, worker: Any, line: str) -> None:
        text = line.split("] ", 1)[1] if "] " in line else line
        if stream == "stderr":
            if self._EXC.match(text):
                self.out(line if len(line) <= 200 else line[:197] + "...")
        elif getattr(worker, "rank", None) == 0:
            if text.startswith("[varuna]"):
                self.out(line)
            elif text.startswith("step "):
                try:
                    done = int(text.split()[1].split("/")[0])
                except (IndexError, ValueError):
                    return
                if done % self.every == 0:
                    self.out(line)


def _prepare_demo(job: JobConfig, run_dir, trace_slice: TraceSlice, checkpoint_every: int, say):
    """Everything before the replay: the job and the slice checked, the run folder made, the
    model calibrated (a first calibration takes a while). Returns ``(job, run folder, resolved
    job, profile)``; raises ``ConfigError`` before anything starts."""
    from .profiling.job import calibrate_job
    from .runner import prepare_run

    job = job.validate()
    if job.train.checkpoint_every <= 0:
        job.train.checkpoint_every = checkpoint_every
    trace_slice.load()  # a bad slice fails here, before anything starts
    p = job.parallel
    if p.P is not None and p.D is not None and p.P * p.D > trace_slice.capacity:
        raise ConfigError(f"P={p.P} x D={p.D} needs {p.P * p.D} workers but the spot demo holds at most "
                          f"{trace_slice.capacity} VMs; use --P/--D with P x D <= {trace_slice.capacity}")
    job, run, resolved = prepare_run(job, run_dir)  # the one run façade (runner): checked, run folder made
    say(f"[demo] {job.name}: {resolved.spec.name}, global batch {p.global_batch}, {job.train.steps} steps, "
        f"checkpoint every {job.train.checkpoint_every} steps; first plan P={p.P} x D={p.D}, then whatever the "
        f"planner predicts fastest for the VMs left")
    say(f"[demo] spot VMs: {trace_slice.describe()}")
    say("[demo] backend: local slots (workers are subprocesses on this machine; no sshd needed). "
        "A removal kills the VM's worker processes.")
    t_cal = time.monotonic()
    profile = calibrate_job(job, resolved=resolved)  # before the replay starts: a first calibration takes a while
    say(f"[demo] calibration ready in {time.monotonic() - t_cal:.1f} s; starting the replay")
    return job, run, resolved, profile


def _vm_printer(emu, say, events: list, t0_box: list):
    """The emulator's VM callback of the demo: records each event in ``events`` (seconds since
    ``t0_box[0]``, kind, host, reason) and says it, a removal without a notice marked."""
    noticed: set[str] = set()
    lock = threading.Lock()

    def on_vm(ev) -> None:
        t = ev.time - t0_box[0]
        node = emu.node_of(ev.host.name)
        reason = ev.reason or ""
        with lock:
            events.append((t, ev.kind, ev.host.name, reason))
            sudden = ev.kind == "removed" and ev.host.name not in noticed
            (noticed.add if ev.kind == "notice" else noticed.discard)(ev.host.name)
        if ev.kind == "notice":
            say(f"[spot {t:6.1f} s] pre-emption notice for {ev.host.name} ({reason}): taken in "
                f"{ev.lead_s:.0f} s")
        elif ev.kind == "removed":
            say(f"[spot {t:6.1f} s] {ev.host.name} removed ({reason}){' WITHOUT notice' if sudden else ''}; "
                f"VMs up: {len(emu.all_hosts())}")
        else:
            say(f"[spot {t:6.1f} s] {ev.host.name} added ({reason or node or 'by hand'}); VMs up: {len(emu.all_hosts())}")

    return on_vm


def _drive(mgr, emu, on_vm, say, timeout_s: float, t_start: float, t0_box: list) -> None:
    """Start the emulator and the manager, begin the trace replay once the job trains (sets
    ``t0_box[0]``), wait up to ``timeout_s`` seconds, then stop the job (checkpointed) if it still
    runs. Ctrl-C stops it at the next mini-batch boundary and re-raises; the emulator is closed
    (every emulated VM removed) in every case."""
    try:
        emu.subscribe(on_vm)
        emu.start()
        mgr.start()
        deadline = time.monotonic() + timeout_s
        while mgr.summary()["last_step"] is None and not mgr.state.terminal and time.monotonic() < deadline:
            time.sleep(0.2)
        if not mgr.state.terminal:
            t0_box[0] = emu.begin_replay()
            say(f"[demo] the job trains (first step done {t0_box[0] - t_start:.0f} s after launch): the trace "
                f"replay starts now, t = 0 s")
        state = mgr.wait(max(1.0, deadline - time.monotonic()))
        if not state.terminal:
            say(f"[demo] still running after {timeout_s:.0f} s: stopping the job (checkpointed)")
            mgr.cancel()
            state = mgr.wait(120.0)
    except KeyboardInterrupt:
        say("[demo] interrupted: stopping the job at the next mini-batch boundary")
        mgr.cancel()
        mgr.wait(120.0)
        raise
    finally:
        try:
            emu.close()
        except RuntimeError as e:
            say(f"[demo] cleanup: {e}")


def run_spot_demo(job: JobConfig | None = None, *, run_dir: str | Path | None = None,
                  trace_slice: TraceSlice = DEMO_SLICE, out: Callable[[str], None] | None = None,
                  heartbeat_interval_s: float = 1.0, timeout_s: float = 900.0,
                  checkpoint_every: int = 5, signals: bool = False) -> SpotDemoResult:
    """Train ``job`` (default ``demo_config()``; any job of one's own: ``varuna demo job.yaml``)
    under the morph manager on the spot emulator replaying ``trace_slice`` with local slots,
    printing progress with ``out`` (default: print).

    ``run_dir``: the job's folder (default ``runs/<name>-<time>``); ``checkpoint_every``: steps
    between periodic checkpoints when the job sets none (bounds the steps a sudden loss costs);
    ``timeout_s``: the job is cancelled (checkpointed) after that many seconds. ``signals``:
    SIGINT/SIGTERM stop the job at a boundary with a checkpoint (``runner.stop_on_signals``; the
    CLI's way: a SIGTERM ended the command and left its workers training unmanaged).
    Returns ``SpotDemoResult``. Raises ``ConfigError`` for a bad job or slice before anything
    starts; every worker process is stopped and every emulated VM removed on return, error or
    Ctrl-C."""
    from .manager.decisions import GrowRule
    from .manager.manager import Manager
    from .manager.state import JobState
    from .runner import job_labels

    say = out or (lambda s: print(s, flush=True))
    job, run, resolved, profile = _prepare_demo(job or demo_config(), run_dir, trace_slice, checkpoint_every, say)
    box: list = []   # the manager, once made (the emulator is made first: the manager needs it)
    emu = trace_slice.emulator(backend="local", hold=True, labels=example_vm_prices(),
                               pace=lambda: bool(box) and _trains_again(box[0], PACE_STEPS))
    events: list[tuple[float, str, str, str]] = []
    t_start = time.time()
    t0_box = [t_start]
    on_vm = _vm_printer(emu, say, events, t0_box)

    def on_state(state, reason: str) -> None:
        say(f"[manager {time.time() - t0_box[0]:6.1f} s] {state.value}: {reason}")

    mgr = Manager(job, emu, run_dir=run, profile=profile, heartbeat_interval_s=heartbeat_interval_s,
                  grow=GrowRule(min_gain=1.10, cooldown_s=10.0), straggler=None, stop_timeout_s=60.0,
                  generation_options={"sink": _DemoSink(say)}, on_state=on_state, labels=job_labels(resolved))
    box.append(mgr)
    t_wall = time.monotonic()
    from .runner import stop_on_signals

    with stop_on_signals(mgr) if signals else contextlib.nullcontext():
        _drive(mgr, emu, on_vm, say, timeout_s, t_start, t0_box)
    summary = mgr.summary()
    mine, earlier = split_morphs(summary["morphs"], t_start)
    res = SpotDemoResult(state=summary["state"], morphs=mine, run_dir=run, t0=t0_box[0],
                         vm_events=events, error=summary["error"], wall_s=time.monotonic() - t_wall,
                         earlier_morphs=earlier)
    sfile = run / "summary.json"
    if summary["state"] == JobState.SUCCEEDED.value and sfile.exists():
        s = json.loads(sfile.read_text())
        res.ppl_start, res.ppl_end = s.get("ppl_start"), s.get("ppl_end")
        res.loss_start, res.loss_end = s.get("loss_start"), s.get("loss_end")
    return res


def _last_stay(run_dir: Path) -> str | None:
    """The run's last grow decision that stayed, in words (``event_sentence``); None without one
    or without a readable event log."""
    from .manager.events import EventLog, Kind
    from .manager.runs import event_sentence

    try:
        with EventLog.reader(Path(run_dir) / "events.db") as log:
            stays = [e for e in log.events(kind=Kind.GROW_DECISION) if e.payload.get("decision") == "stay"]
    except Exception:  # noqa: BLE001 - a report line; the run's own files say the rest
        return None
    return event_sentence(stays[-1]) if stays else None


def split_morphs(morphs: list[dict], t_start: float) -> tuple[list[dict], int]:
    """``(this demo's morphs, how many came before)``: a continued run's summary holds its earlier
    demo's morphs too, whose times (Unix seconds) are before ``t_start``; tabled against this
    replay's start they showed at negative times ("-21.0 s")."""
    mine = [m for m in morphs if not isinstance(m.get("time"), (int, float)) or m["time"] >= t_start]
    return mine, len(morphs) - len(mine)


def print_spot_result(res: SpotDemoResult, out: Callable[[str], None] | None = None) -> None:
    """The demo's closing report: morph table, perplexity, where the dashboard can be served."""
    say = out or (lambda s: print(s, flush=True))
    say(f"\n[demo] job {res.state} in {res.wall_s:.0f} s; {len(res.morphs)} morph(s) "
        "(time: seconds after the replay started; downtime: cause seen -> first step of the new plan done):")
    say(morph_table(res.morphs, res.t0))
    if res.earlier_morphs:
        say(f"[demo] this run continued a stopped one, whose {res.earlier_morphs} earlier morph(s) are not above "
            f"(`varuna status {res.run_dir}` lists every morph of the run); the trace replay started again at t = 0")
    if not res.morphs and res.state == "SUCCEEDED" and not any(k in ("notice", "removed") for _, k, _, _ in res.vm_events):
        say(f"[demo] no morph: the job ended {res.wall_s:.0f} s into the replay, before the trace pre-empted any VM; "
            "a longer job (more train.steps) meets its notices, losses and returning VMs")
    from .manager.runs import morph_sentence

    for i, m in enumerate(res.morphs, 1):   # why each plan, and where the downtime went
        say(f"  {i}. {morph_sentence(m, res.t0)}")
    if any(k == "added" for _, k, _, _ in res.vm_events) and not any(m.get("cause") == "grow" for m in res.morphs):
        said = _last_stay(res.run_dir)
        if said:   # VMs came back and the job stayed as it was: why (the planner's predicted gain)
            say(f"[demo] VMs came back but the job did not grow onto them: {said}")
    if res.error:
        say(f"[demo] error: {res.error}")
    if res.ppl_start is not None:
        say(f"[demo] held-out perplexity: start {res.ppl_start:.2f} -> end {res.ppl_end:.2f}")
    elif res.loss_start is not None and res.loss_end is not None:
        say(f"[demo] held-out loss: start {res.loss_start:.4g} -> end {res.loss_end:.4g}")
    say(f"[demo] run folder: {res.run_dir} (events.db, metrics.jsonl, summary.json, checkpoints/, gen<N>/workers.log)")
    say(f"[demo] dashboard (VM pool, plans, morph history): varuna dashboard {res.run_dir}")


__all__ = ["demo_config", "TraceSlice", "DEMO_SLICE", "TRACES_DIR", "trace_path", "run_spot_demo",
           "SpotDemoResult", "morph_table", "print_spot_result", "split_morphs"]
