"""``varuna launch --provider aws``: its flags (``aws_flags``), the settings file and flags merged
into a started ``cluster.aws.AWSSpotProvider`` (``aws_provider``), boto3's default region.

Imports ``config`` at the top; ``cluster.aws``, ``manager.runs``, ``runner``, ``boto3`` and
``yaml`` only inside the functions that need them (``varuna --help`` stays fast). Never imports
the dashboard.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..config import ClusterConfig, ConfigError, JobConfig


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


def aws_provider(cluster: ClusterConfig, job: JobConfig):
    """``--provider aws``: the settings of ``--aws FILE`` (a YAML mapping of
    ``cluster.aws.AWSSpotConfig`` fields) with the command line's flags over them; the job id is
    the run folder's name (the tag on every instance). Started here: every check runs and the
    first instances are requested before the manager starts."""
    from ..cluster.aws import AWSSpotConfig, AWSSpotProvider
    from ..manager.runs import check_run_free, jobs_alive_beside
    from ..runner import prepare_run

    settings = {**_aws_settings(cluster.aws_file), **cluster.aws}
    if not settings.get("region"):   # boto3's own default: AWS_DEFAULT_REGION or the profile's region
        settings["region"] = _boto3_region()
    for k in ("region", "instance_types", "ami"):
        settings.setdefault(k, "" if k != "instance_types" else ())
    config = AWSSpotConfig.from_dict(settings)
    run_dir = Path(cluster.run_dir).resolve()
    check_run_free(run_dir)   # a live job's instances are never adopted (nor terminated) by a second manager
    # (--job-id is the run folder's name, ``ClusterConfig.validate``: reaping tells a live job by its run
    # folder's lock, found by the job id on the instances' tags)
    target = cluster.instances if cluster.instances is not None else job.launch.gpus
    _log_to_stderr("varuna_sdk.cluster.aws")   # each request, adoption, reaping and termination: a line
    try:
        provider = AWSSpotProvider(config, job_id=run_dir.name, target=target, endpoint_url=cluster.endpoint_url,
                                   job_alive=jobs_alive_beside(run_dir))
    except ValueError as e:   # a run folder name that cannot be a tag value
        raise ConfigError(f"--run-dir {run_dir}: {e}") from None
    prepare_run(job, run_dir)   # every check of the job and its run folder before an instance is billed
    return provider.start()


def aws_flags(sp: argparse.ArgumentParser) -> None:
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
