"""The ``varuna`` command (``varuna --version``; ``varuna COMMAND --help`` describes each with examples):
``varuna train CONFIG.yaml``, ``varuna demo`` (the demo job on emulated
spot VMs replaying a real trace, morphing; ``--no-spot``: a fixed P=2 x D=2 local run — see
``varuna_sdk.demo``), ``varuna config``, ``varuna dashboard RUN_DIR`` (imports the top-level
``dashboard`` package only for that command).

Owns argument parsing and turning ``ConfigError``/``WorkerFailure`` into one clear line and a
non-zero exit. Sits at the top of the dependency graph.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from .config import MAX_GPUS, ClusterConfig, ConfigError, JobConfig
from .demo import demo_config  # re-exported: `from varuna_sdk.cli import demo_config`
from .shipping import ShippingError


def _apply_overrides(job: JobConfig, args: argparse.Namespace) -> JobConfig:
    for field_name in ("P", "D", "global_batch", "micro_batch_size", "policy"):
        v = getattr(args, field_name, None)
        if v is not None:
            setattr(job.parallel, field_name, v)
    if getattr(args, "steps", None) is not None:
        job.train.steps = args.steps
    return job


def _calibrate_or_plan(args: argparse.Namespace) -> int:
    from .profiling.job import calibrate_job

    job = JobConfig.from_yaml(Path(args.config)) if args.config else demo_config()
    if args.cmd == "calibrate":
        prof = calibrate_job(job, refresh=args.refresh)
        if args.output:
            prof.to_json(args.output)
        print(f"[varuna] calibrated {prof.num_segments} segments at micro-batch sizes {prof.micro_batch_sizes} "
              f"in {prof.calibration_s:.1f} s" + (f"; wrote {args.output}" if args.output else ""))
        return 0
    from .planner.plan import plan
    from .planner.rows import Prices
    from .profiling.profile import Profile

    if args.profile and not Path(args.profile).is_file():
        raise ConfigError(f"profile file {args.profile!r} does not exist; make it with `varuna calibrate "
                          f"{args.config + ' ' if args.config else ''}-o {args.profile}`, or leave out --profile "
                          "to calibrate now")
    for flag, value in (("--gpus", args.gpus), ("--global-batch", args.global_batch), ("--gpus-per-vm", args.gpus_per_vm),
                        ("--target-examples", args.target_examples), ("--top", args.top)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} {value} must be >= 1")
    if args.gpus > MAX_GPUS:
        raise ConfigError(f"--gpus {args.gpus} is more than the planner searches ({MAX_GPUS}); plan at most {MAX_GPUS} "
                          "GPUs")
    for flag, value in (("--bandwidth-gbps", args.bandwidth_gbps), ("--spot-price", args.spot_price),
                        ("--on-demand-price", args.on_demand_price)):
        if value is not None and not (math.isfinite(value) and value >= (0 if flag.endswith("price") else 1e-9)):
            raise ConfigError(f"{flag} {value} must be a finite number {'>= 0' if flag.endswith('price') else '> 0'}")
    prof = Profile.load(args.profile) if args.profile else calibrate_job(job)
    _check_profile_matches(prof, job, args.profile, args.config)
    prices = Prices()
    if args.spot_price is not None or args.on_demand_price is not None:
        prices = Prices(spot_per_gpu_hour=args.spot_price if args.spot_price is not None else prices.spot_per_gpu_hour,
                        on_demand_per_gpu_hour=(args.on_demand_price if args.on_demand_price is not None
                                                else prices.on_demand_per_gpu_hour), vm_type="user prices", example=False)
    G, B = args.gpus, args.global_batch or job.parallel.global_batch
    par = job.parallel
    if args.local:  # as `varuna train` runs: every worker a local process sharing this machine's cores
        placement = dict(gpus_per_vm=G, compute_slots_per_vm=os.cpu_count() or 1)
        where = f"{G} local workers sharing this machine's {os.cpu_count() or 1} cores (as `varuna train` runs them)"
    else:
        placement = dict(gpus_per_vm=args.gpus_per_vm)
        where = (f"{args.gpus_per_vm} GPU(s) per VM, one worker per GPU; pass --local to plan local workers "
                 "sharing this machine's cores, as `varuna train` runs them")
    common = dict(policy=args.policy or par.policy, recompute=par.recompute,
                  network_bandwidth_Bps=args.bandwidth_gbps * 1e9 / 8 if args.bandwidth_gbps else None,
                  prices=prices, target_examples=args.target_examples, **placement)
    pl = plan(prof, G, B, exhaustive=not args.best_only, **common)
    print(pl.table(top=args.top))
    print(f"placement: {where}")
    if not pl.feasible:
        print(f"varuna: no configuration fits {G} GPUs and global batch {B}; see the reasons above", file=sys.stderr)
        return 1
    fixed = {k: v for k, v in (("P", par.P), ("D", par.D)) if v is not None}
    if fixed or par.boundaries:
        # the config fixes the depth, the width or the stages: the run `varuna train` would make
        what = ", ".join(f"parallel.{k}={v}" for k, v in fixed.items()) + (", parallel.boundaries" if par.boundaries else "")
        if par.D is not None and (par.D > G or B % par.D):
            print(f"varuna: parallel.D={par.D} from the config does not fit --gpus {G} and global batch {B} (D must "
                  "be at most the GPUs and divide the global batch); set D to null to let the planner choose",
                  file=sys.stderr)
            return 1
        try:
            kept = plan(prof, G, B, max_depth=None if par.boundaries else par.P, replicas=par.D,
                        boundaries=par.boundaries, **common)
        except ConfigError as e:
            print(f"varuna: {what} from the config cannot be kept with --gpus {G}: {e}", file=sys.stderr)
            return 1
        rows = [r for r in kept.feasible if (par.P is None or r.P == par.P) and (par.D is None or r.D == par.D)]
        if not rows:
            print(f"varuna: no feasible plan keeps {what} from the config; set them to null to let the planner "
                  "choose", file=sys.stderr)
            return 1
        r = rows[0]
        print(f"with {what} from the config: P={r.P} D={r.D} micro-batch {r.micro_batch_size} (m={r.m}), "
              f"{r.time_s * 1e3:.1f} ms per mini-batch, {r.examples_per_s:.1f} examples/s "
              f"({r.time_s / pl.best.time_s:.2f}x the best plan's time)")
    return 0


def _check_profile_matches(prof, job: JobConfig, path: str | None, config: str | None) -> None:
    """A profile measured on another model would plan the wrong thing: refuse it, naming the
    difference. Raises ``ConfigError``."""
    from .trainer import model_structure, resolve

    r = resolve(job)
    fix = (f"; calibrate this job with `varuna calibrate {config + ' ' if config else ''}-o PROFILE.json`, or leave "
           "out --profile" if path else "")
    measured = (prof.model or {}).get("identity")
    if isinstance(measured, dict):
        mine = json.loads(json.dumps(r.spec.identity, default=str))
        if measured != mine:
            keys = sorted(set(measured) | set(mine))
            diff = [f"{k} {measured.get(k)!r} (profile) vs {mine.get(k)!r} (job)" for k in keys
                    if measured.get(k) != mine.get(k)]
            raise ConfigError(f"profile {path or ''} was measured on another model: " + "; ".join(diff) + fix)
    elif prof.num_segments != (n := model_structure(job, r).num_segments):
        raise ConfigError(f"profile {path or ''} has {prof.num_segments} cut-point segments but the job's model "
                          f"({r.spec.name}) has {n}{fix}")


def _dashboard(args: argparse.Namespace) -> int:
    """``varuna dashboard RUN_DIR``: serve the job's dashboard behind a login until Ctrl-C.
    Prints the URL and where the credentials come from, never the password."""
    try:
        from dashboard.server import load_credentials, serve
        from dashboard.store import resolve_event_log
    except ImportError as e:
        print(f"varuna: the dashboard needs panel and bokeh ({e}); install the project with `pip install -e .`",
              file=sys.stderr)
        return 2
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port} is not a TCP port (0-65535)")
    if not 0 < args.refresh <= 3600:   # (also false for NaN)
        raise ValueError(f"--refresh {args.refresh} must be between 0 and 3600 seconds")
    from dashboard.server import is_folder_of_runs

    what = f"the jobs in {Path(args.run_dir).resolve()}" if is_folder_of_runs(args.run_dir) else \
        str(resolve_event_log(args.run_dir))
    creds, where = load_credentials(args.run_dir, args.credentials)
    server = serve(args.run_dir, credentials=creds, port=args.port, address=args.address,
                   allow_origins=args.allow_origin, job_id=args.job_id, refresh_s=args.refresh, start=False,
                   certfile=args.certfile, keyfile=args.keyfile)
    host = "localhost" if args.address in ("127.0.0.1", "::1", "localhost") else args.address
    scheme = "https" if args.certfile else "http"
    print(f"[varuna] dashboard of {what} at {scheme}://{host}:{server.port}/ (read-only; sign in with {where}); "
          "Ctrl-C stops it", flush=True)
    server.start()
    try:
        server.io_loop.start()  # panel stops the loop on Ctrl-C
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    print("[varuna] dashboard stopped", flush=True)
    return 0


def _log_to_stderr(name: str) -> None:
    """INFO lines of logger ``name`` on stderr as ``[varuna] ...`` (once)."""
    import logging

    logger = logging.getLogger(name)
    if not any(getattr(h, "_varuna", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[varuna] %(message)s"))
        handler._varuna = True
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def _boto3_region() -> str:
    """The region boto3 would use (AWS_DEFAULT_REGION, the profile's), or '' (none, or no boto3)."""
    try:
        import boto3

        return boto3.session.Session().region_name or ""
    except Exception:  # noqa: BLE001 - a broken profile is reported by the provider's checks
        return ""


def _cluster_config(args: argparse.Namespace) -> ClusterConfig:
    """``varuna launch``'s options as a ``ClusterConfig`` (not yet validated)."""
    aws = {"region": args.region, "instance_types": args.instance_type, "ami": args.ami, "subnets": args.subnet,
           "security_group": args.security_group, "key_name": args.key_name, "key_path": args.key_path,
           "max_price": args.max_price, "user": args.vm_user, "python": args.vm_python}
    return ClusterConfig(local=args.local, hosts=args.hosts, provider=args.provider, aws_file=args.aws,
                         aws={k: v for k, v in aws.items() if v not in (None, [])}, instances=args.instances,
                         endpoint_url=args.endpoint_url, run_dir=args.run_dir, job_id=args.job_id,
                         heartbeat_interval_s=args.heartbeat, orphan_after_s=args.orphan_after)


def _aws_settings(path: str | None) -> dict:
    """The mapping of AWS settings in the YAML file ``path`` ({} for none). Raises ``ConfigError``
    saying why the file cannot be used."""
    import yaml

    if not path:
        return {}
    try:
        loaded = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"--aws {path}: cannot read it ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"--aws {path}: not a text file; give a YAML file of AWS settings") from None
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}" if where is not None else ""
        raise ConfigError(f"--aws {path}: not valid YAML{at} ({getattr(e, 'problem', None) or e})") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: expected a mapping of AWS settings (region, instance_types, ami, ...)")
    return loaded


