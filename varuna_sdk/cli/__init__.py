"""The ``varuna`` command (``varuna --version``; ``varuna COMMAND --help`` describes each with examples):
``varuna train CONFIG.yaml``, ``varuna demo`` (the demo job on emulated
spot VMs replaying a real trace, morphing; ``--no-spot``: a fixed P=2 x D=2 local run — see
``varuna_sdk.demo``), ``varuna config``, ``varuna dashboard RUN_DIR`` (imports the top-level
``dashboard`` package only for that command).

Owns ``main`` (dispatching each subcommand, and ``train``/``demo``/``config`` itself),
``build_parser`` and turning ``ConfigError``/``WorkerFailure`` into one clear line and a non-zero
exit. The other commands live beside it: ``cli.parser`` (every subcommand's flags and examples),
``cli.plan`` (calibrate, plan), ``cli.launch`` and ``cli.aws`` (launch), ``cli.runs`` (status,
stop, logs) and ``cli.serve`` (dashboard). Sits at the top of the dependency graph; only
``cli.serve`` may import the ``dashboard`` package, and every heavy import (torch, the manager,
the planner) stays inside the function that needs it, so ``varuna --help`` starts fast.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ..config import ConfigError, JobConfig
from ..demo import demo_config  # re-exported: `from varuna_sdk.cli import demo_config`
from ..shipping import ShippingError
from .launch import _say, launch_command
from .parser import add_commands, again_command
from .plan import calibrate_or_plan
from .runs import run_folder_command, stopped_exit_code
from .serve import dashboard_command


def _apply_overrides(job: JobConfig, args: argparse.Namespace) -> list[str]:
    """``--P``, ``--D``, ``--global-batch``, ``--micro-batch-size``, ``--policy``, ``--steps`` over
    ``job``'s values (in place); returns the flags applied, as typed (``["--P 3"]``)."""
    given = []
    for field_name in ("P", "D", "global_batch", "micro_batch_size", "policy"):
        v = getattr(args, field_name, None)
        if v is not None:
            setattr(job.parallel, field_name, v)
            given.append(f"--{field_name.replace('_', '-')} {v}")
    if getattr(args, "steps", None) is not None:
        job.train.steps = args.steps
        given.append(f"--steps {args.steps}")
    return given


def _validated(job: JobConfig, given: list[str]) -> JobConfig:
    """``job.validate()``; a ``ConfigError`` also names the command-line flags applied over the
    file (a file line it quotes held a value that fitted until a flag changed another field)."""
    try:
        return job.validate()
    except ConfigError as e:
        if not given:
            raise
        raise ConfigError(f"{e} [flags given over the config's values: {', '.join(given)}]") from None


def _spot_demo(job: JobConfig, args: argparse.Namespace) -> int:
    """``varuna demo``: the job under the morph manager on the spot emulator (``demo.run_spot_demo``);
    0 when it succeeded."""
    from ..demo import print_spot_result, run_spot_demo
    from ..runner import new_run_dir

    res = run_spot_demo(job, run_dir=args.run_dir if args.run_dir is not None else new_run_dir(job), signals=True)
    print_spot_result(res)
    if res.state == "STOPPED":   # Ctrl-C or SIGTERM (as train/launch say it): the same command continues it
        print(f"[varuna] stopped with a checkpoint; `{again_command(args.argv, res.run_dir)}` continues the job",
              flush=True)
        return stopped_exit_code(res.run_dir)
    return 0 if res.state == "SUCCEEDED" else 1


def build_parser() -> argparse.ArgumentParser:
    """The ``varuna`` command line: every subcommand with a description, examples and help for
    every flag."""
    from .. import __version__

    parser = argparse.ArgumentParser(prog="varuna", allow_abbrev=False, description="Pipeline x data parallel training of your own "
                                     "PyTorch model on spot VMs that come and go (after Varuna, arXiv 2111.04007).")
    parser.add_argument("--version", action="version", version=f"varuna-sdk {__version__}")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    add_commands(sub)
    return parser


def _plain_warning(message, category, filename, lineno, line=None) -> str:
    """A warning as the command prints it: its words, not the source line of the SDK that raised it."""
    return f"varuna: warning: {message}\n"


def main(argv: list[str] | None = None) -> int:
    """``varuna ARGS``; returns the exit code (``cli.parser.EXIT_STATUS``): 0 done (or stopped by
    ``varuna stop``), 1 the job failed, 2 bad input, 130 interrupted by Ctrl-C (SIGINT), 143 by SIGTERM."""
    import warnings

    saved, warnings.formatwarning = warnings.formatwarning, _plain_warning
    try:
        return _main(argv)
    except BrokenPipeError:   # `varuna logs RUN | head`: the reader left; say nothing more
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - Python flushes stdout at exit
        except OSError:
            pass
        return 0
    finally:
        warnings.formatwarning = saved


