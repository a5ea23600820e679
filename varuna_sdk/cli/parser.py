"""The ``varuna`` command line's subcommands: each with its one-line help, its description, its
examples (``_EXAMPLES``) and help for every flag (``add_commands``; ``build_parser`` puts them
under ``varuna``).

Imports only ``argparse``, ``config`` (``POLICIES``) and ``cli.aws`` (for ``aws_flags``): never a command's module, never
the dashboard, so that ``varuna --help`` stays fast.
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from ..config import POLICIES
from .aws import aws_flags

_EXAMPLES = {
    "train": "varuna train job.yaml\n  varuna train job.yaml --steps 200 --P 2 --D 2 --run-dir runs/my-job",
    "demo": "varuna demo\n  varuna demo --no-spot --steps 60\n  varuna demo job.yaml            # your own job on the same emulated spot VMs",
    "config": "varuna config > job.yaml   # then edit model, data, parallel and train",
    "calibrate": "varuna calibrate job.yaml -o profile.json\n  varuna calibrate job.yaml --refresh",
    "plan": "varuna plan job.yaml --gpus 16 --profile profile.json\n"
            "  varuna plan job.yaml --gpus 8 --spot-price 0.9 --on-demand-price 3.06 --target-examples 1000000\n"
            "  varuna plan job.yaml --gpus 4 --local",
    "dashboard": "varuna dashboard runs          # every job: a jobs table, a page per job\n  varuna dashboard runs/my-job\n  varuna dashboard runs/my-job --address 0.0.0.0 --port 8080 "
                 "--certfile cert.pem --keyfile key.pem",
    "status": "varuna status            # every run in runs/\n  varuna status runs/my-job",
    "stop": "varuna stop runs/my-job   # checkpoint at the next mini-batch boundary, then stop",
    "logs": "varuna logs runs/my-job\n  varuna logs runs/my-job --follow\n  varuna logs runs/my-job --events",
    "export": "varuna export runs/my-job -o model.pt   # then: "
              "model.load_state_dict(torch.load('model.pt', weights_only=True))",
    "launch": "varuna launch job.yaml --local 4 --run-dir runs/my-job\n"
              "  varuna launch job.yaml --hosts hosts.txt --run-dir runs/my-job\n"
              "  varuna launch job.yaml --run-dir runs/my-job   # again after a crash: continues the job",
}


#: The exit status of ``varuna train`` and ``varuna launch`` (their ``--help`` ends with it).
EXIT_STATUS = """exit status:
  0    the job finished; or it was stopped by `varuna stop` from another shell, at a mini-batch
       boundary with a checkpoint (the command it prints continues the job)
  1    the job failed
  2    bad input (config, flags), or another manager runs the --run-dir
  130  stopped by Ctrl-C (SIGINT): at the next mini-batch boundary with a checkpoint; a second
       Ctrl-C a second or more later kills the workers at once and the job continues from its
       last complete checkpoint (`varuna status RUN` says which step)
  143  stopped by SIGTERM (e.g. `kill`, a scheduler's time limit), as the first Ctrl-C"""


#: The exit status of the commands that run no job (each one's ``--help`` ends with its own).
CALIBRATE_EXIT_STATUS = """exit status:
  0    the profile was measured (or found in the cache) and, with -o, written
  2    bad input (config, flags, an -o path that cannot be written), said before any measuring
  130  interrupted by Ctrl-C"""
PLAN_EXIT_STATUS = """exit status:
  0    the ranked table was printed (and, where the config fixes P, D or stages, the plan keeping them)
  1    no configuration fits the GPUs and global batch, or none keeps the config's P, D or stages
  2    bad input (config, flags, a --profile that is missing, unreadable or of another model or inputs)
  130  interrupted by Ctrl-C"""
STATUS_EXIT_STATUS = """exit status:
  0    the table was printed (also for a folder that holds no runs: it says so)
  2    the folder does not exist or is a file
  130  interrupted by Ctrl-C"""
STOP_EXIT_STATUS = """exit status:
  0    the stop was asked for; with --wait, the job reached STOPPED within the wait
  1    the job is not running (it ended already, or no manager runs it: killed or crashed); with
       --wait, it ended otherwise than STOPPED or was still running when the wait ran out
  2    bad input: no such run folder (or a folder of runs, or a file), a negative --wait
  130  interrupted by Ctrl-C while waiting (the stop was asked for; the job goes on to it)"""
LOGS_EXIT_STATUS = """exit status:
  0    the output was printed (with --follow: the job ended)
  2    no such run folder (or a file; --follow: no job started in it within 10 minutes)
  130  interrupted by Ctrl-C (the job, if any, goes on)"""


def _seconds(text: str) -> float:
    """An ``argparse`` type: a finite number of seconds >= 0 (else exit 2 with the flag's usage)."""
    import math

    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"{text} must be a number of seconds >= 0 (0: do not wait)")
    return v