def _aws_provider(cluster: ClusterConfig, job: JobConfig):
    """``--provider aws``: the settings of ``--aws FILE`` (a YAML mapping of
    ``cluster.aws.AWSSpotConfig`` fields) with the command line's flags over them; the job id is
    the run folder's name (the tag on every instance). Started here: every check runs and the
    first instances are requested before the manager starts."""
    from .cluster.aws import AWSSpotConfig, AWSSpotProvider
    from .manager.runs import check_run_free, jobs_alive_beside
    from .runner import prepare_run

    settings = {**_aws_settings(cluster.aws_file), **cluster.aws}
    if not settings.get("region"):   # boto3's own default: AWS_DEFAULT_REGION or the profile's region
        settings["region"] = _boto3_region()
    for k in ("region", "instance_types", "ami"):
        settings.setdefault(k, "" if k != "instance_types" else ())
    config = AWSSpotConfig.from_dict(settings)
    run_dir = Path(cluster.run_dir).resolve()
    check_run_free(run_dir)   # a live job's instances are never adopted (nor terminated) by a second manager

    if cluster.job_id and cluster.job_id != run_dir.name:
        # reaping tells a live job by its run folder's lock, found by the job id on the tags
        raise ConfigError(f"--provider aws: the job id is the run folder's name ({run_dir.name!r}); drop "
                          f"--job-id {cluster.job_id} or name the run folder {cluster.job_id}")
    target = cluster.instances if cluster.instances is not None else job.launch.gpus
    _log_to_stderr("varuna_sdk.cluster.aws")   # each request, adoption, reaping and termination: a line
    try:
        provider = AWSSpotProvider(config, job_id=run_dir.name, target=target, endpoint_url=cluster.endpoint_url,
                                   job_alive=jobs_alive_beside(run_dir))
    except ValueError as e:   # a run folder name that cannot be a tag value
        raise ConfigError(f"--run-dir {run_dir}: {e}") from None
    prepare_run(job, run_dir)   # every check of the job and its run folder before an instance is billed
    return provider.start()