def _unknown_arguments(parser: argparse.ArgumentParser, cmd: str, extra: list[str]) -> None:
    """Exit 2 with subcommand ``cmd``'s usage and what it does not take in ``extra``: the closest
    flag it has, or the subcommands that have the flag (``--steps`` is ``varuna train``'s)."""
    import difflib

    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    own = subs[cmd]
    flags = [o for a in own._actions for o in a.option_strings]
    hints = []
    for x in (e.split("=", 1)[0] for e in extra if e.startswith("--")):
        near = difflib.get_close_matches(x, flags, n=1, cutoff=0.75)
        elsewhere = sorted(name for name, p in subs.items() if name != cmd
                           and any(x in a.option_strings for a in p._actions))
        others = {o for name, p in subs.items() if name != cmd for a in p._actions for o in a.option_strings}
        near_elsewhere = difflib.get_close_matches(x, sorted(others - set(flags)), n=1, cutoff=0.75)
        if elsewhere:
            hints.append(f"{x} is a flag of varuna {' / varuna '.join(elsewhere[:3])}, not of varuna {cmd}")
        elif near:
            hints.append(f"{x}: did you mean {near[0]}?")
        elif near_elsewhere:
            y = near_elsewhere[0]
            has = sorted(name for name, p in subs.items() if any(y in a.option_strings for a in p._actions))
            hints.append(f"{x}: {y}? that is a flag of varuna {' / varuna '.join(has[:3])}, not of varuna {cmd}")
    own.error(f"unrecognized arguments: {' '.join(extra)}" + (f" ({'; '.join(hints)})" if hints else ""))


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args, extra = parser.parse_known_args(argv)
    if extra:   # said by the subcommand (its usage, the flags it has), not by `varuna` itself
        _unknown_arguments(parser, args.cmd, extra)
    args.argv = argv   # as typed: the command that continues a stopped job repeats every flag
    try:
        if args.cmd == "launch":
            return launch_command(args)
        if args.cmd in ("status", "stop", "logs", "export"):
            return run_folder_command(args)
        if args.cmd == "config":
            print(demo_config().to_yaml_beside_defaults("the demo's"), end="")   # its own values marked
            return 0
        if args.cmd in ("calibrate", "plan"):
            return calibrate_or_plan(args)
        if args.cmd == "dashboard":
            try:
                return dashboard_command(args)
            except (FileNotFoundError, PermissionError) as e:
                print(f"varuna: {e}", file=sys.stderr)
                return 2
            except OSError as e:  # the port is taken, the address is not ours
                print(f"varuna: cannot serve on {args.address}:{args.port}: {e.strerror or e}; pick another "
                      "--port or --address", file=sys.stderr)
                return 2
        if args.cmd == "demo" and args.config is None:
            from ..demo import SPOT_DEMO_STEPS

            job = demo_config(120 if args.no_spot else SPOT_DEMO_STEPS)
        else:
            job = JobConfig.from_yaml(Path(args.config))
        job = _validated(job, _apply_overrides(job, args))
        if args.cmd == "demo" and not args.no_spot:
            return _spot_demo(job, args)
        from ..manager.state import ManagerError
        from ..pipeline.spawn import WorkerFailure
        from ..runner import JobStopped, train_local

        try:
            result = train_local(job, run_dir=args.run_dir, signals=True, narrate=_say)
        except JobStopped as e:
            print(f"[varuna] {e.sentence}; `{again_command(args.argv, e.run_dir)}` continues the job",
                  file=sys.stderr)
            return stopped_exit_code(e.run_dir)
        except ManagerError as e:   # another manager runs the folder (as `varuna launch` says it)
            print(f"varuna: {e}", file=sys.stderr)
            return 2
        except WorkerFailure as e:
            said = f"varuna: training failed: {e}"
            print(said, file=sys.stderr)
            for rank, (code, tb) in sorted(e.failures.items()):
                if tb and tb.strip() not in said:   # a rank's words the message above has not given already
                    print(f"--- rank {rank} (exit {code}) ---\n{tb}", file=sys.stderr)
            return 1
        if not result.trained:
            print(f"[varuna] the job in {result.run_dir} had already ended ({result.summary.get('steps', '?')} "
                  "step(s)); nothing was trained. Leave out --run-dir (or give a new folder) to train again.")
        print(f"[varuna] run folder: {result.run_dir} (metrics.jsonl, summary.json, config.yaml)")
        return 0
    except (ConfigError, ValueError, ShippingError) as e:
        print(f"varuna: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        run_dir = getattr(e, "run_dir", None)   # ``manager.state.JobInterrupted``: the job was recorded STOPPED
        if run_dir is not None:
            print(f"varuna: {e}; all workers stopped; `{again_command(args.argv, run_dir)}` continues the job",
                  file=sys.stderr)
        else:
            print("varuna: interrupted; all workers stopped", file=sys.stderr)
        return 130
