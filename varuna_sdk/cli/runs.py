"""The run-folder commands: ``varuna status [RUN]``, ``varuna stop RUN``, ``varuna logs RUN`` and
``varuna export RUN -o FILE`` (the trained weights, ``runner.trained_weights``),
read from a run folder's event log and worker logs (``manager.runs``) — they never talk to a
running manager except through the folder (``runs.request_stop``) — and ``stopped_exit_code``, the
exit code of a ``train``/``launch`` whose job was stopped, from who asked for the stop.

Imports ``manager.runs``/``manager.events`` only inside the commands (``varuna --help`` stays
fast). Never imports the dashboard.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path


def run_folder_command(args: argparse.Namespace) -> int:
    """``varuna status [RUN]``, ``varuna stop RUN``, ``varuna logs RUN``."""
    import time

    from ..manager import runs

    if args.cmd == "export":
        return export_command(args)
    try:
        if args.cmd == "status":
            infos = [runs.read_run(p) for p in runs.find_runs(args.run)]
            if not infos:
                print(f"no runs in {args.run} (a run folder holds events.db)")
                return 0
            print(runs.format_runs(infos))
            if len(infos) == 1 and (Path(args.run) / "events.db").is_file():
                r = infos[0]
                print(f"\n{r.state_text}: {r.reason}")
                if r.orphaned:
                    print(f"no manager runs this job now (killed or crashed); `varuna launch "
                          f"{Path(args.run) / 'config.yaml'} --run-dir {args.run}` continues it")
                print(f"cost so far: {r.cost_text}")
                if r.drift is not None:
                    print(f"estimate: {runs.drift_sentence(r.drift, r.read_at)}")
                for i, m in enumerate(r.morphs, 1):
                    print(f"  morph {i} {runs.morph_sentence(m, r.started)}")
            return 0
        if args.cmd == "stop":
            _check_one_run(args.run, "stop", runs)
            info = runs.read_run(args.run)
            if not info.active:
                print(f"varuna: job {info.name} is {info.state} already; nothing to stop", file=sys.stderr)
                return 1
            if info.orphaned:
                print(f"varuna: no manager is running job {info.name} (it was killed or crashed while "
                      f"{info.state}); its workers stop by themselves with a checkpoint, and `varuna launch "
                      f"{Path(args.run) / 'config.yaml'} --run-dir {args.run}` continues the job", file=sys.stderr)
                return 1
            runs.request_stop(args.run)
            print(f"[varuna] asked job {info.name} to stop at the next mini-batch boundary (with a checkpoint)")
            deadline = time.time() + max(0.0, args.wait)
            while args.wait and time.time() < deadline:
                info = runs.read_run(args.run)
                if not info.active:
                    print(f"[varuna] job {info.name}: {info.state} at step {info.steps_done}")
                    return 0 if info.state == "STOPPED" else 1
                time.sleep(0.5)
            if args.wait:
                print(f"varuna: job {info.name} is still {info.state} after {args.wait:g} s", file=sys.stderr)
                return 1
            return 0
        return _logs(args, runs)
    except (FileNotFoundError, NotADirectoryError) as e:
        print(f"varuna: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:   # (``logs --follow``, ``stop --wait``): the job itself goes on
        print("varuna: interrupted (the job, if any, goes on)", file=sys.stderr)
        return 130


def export_command(args: argparse.Namespace) -> int:
    """``varuna export RUN -o FILE``: the run's trained model as one ``state_dict`` file
    (``torch.save``; keys as the model's own ``state_dict()``, ``runner.trained_weights``), written
    atomically. Says which checkpoint (steps) it came from, and when that is fewer steps than the
    run's ``train.steps`` (a stopped or running job). Returns 0 when written; 2 for a folder that
    is no run, a config that no longer resolves, or no usable checkpoint (the reason on stderr)."""
    import os

    from ..checkpoint.store import CheckpointError
    from ..config import ConfigError

    if not Path(args.run).exists():
        print(f"varuna: cannot export {args.run}: it does not exist (give a run folder: runs/<job>-<time>)",
              file=sys.stderr)
        return 2
    try:
        import torch

        from ..runner import trained_weights

        state, info = trained_weights(args.run)
    except (FileNotFoundError, NotADirectoryError, CheckpointError, ConfigError, ValueError) as e:
        print(f"varuna: cannot export {args.run}: {e}", file=sys.stderr)
        return 2
    out = Path(args.output)
    tmp = out.with_name(out.name + ".tmp")
    if not out.parent.is_dir():   # (torch.save raises a RuntimeError for it, not an OSError)
        print(f"varuna: cannot write {out}: its folder {out.parent} does not exist; create it, or give -o a file in "
              "a folder that exists", file=sys.stderr)
        return 2
    try:
        torch.save(state, tmp)
        os.replace(tmp, out)
    except (OSError, RuntimeError) as e:
        tmp.unlink(missing_ok=True)
        print(f"varuna: cannot write {out}: {getattr(e, 'strerror', None) or e}", file=sys.stderr)
        return 2
    from ..config import JobConfig

    total = JobConfig.from_yaml(Path(args.run) / "config.yaml").train.steps
    n = sum(t.numel() for t in state.values())
    note = "" if info.step >= total else (f" (of {total}: the newest usable checkpoint holds fewer; a run not "
                                          "finished yet, or a newer checkpoint torn)")
    print(f"[varuna] wrote {out}: {len(state)} tensors, {n:,} values, the model after {info.step} step(s){note}, "
          f"from checkpoint {info.name}; load it with "
          f"model.load_state_dict(torch.load({str(out)!r}, weights_only=True))")
    return 0


def _check_one_run(path: str, cmd: str, runs) -> None:
    """``path`` must be one job's run folder (holding ``events.db``) for ``varuna stop``/``logs``.
    Raises ``FileNotFoundError`` saying it does not exist, or that it is a folder of runs (naming
    them and the command for one), or that it is no run folder; ``NotADirectoryError`` for a file."""
    run = Path(path)
    if (run / "events.db").is_file():
        return
    inner = runs.find_runs(run)   # newest first (it raises for a path that does not exist, or a file)
    if inner:
        names = ", ".join(d.name for d in inner[:5]) + (f" and {len(inner) - 5} more" if len(inner) > 5 else "")
        one = shlex.quote(str(inner[0]))
        raise FileNotFoundError(f"{str(run)!r} is a folder of runs, not one job's run folder: it holds {len(inner)} "
                                f"run folder(s) ({names}); give one, e.g. `varuna {cmd} {one}` (`varuna status "
                                f"{shlex.quote(str(run))}` shows them all)")
    raise FileNotFoundError(f"{str(run)!r} holds no events.db: not a run folder (no job was launched with it as "
                            "--run-dir, or not yet)")


def stopped_exit_code(run_dir: str | Path) -> int:
    """The exit code of ``varuna train``/``launch`` whose job was stopped on request (``cli.parser.EXIT_STATUS``):
    128 + the signal's number when a signal asked for the stop (130: Ctrl-C, SIGINT; 143: SIGTERM,
    as a shell reports a process that signal ended), 0 for a stop asked by ``varuna stop`` from
    another shell (a clean stop at a boundary, with a checkpoint)."""
    from ..manager.runs import stopped_by

    try:
        by = stopped_by(run_dir)
    except Exception:  # noqa: BLE001 - an unreadable event log: the stop itself was clean
        by = None
    return {"SIGINT": 130, "SIGTERM": 143}.get(by or "", 0)



FOLLOW_START_WAIT_S = 600.0   # how long ``logs --follow`` waits for a job to start in a new folder
ORPHAN_QUIET_S = 10.0         # ... and follows an active job no manager holds before it ends too


def _wait_for_start(run: Path, wait_s: float = FOLLOW_START_WAIT_S) -> None:
    """Wait until ``run/events.db`` exists (a job launched beside the command may still be
    calibrating), saying so once on stderr; raises ``FileNotFoundError`` after ``wait_s`` seconds."""
    import time

    print(f"[varuna] waiting for a job to start in {run} (no events.db yet; Ctrl-C stops waiting)",
          file=sys.stderr, flush=True)
    deadline = time.time() + wait_s
    while not (run / "events.db").is_file():
        if time.time() > deadline:
            raise FileNotFoundError(f"no job started in {str(run)!r} within {wait_s:g} s (no events.db): "
                                    f"is it the --run-dir the job was launched with?")
        time.sleep(0.5)


def _logs(args: argparse.Namespace, runs) -> int:
    """Print the run's worker output (or, with --events, its events in sentences); with --follow
    wait for the job to start when the folder has no event log yet (``_wait_for_start``), then keep
    printing until the job has ended and nothing new came for a second (10 s when its state is
    active but no manager holds the folder)."""
    import time

    from ..manager.events import EventLog

    run = Path(args.run)
    if run.exists() and not run.is_dir():
        raise NotADirectoryError(f"{str(run)!r} is a file, not a run folder; give the --run-dir a job was launched with")
    if args.follow and not (run / "events.db").is_file() and not (run.is_dir() and runs.find_runs(run)):
        _wait_for_start(run)   # (not for a folder of runs: said at once below)
    _check_one_run(args.run, "logs", runs)   # a run folder, or FileNotFoundError saying what it is
    offsets: dict[Path, int] = {}
    own: dict = {}   # a worker's own log -> its runs.OwnLogFilter
    last_id, t0 = 0, None
    quiet_since = None
    while True:
        new = 0
        if args.events:
            with EventLog.reader(run / "events.db") as log:
                evs = log.events(since_id=last_id)
            for e in evs:
                t0 = e.time if t0 is None else t0
                print(runs.event_sentence(e, t0), flush=True)
                last_id, new = e.id, new + 1
        else:
            for f in runs.worker_logs(run):
                if f not in offsets:
                    print(f"===== {runs.log_label(f)} =====", flush=True)
                    offsets[f] = 0
                with open(f, "rb") as fh:
                    fh.seek(offsets[f])
                    chunk = fh.read()
                cut = chunk.rfind(b"\n") + 1   # whole lines only
                if cut:
                    text = chunk[:cut].decode("utf-8", "replace")
                    if f.name != "workers.log":   # a worker's own: what it replays that workers.log has, hidden
                        keep = own.setdefault(f, runs.OwnLogFilter(f)).keep
                        text = "".join(ln + "\n" for ln in text[:-1].split("\n") if keep(ln))
                    sys.stdout.write(text)
                    sys.stdout.flush()
                    offsets[f] += cut
                    new += 1
        if not args.follow:
            return 0
        info = runs.read_run(run)
        if new or (info.active and not info.orphaned):
            quiet_since = None
        else:   # ended; or no manager holds the folder (killed, or one just made it and starts soon)
            quiet_since = quiet_since or time.time()
            if time.time() - quiet_since > (ORPHAN_QUIET_S if info.active else 1.0):
                if info.orphaned:
                    print(f"[varuna] no manager runs job {info.name} now (killed or crashed while {info.state}); "
                          f"its workers stop by themselves with a checkpoint, and `varuna launch "
                          f"{run / 'config.yaml'} --run-dir {run}` continues it", file=sys.stderr, flush=True)
                return 0
        time.sleep(0.5)