def _launch(args: argparse.Namespace) -> int:
    from .runner import launch_job

    job = JobConfig.from_yaml(Path(args.config)).validate()
    cluster = _cluster_config(args).validate()
    provider = None
    if cluster.local is not None:
        from .cluster.provider import LocalProvider

        provider = LocalProvider(cluster.local)
    elif cluster.hosts:
        from .cluster.hostfile import HostFileProvider

        try:
            provider = HostFileProvider(cluster.hosts)
        except FileNotFoundError as e:
            print(f"varuna: {e}", file=sys.stderr)
            return 2
    elif cluster.provider == "aws":
        from .cluster.aws import AWSConfigError, CapacityError
        from .manager.runs import RunBusy

        try:
            provider = _aws_provider(cluster, job)
        except (AWSConfigError, CapacityError, ConfigError, RunBusy) as e:
            print(f"varuna: {e}", file=sys.stderr)
            return 2
    from .manager.state import ManagerError

    try:
        summary = launch_job(job, run_dir=cluster.run_dir, provider=provider, job_id=cluster.job_id,
                             heartbeat_interval_s=cluster.heartbeat_interval_s, signals=True,
                             generation_options={"orphan_after_s": cluster.orphan_after_s})
    except ManagerError as e:   # another manager runs the folder; a job that cannot go on
        print(f"varuna: {e}", file=sys.stderr)
        return 2
    finally:
        if provider is not None:
            provider.close()
    print(f"[varuna] job {summary['job_id']}: {summary['state']} after {summary['generation'] + 1} generation(s), "
          f"{len(summary['morphs'])} morph(s); run folder {summary['run_dir']}", flush=True)
    from .manager.runs import morph_sentence

    for i, m in enumerate(summary["morphs"], 1):
        print(f"  morph {i}: {morph_sentence(m)}", flush=True)
    if summary["error"]:
        print(f"varuna: {summary['error']}", file=sys.stderr)
    if summary["state"] == "STOPPED":
        print(f"[varuna] stopped with a checkpoint; `varuna launch {args.config} --run-dir {summary['run_dir']}` "
              "continues the job", flush=True)
        return 130
    return 0 if summary["state"] == "SUCCEEDED" else 1


