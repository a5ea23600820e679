"""``varuna launch CONFIG``: its options as a ``ClusterConfig``, a provider for where the workers
run (local slots, a watched SSH host file, or AWS spot VMs through ``cli.aws``), the job under
the morph manager (``runner.launch_job``) and its summary.

Imports ``config`` and ``cli.aws`` at the top; ``runner``, ``cluster`` and ``manager`` only inside
``launch_command`` (``varuna --help`` stays fast). Never imports the dashboard.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..config import ClusterConfig, ConfigError, JobConfig
from .aws import aws_provider
from .parser import again_command
from .runs import stopped_exit_code


def _cluster_config(args: argparse.Namespace) -> ClusterConfig:
    """``varuna launch``'s options as a ``ClusterConfig`` (not yet validated)."""
    aws = {"region": args.region, "instance_types": args.instance_type, "ami": args.ami, "subnets": args.subnet,
           "security_group": args.security_group, "key_name": args.key_name, "key_path": args.key_path,
           "max_price": args.max_price, "user": args.vm_user, "python": args.vm_python}
    return ClusterConfig(local=args.local, hosts=args.hosts, provider=args.provider, aws_file=args.aws,
                         aws={k: v for k, v in aws.items() if v not in (None, [])}, instances=args.instances,
                         endpoint_url=args.endpoint_url, run_dir=args.run_dir, job_id=args.job_id,
                         heartbeat_interval_s=args.heartbeat, orphan_after_s=args.orphan_after)


def _say(line: str) -> None:
    """The console's line of an event (``manager.runs.Narrator``), beside the workers' output."""
    print(line, flush=True)


def launch_command(args: argparse.Namespace) -> int:
    """``varuna launch CONFIG``: the job under the morph manager until it ends; returns the exit code
    (``cli.parser.EXIT_STATUS``: 0 succeeded or stopped by ``varuna stop``, 1 failed, 2 bad input or
    the run folder is busy, 130 stopped by Ctrl-C, 143 by SIGTERM)."""
    from ..runner import launch_job

    job = JobConfig.from_yaml(Path(args.config)).validate()
    cluster = _cluster_config(args).validate()
    provider = None
    if cluster.local is not None:
        from ..cluster.provider import LocalProvider

        provider = LocalProvider(cluster.local)
    elif cluster.hosts:
        from ..cluster.hostfile import HostFileProvider

        try:
            provider = HostFileProvider(cluster.hosts)
        except FileNotFoundError as e:
            print(f"varuna: {e}", file=sys.stderr)
            return 2
    elif cluster.provider == "aws":
        from ..cluster.aws import AWSConfigError, CapacityError
        from ..manager.runs import RunBusy

        try:
            provider = aws_provider(cluster, job)
        except (AWSConfigError, CapacityError, ConfigError, RunBusy) as e:
            print(f"varuna: {e}", file=sys.stderr)
            return 2
    from ..manager.state import ManagerError

    try:
        summary = launch_job(job, run_dir=cluster.run_dir, provider=provider, job_id=cluster.job_id,
                             heartbeat_interval_s=cluster.heartbeat_interval_s, signals=True, narrate=_say,
                             generation_options={"orphan_after_s": cluster.orphan_after_s})
    except ManagerError as e:   # another manager runs the folder; a job that cannot go on
        print(f"varuna: {e}", file=sys.stderr)
        return 2
    finally:
        if provider is not None:
            provider.close()
    if summary.get("ended_before"):
        print(f"[varuna] job {summary['job_id']} had already ended ({summary['state']}) in {summary['run_dir']}; "
              "nothing ran. Give a new --run-dir to run it again.", flush=True)
        return 0 if summary["state"] == "SUCCEEDED" else 1
    print(f"[varuna] job {summary['job_id']}: {summary['state']} after {summary['generation'] + 1} generation(s), "
          f"{len(summary['morphs'])} morph(s); run folder {summary['run_dir']}", flush=True)
    from ..manager.runs import morph_sentence

    for i, m in enumerate(summary["morphs"], 1):
        print(f"  morph {i}: {morph_sentence(m)}", flush=True)
    if summary["error"]:
        print(f"varuna: {summary['error']}", file=sys.stderr)
    if summary["state"] == "STOPPED":
        again = again_command(getattr(args, "argv", ["launch", args.config]), summary["run_dir"])
        from ..runner import stopped_sentence

        said = stopped_sentence(summary["run_dir"], summary.get("last_step"), summary.get("checkpoint_steps"))
        print(f"[varuna] {said}; `{again}` continues the job", flush=True)
        return stopped_exit_code(summary["run_dir"])
    return 0 if summary["state"] == "SUCCEEDED" else 1