def _subcommand(sub, name: str, help_: str, description: str, more: str = "") -> argparse.ArgumentParser:
    """A subcommand with its one-line help, its description and its examples (``_EXAMPLES``),
    then ``more`` (e.g. ``EXIT_STATUS``)."""
    return sub.add_parser(name, help=help_, description=description, allow_abbrev=False,
                          epilog="examples:\n  " + _EXAMPLES[name] + (f"\n\n{more}" if more else ""),
                          formatter_class=argparse.RawDescriptionHelpFormatter)


def _parallel_overrides(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--steps", type=int, help="training steps (mini-batches) in all; overrides train.steps")
    sp.add_argument("--P", type=int, help="pipeline depth (stages); overrides parallel.P")
    sp.add_argument("--D", type=int, help="data-parallel width (replicas); overrides parallel.D")
    sp.add_argument("--global-batch", dest="global_batch", type=int,
                    help="examples per mini-batch, over all replicas; overrides parallel.global_batch")
    sp.add_argument("--micro-batch-size", dest="micro_batch_size", type=int,
                    help="examples per micro-batch; overrides parallel.micro_batch_size")
    sp.add_argument("--policy", choices=list(POLICIES),
                    help="pipeline schedule: varuna (opportunistic, recompute), gpipe or 1f1b")
    sp.add_argument("--run-dir", dest="run_dir",
                    help="the job's own folder, as for `varuna launch` (default: a new train.run_dir/NAME-TIME)")


def _add_train_demo_config(sub) -> None:
    """``varuna train``, ``varuna demo`` and ``varuna config``."""
    sp = _subcommand(sub, "train", "train a job from a YAML config on local workers",
                     "Train the job of a YAML config on P x D local worker processes (gloo on CPU, NCCL with GPUs), "
                     "under the manager; with P or D null the planner chooses them first. With P and D fixed it "
                     "starts at once, without a calibration: stage boundaries balance estimated costs and recompute "
                     "is parallel.recompute or the policy's default (Varuna: on but on the last stage), where "
                     "`varuna launch` calibrates and plans both from measured times and memory.", EXIT_STATUS)
    sp.add_argument("config", help="path to a job YAML (see `varuna config`)")
    _parallel_overrides(sp)
    sp = _subcommand(sub, "demo", "train the demo GPT-2 on Shakespeare (or your job YAML) on emulated spot VMs",
                     "The demo job: GPT-2 on Shakespeare on emulated spot VMs replaying a real pre-emption trace, "
                     "morphing on each notice, loss and returning VM. Given a job YAML, that job instead, on the same "
                     "emulated VMs (local worker processes): a rehearsal of your own job's morphs before renting "
                     "spot VMs.")
    sp.add_argument("config", nargs="?", help="a job YAML of your own to run instead of the demo GPT-2 (see "
                                              "`varuna config`)")
    _parallel_overrides(sp)
    sp.add_argument("--no-spot", dest="no_spot", action="store_true",
                    help="train on a fixed set of local workers (no spot emulator, no morphs)")
    _subcommand(sub, "config", "print the demo job's YAML (a starting point for your own)",
                "Print the demo job's YAML with every field: copy it and change the model, the data and the sizes. "
                "Where the demo sets a field to its own value (lr, min_lr, steps...), the line says so and names the "
                "default that a config leaving the field out gets.")


def _add_calibrate_plan(sub) -> None:
    """``varuna calibrate`` and ``varuna plan``."""
    sp = _subcommand(sub, "calibrate", "measure the job's model once and save its profile (JSON)",
                     "Measure each cut-point segment's forward, recompute and backward time and memory at a few "
                     "micro-batch sizes, and this machine's network, once (paper section 4.3); cached.",
                     CALIBRATE_EXIT_STATUS)
    sp.add_argument("config", nargs="?", help="job YAML (default: the demo job)")
    sp.add_argument("-o", "--output", help="where to write the profile (default: the profile cache)")
    sp.add_argument("--refresh", action="store_true", help="re-measure even if a cached profile exists (the host's network figures too)")
    sp = _subcommand(sub, "plan", "rank every (P, D, micro-batch) for G GPUs with the simulator",
                     "Simulate every pipeline depth, replica count and micro-batch size for G GPUs from one "
                     "calibration and rank them by time per mini-batch (paper section 4); cost from the prices.",
                     PLAN_EXIT_STATUS)
    sp.add_argument("config", nargs="?", help="job YAML (default: the demo job)")
    sp.add_argument("--gpus", type=int, required=True, help="G, the GPUs (workers) available")
    sp.add_argument("--global-batch", dest="global_batch", type=int,
                    help="examples per mini-batch (default: the config's parallel.global_batch)")
    sp.add_argument("--profile", help="a profile JSON from `varuna calibrate` (default: calibrate/cache)")
    sp.add_argument("--gpus-per-vm", dest="gpus_per_vm", type=int, default=1,
                    help="GPUs on each VM (default 1): stages on one VM talk over its local links")
    sp.add_argument("--local", action="store_true",
                    help="plan local workers sharing this machine's cores (as `varuna train` runs them)")
    sp.add_argument("--per-pair-links", dest="per_pair_links", action="store_true",
                    help="VMs only: model a network link per pair of neighbouring workers (default: each worker's "
                         "activations and gradients leave its VM by one link, as on a VM with one network interface)")
    sp.add_argument("--policy", choices=list(POLICIES),
                    help="pipeline schedule to plan for (default: the config's parallel.policy)")
    sp.add_argument("--bandwidth-gbps", dest="bandwidth_gbps", type=float, help="what-if cross-VM bandwidth (Gbit/s)")
    sp.add_argument("--memory-gib", dest="memory_gib", type=float,
                    help="what-if memory per GPU (GiB; default: the calibrated device's, none on a CPU): Varuna "
                         "recomputes only on the stages that need it and caps what the others hold")
    sp.add_argument("--spot-price", dest="spot_price", type=float, help="$ per GPU-hour, spot")
    sp.add_argument("--on-demand-price", dest="on_demand_price", type=float, help="$ per GPU-hour, on-demand")
    sp.add_argument("--target-examples", dest="target_examples", type=int, help="show time and cost to this many examples")
    sp.add_argument("--top", type=int, default=12, help="rows of the ranked table to print (default 12)")
    sp.add_argument("--refine", type=int, action="append", metavar="P",
                    help="refine the row of depth P per stage (recompute only where memory needs it, in-flight caps) "
                         "where the table marks it * (left as searched: it cannot beat the best row); repeatable")
    sp.add_argument("--best-only", dest="best_only", action="store_true",
                    help="stop once no candidate can beat the best found (about linear in --gpus; other depths are "
                         "not ranked exactly)")


def _add_dashboard(sub) -> None:
    """``varuna dashboard``."""
    sp = _subcommand(sub, "dashboard", "serve a job's live dashboard to the team (read-only, login required)",
                     "Serve the job's dashboard (jobs, partition map, simulator estimates, throughput, VM pool), "
                     "live from its event log, behind a login.")
    sp.add_argument("run_dir", help="a job's run folder (holding events.db), its events.db, or a folder of runs "
                    "(a jobs table, a page per job)")
    sp.add_argument("--port", type=int, default=5006, help="TCP port (default 5006; 0 picks a free one)")
    sp.add_argument("--address", default="127.0.0.1",
                    help="address to listen on (default 127.0.0.1; 0.0.0.0 serves every interface)")
    sp.add_argument("--credentials", help='JSON file {"user": "password", ...}, mode 0600 (default: '
                    "$VARUNA_DASHBOARD_PASSWORD, else RUN_DIR/dashboard-credentials.json, generated once)")
    sp.add_argument("--allow-origin", dest="allow_origin", action="append", default=[], metavar="HOST:PORT",
                    help="another host:port browsers load the page from (e.g. a proxy); repeatable")
    sp.add_argument("--job-id", dest="job_id", help="show only this job's rows of a shared event log")
    sp.add_argument("--refresh", type=float, default=1.0, help="seconds between reads of the event log")
    sp.add_argument("--certfile", help="serve HTTPS with this PEM certificate (with --keyfile); cookies become Secure")
    sp.add_argument("--keyfile", help="the PEM private key of --certfile")


def _add_launch(sub) -> None:
    """``varuna launch`` (its options become a ``ClusterConfig``)."""
    sp = _subcommand(sub, "launch", "run a job under the morph manager (local slots, an SSH host file or AWS spot VMs); "
                     "run it again on the same --run-dir to continue the job",
                     "Run a job under the morph manager on local slots, the SSH VMs of a watched host file, or AWS "
                     "spot instances (--provider aws); "
                     "it re-plans and morphs when VMs are pre-empted or return. Run it again on the same --run-dir "
                     "to continue the job.", EXIT_STATUS)
    sp.add_argument("config", help="path to a job YAML (see `varuna config`)")
    sp.add_argument("--run-dir", dest="run_dir", help="the job's folder (an existing one is continued)")
    where = sp.add_mutually_exclusive_group()
    where.add_argument("--local", type=int, metavar="N", help="N local worker slots (default: launch.gpus)")
    where.add_argument("--hosts", metavar="FILE", help="SSH host file (watched; see cluster.hostfile)")
    where.add_argument("--provider", choices=["aws"], help="spot VMs from a cloud: aws (EC2, boto3; see cluster.aws)")
    aws_flags(sp)
    sp.add_argument("--job-id", dest="job_id", help="the job's id in the event log: the run folder's name "
                    "(default); given, it must be that name (with --run-dir), else exit 2")
    sp.add_argument("--heartbeat", type=float, default=2.0, help="heartbeat interval, seconds (default 2)")
    sp.add_argument("--orphan-after", dest="orphan_after", type=float, default=60.0,
                    help="workers that lose the manager this long stop at a boundary with a checkpoint (s)")


def _add_run_folder_commands(sub) -> None:
    """``varuna status``, ``varuna stop``, ``varuna logs`` and ``varuna export``."""
    sp = _subcommand(sub, "status", "show every job of a folder of runs, or one run: state, plan, progress, ETA",
                     "A table of the jobs in a folder of runs (default: runs/), or one run folder: state, plan, "
                     "step of the total, elapsed, ETA, morphs, the last event; for one run also every morph in a "
                     "sentence.", STATUS_EXIT_STATUS)
    sp.add_argument("run", nargs="?", default="runs", help="a run folder, or a folder of runs (default: runs)")
    sp = _subcommand(sub, "stop", "stop a running job at the next mini-batch boundary, with a checkpoint",
                     "Ask the manager of a run to stop the job at the next mini-batch boundary with a checkpoint "
                     "(as job.stop() does); `varuna launch` (or `varuna train`) on the same folder continues it. The "
                     "request goes through the run folder: the manager looks for it every 0.1 s and passes it on to "
                     "the workers at once, and they stop at the first boundary after it reaches them. A step is not "
                     "cut short: the step under way when you ask is completed (and checkpointed) first; only a "
                     "request that reaches the workers in that step's last moments (~0.1 s) also lets the next step "
                     "finish. The `varuna train`/`launch` running the job then exits 0.", STOP_EXIT_STATUS)
    sp.add_argument("run", help="the job's run folder")
    sp.add_argument("--wait", type=_seconds, default=0.0,
                    help="wait up to this many seconds for the job to reach STOPPED (default: do not wait)")
    sp = _subcommand(sub, "logs", "print a run's worker output and events (--follow: as they come)",
                     "Print the output of every worker of a run, generation by generation, each headed by "
                     "its name (===== gen0 =====; its workers print its plan first); --events prints the event "
                     "log in sentences instead, how each generation ended among them.", LOGS_EXIT_STATUS)
    sp.add_argument("run", help="the job's run folder")
    sp.add_argument("--follow", "-f", action="store_true", help="keep printing new lines until the job ends")
    sp.add_argument("--events", action="store_true", help="the event log in sentences instead of worker output")
    sp = _subcommand(sub, "export", "write a run's trained model weights (one state_dict file)",
                     "Write the trained weights of a run as one plain PyTorch state_dict of the whole model (the "
                     "names of your model's own state_dict, tied weights under each name), read from the run's newest "
                     "complete checkpoint whatever P x D wrote it (files checked against their SHA-256; a torn "
                     "checkpoint is never used). A finished run always checkpoints its last step, so that is the "
                     "model after train.steps steps; of a stopped run, the steps its checkpoint holds (printed). "
                     "Load it with model.load_state_dict(torch.load(FILE, weights_only=True)).")
    sp.add_argument("run", help="the job's run folder")
    sp.add_argument("-o", "--output", required=True, help="the file to write (torch.save of the state_dict)")


def again_command(argv: list[str], run_dir: str | Path) -> str:
    """The command line that continues a stopped job: ``varuna`` and ``argv`` as given (every flag
    kept: ``--steps``, ``--local``, ``--hosts``…) with ``--run-dir run_dir`` in place of any
    ``--run-dir`` it had, quoted for a POSIX shell."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--run-dir":
            skip = True
        elif not a.startswith("--run-dir="):
            out.append(a)
    return "varuna " + shlex.join([*out, "--run-dir", str(run_dir)])


def add_commands(sub) -> None:
    """Every ``varuna`` subcommand, added to ``sub`` (the parser's ``add_subparsers()``)."""
    for add in (_add_train_demo_config, _add_calibrate_plan, _add_dashboard, _add_launch, _add_run_folder_commands):
        add(sub)