def _run_folder_command(args: argparse.Namespace) -> int:
    """``varuna status [RUN]``, ``varuna stop RUN``, ``varuna logs RUN``."""
    import time

    from .manager import runs

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


def _logs(args: argparse.Namespace, runs) -> int:
    """Print the run's worker output (or, with --events, its events in sentences); with --follow
    keep printing until the job has ended and nothing new came for a second."""
    import time

    from .manager.events import EventLog

    run = Path(args.run)
    runs.read_run(run)  # a run folder, or FileNotFoundError
    offsets: dict[Path, int] = {}
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
                    sys.stdout.write(chunk[:cut].decode("utf-8", "replace"))
                    sys.stdout.flush()
                    offsets[f] += cut
                    new += 1
        if not args.follow:
            return 0
        info = runs.read_run(run)
        if new or (info.active and not info.orphaned):
            quiet_since = None
        else:
            quiet_since = quiet_since or time.time()
            if time.time() - quiet_since > 1.0:
                return 0
        time.sleep(0.5)


def _spot_demo(job: JobConfig, args: argparse.Namespace) -> int:
    """``varuna demo``: the job under the morph manager on the spot emulator (``demo.run_spot_demo``);
    0 when it succeeded."""
    from .demo import print_spot_result, run_spot_demo
    from .runner import new_run_dir

    res = run_spot_demo(job, run_dir=Path(args.run_dir) if args.run_dir else new_run_dir(job))
    print_spot_result(res)
    return 0 if res.state == "SUCCEEDED" else 1


_EXAMPLES = {
    "train": "varuna train job.yaml\n  varuna train job.yaml --steps 200 --P 2 --D 2 --run-dir runs",
    "demo": "varuna demo\n  varuna demo --no-spot --steps 60",
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
    "launch": "varuna launch job.yaml --local 4 --run-dir runs/my-job\n"
              "  varuna launch job.yaml --hosts hosts.txt --run-dir runs/my-job\n"
              "  varuna launch job.yaml --run-dir runs/my-job   # again after a crash: continues the job",
}


def _subcommand(sub, name: str, help_: str, description: str) -> argparse.ArgumentParser:
    """A subcommand with its one-line help, its description and its examples (``_EXAMPLES``)."""
    return sub.add_parser(name, help=help_, description=description,
                          epilog="examples:\n  " + _EXAMPLES[name], formatter_class=argparse.RawDescriptionHelpFormatter)


def _parallel_overrides(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--steps", type=int, help="training steps (mini-batches) in all; overrides train.steps")
    sp.add_argument("--P", type=int, help="pipeline depth (stages); overrides parallel.P")
    sp.add_argument("--D", type=int, help="data-parallel width (replicas); overrides parallel.D")
    sp.add_argument("--global-batch", dest="global_batch", type=int,
                    help="examples per mini-batch, over all replicas; overrides parallel.global_batch")
    sp.add_argument("--micro-batch-size", dest="micro_batch_size", type=int,
                    help="examples per micro-batch; overrides parallel.micro_batch_size")
    sp.add_argument("--policy", choices=["varuna", "gpipe", "1f1b"],
                    help="pipeline schedule: varuna (opportunistic, recompute), gpipe or 1f1b")
    sp.add_argument("--run-dir", dest="run_dir",
                    help="the job's own folder, as for `varuna launch` (default: a new train.run_dir/NAME-TIME)")


def _add_train_demo_config(sub) -> None:
    """``varuna train``, ``varuna demo`` and ``varuna config``."""
    sp = _subcommand(sub, "train", "train a job from a YAML config on local workers",
                     "Train the job of a YAML config on P x D local worker processes (gloo on CPU, NCCL with GPUs), "
                     "under the manager; with P or D null the planner chooses them first.")
    sp.add_argument("config", help="path to a job YAML (see `varuna config`)")
    _parallel_overrides(sp)
    sp = _subcommand(sub, "demo", "train the demo GPT-2 on Shakespeare on emulated spot VMs",
                     "The demo job: GPT-2 on Shakespeare on emulated spot VMs replaying a real pre-emption trace, "
                     "morphing on each notice, loss and returning VM.")
    _parallel_overrides(sp)
    sp.add_argument("--no-spot", dest="no_spot", action="store_true",
                    help="train on a fixed set of local workers (no spot emulator, no morphs)")
    _subcommand(sub, "config", "print the demo job's YAML (a starting point for your own)",
                "Print the demo job's YAML with every field: copy it and change the model, the data and the sizes.")


def _add_calibrate_plan(sub) -> None:
    """``varuna calibrate`` and ``varuna plan``."""
    sp = _subcommand(sub, "calibrate", "measure the job's model once and save its profile (JSON)",
                     "Measure each cut-point segment's forward, recompute and backward time and memory at a few "
                     "micro-batch sizes, and this machine's network, once (paper section 4.3); cached.")
    sp.add_argument("config", nargs="?", help="job YAML (default: the demo job)")
    sp.add_argument("-o", "--output", help="where to write the profile (default: the profile cache)")
    sp.add_argument("--refresh", action="store_true", help="re-measure even if a cached profile exists")
    sp = _subcommand(sub, "plan", "rank every (P, D, micro-batch) for G GPUs with the simulator",
                     "Simulate every pipeline depth, replica count and micro-batch size for G GPUs from one "
                     "calibration and rank them by time per mini-batch (paper section 4); cost from the prices.")
    sp.add_argument("config", nargs="?", help="job YAML (default: the demo job)")
    sp.add_argument("--gpus", type=int, required=True, help="G, the GPUs (workers) available")
    sp.add_argument("--global-batch", dest="global_batch", type=int,
                    help="examples per mini-batch (default: the config's parallel.global_batch)")
    sp.add_argument("--profile", help="a profile JSON from `varuna calibrate` (default: calibrate/cache)")
    sp.add_argument("--gpus-per-vm", dest="gpus_per_vm", type=int, default=1,
                    help="GPUs on each VM (default 1): stages on one VM talk over its local links")
    sp.add_argument("--local", action="store_true",
                    help="plan local workers sharing this machine's cores (as `varuna train` runs them)")
    sp.add_argument("--policy", choices=["varuna", "gpipe", "1f1b"],
                    help="pipeline schedule to plan for (default: the config's parallel.policy)")
    sp.add_argument("--bandwidth-gbps", dest="bandwidth_gbps", type=float, help="what-if cross-VM bandwidth (Gbit/s)")
    sp.add_argument("--spot-price", dest="spot_price", type=float, help="$ per GPU-hour, spot")
    sp.add_argument("--on-demand-price", dest="on_demand_price", type=float, help="$ per GPU-hour, on-demand")
    sp.add_argument("--target-examples", dest="target_examples", type=int, help="show time and cost to this many examples")
    sp.add_argument("--top", type=int, default=12, help="rows of the ranked table to print (default 12)")
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


def _aws_flags(sp: argparse.ArgumentParser) -> None:
    """``varuna launch --provider aws``'s flags (``ClusterConfig.aws``)."""
    aws = sp.add_argument_group("AWS spot VMs (--provider aws); credentials come from boto3's standard chain only")
    aws.add_argument("--aws", metavar="FILE", help="YAML of AWS settings (region, instance_types, ami, subnets, ...)")
    aws.add_argument("--region", help="the EC2 region (e.g. us-east-1)")
    aws.add_argument("--instance-type", dest="instance_type", action="append", default=[],
                     help="an EC2 instance type; repeat for fallbacks, in order of preference")
    aws.add_argument("--ami", help="the AMI workers boot from (Python, torch and varuna-sdk installed)")
    aws.add_argument("--subnet", action="append", default=[], help="a subnet (one per zone to try, in order)")
    aws.add_argument("--security-group", dest="security_group",
                     help="security group id: SSH from this machine, all TCP between the job's VMs")
    aws.add_argument("--key-name", dest="key_name", help="the EC2 key pair instances get")
    aws.add_argument("--key-path", dest="key_path", help="its private key file, for SSH")
    aws.add_argument("--max-price", dest="max_price", type=float, help="US $ per instance-hour at most")
    aws.add_argument("--instances", type=int, help="spot instances to keep (default: launch.gpus)")
    aws.add_argument("--vm-user", dest="vm_user", help="SSH user on the AMI (default ubuntu)")
    aws.add_argument("--vm-python", dest="vm_python", help="Python on the AMI (default /usr/bin/python3)")
    aws.add_argument("--endpoint-url", dest="endpoint_url", help="another EC2 endpoint (an API emulator)")


def _add_launch(sub) -> None:
    """``varuna launch`` (its options become a ``ClusterConfig``)."""
    sp = _subcommand(sub, "launch", "run a job under the morph manager (local slots or an SSH host file); "
                     "run it again on the same --run-dir to continue the job",
                     "Run a job under the morph manager on local slots or the SSH VMs of a watched host file; "
                     "it re-plans and morphs when VMs are pre-empted or return. Run it again on the same --run-dir "
                     "to continue the job.")
    sp.add_argument("config", help="path to a job YAML (see `varuna config`)")
    sp.add_argument("--run-dir", dest="run_dir", help="the job's folder (an existing one is continued)")
    where = sp.add_mutually_exclusive_group()
    where.add_argument("--local", type=int, metavar="N", help="N local worker slots (default: launch.gpus)")
    where.add_argument("--hosts", metavar="FILE", help="SSH host file (watched; see cluster.hostfile)")
    where.add_argument("--provider", choices=["aws"], help="spot VMs from a cloud: aws (EC2, boto3; see cluster.aws)")
    _aws_flags(sp)
    sp.add_argument("--job-id", dest="job_id", help="the job's id in the event log (default: made from the name)")
    sp.add_argument("--heartbeat", type=float, default=2.0, help="heartbeat interval, seconds (default 2)")
    sp.add_argument("--orphan-after", dest="orphan_after", type=float, default=60.0,
                    help="workers that lose the manager this long stop at a boundary with a checkpoint (s)")


def _add_run_folder_commands(sub) -> None:
    """``varuna status``, ``varuna stop`` and ``varuna logs``."""
    sp = _subcommand(sub, "status", "show every job of a folder of runs, or one run: state, plan, progress, ETA",
                     "A table of the jobs in a folder of runs (default: runs/), or one run folder: state, plan, "
                     "step of the total, elapsed, ETA, morphs, the last event; for one run also every morph in a "
                     "sentence.")
    sp.add_argument("run", nargs="?", default="runs", help="a run folder, or a folder of runs (default: runs)")
    sp = _subcommand(sub, "stop", "stop a running job at the next mini-batch boundary, with a checkpoint",
                     "Ask the manager of a run to stop the job at the next mini-batch boundary with a checkpoint "
                     "(as job.stop() does); `varuna launch` on the same folder continues it.")
    sp.add_argument("run", help="the job's run folder")
    sp.add_argument("--wait", type=float, default=0.0,
                    help="wait up to this many seconds for the job to reach STOPPED (default: do not wait)")
    sp = _subcommand(sub, "logs", "print a run's worker output and events (--follow: as they come)",
                     "Print the output of every worker of a run, generation by generation, each generation "
                     "headed by its plan and followed by how it ended; --events prints the event log in "
                     "sentences instead.")
    sp.add_argument("run", help="the job's run folder")
    sp.add_argument("--follow", "-f", action="store_true", help="keep printing new lines until the job ends")
    sp.add_argument("--events", action="store_true", help="the event log in sentences instead of worker output")


def build_parser() -> argparse.ArgumentParser:
    """The ``varuna`` command line: every subcommand with a description, examples and help for
    every flag."""
    from . import __version__

    parser = argparse.ArgumentParser(prog="varuna", description="Pipeline x data parallel training of your own "
                                     "PyTorch model on spot VMs that come and go (after Varuna, arXiv 2111.04007).")
    parser.add_argument("--version", action="version", version=f"varuna-sdk {__version__}")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    for add in (_add_train_demo_config, _add_calibrate_plan, _add_dashboard, _add_launch, _add_run_folder_commands):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """``varuna ARGS``; returns the exit code: 0 done, 1 the job failed, 2 bad input, 130 interrupted."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.cmd == "launch":
            return _launch(args)
        if args.cmd in ("status", "stop", "logs"):
            return _run_folder_command(args)
        if args.cmd == "config":
            print(demo_config().to_yaml(), end="")
            return 0
        if args.cmd in ("calibrate", "plan"):
            return _calibrate_or_plan(args)
        if args.cmd == "dashboard":
            try:
                return _dashboard(args)
            except (FileNotFoundError, PermissionError) as e:
                print(f"varuna: {e}", file=sys.stderr)
                return 2
            except OSError as e:  # the port is taken, the address is not ours
                print(f"varuna: cannot serve on {args.address}:{args.port}: {e.strerror or e}; pick another "
                      "--port or --address", file=sys.stderr)
                return 2
        if args.cmd == "demo":
            from .demo import SPOT_DEMO_STEPS

            job = demo_config(120 if args.no_spot else SPOT_DEMO_STEPS)
        else:
            job = JobConfig.from_yaml(Path(args.config))
        job = _apply_overrides(job, args).validate()
        if args.cmd == "demo" and not args.no_spot:
            return _spot_demo(job, args)
        from .pipeline.spawn import WorkerFailure
        from .runner import JobStopped, train_local

        try:
            result = train_local(job, run_dir=args.run_dir, signals=True)
        except JobStopped as e:
            print(f"[varuna] {e}", file=sys.stderr)
            return 130
        except WorkerFailure as e:
            print(f"varuna: training failed: {e}", file=sys.stderr)
            for rank, (code, tb) in sorted(e.failures.items()):
                if tb:
                    print(f"--- rank {rank} (exit {code}) ---\n{tb}", file=sys.stderr)
            return 1
        print(f"[varuna] run folder: {result.run_dir} (metrics.jsonl, summary.json, config.yaml)")
        return 0
    except (ConfigError, ValueError, ShippingError) as e:
        print(f"varuna: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("varuna: interrupted; all workers stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
