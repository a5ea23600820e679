"""A manager on AWS spot instances in its own process, for the test that SIGKILLs it and starts it
again: ``varuna launch --provider aws``'s own path (``AWSSpotProvider`` checked and started first,
reaping by run-folder locks, then ``launch.launch_job`` with signals), except that instances are
reached through the test's ``Backing`` registry (moto's instances have no real addresses) —
which ``varuna launch`` cannot be told, hence this child. Credentials come from the environment
the test set (boto3's standard chain).

Run: ``python tests/_aws_manager.py JOB.yaml RUN_DIR ENDPOINT REGISTRY AMI KEY_PATH USER INSTANCES``.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ec2_cloud import REGION, registry_reach  # noqa: E402
from varuna_sdk.cluster.aws import AWSSpotConfig, AWSSpotProvider  # noqa: E402
from varuna_sdk.config import JobConfig  # noqa: E402
from varuna_sdk.runner import launch_job  # noqa: E402
from varuna_sdk.manager.runs import check_run_free, jobs_alive_beside  # noqa: E402


def main(argv: list[str]) -> int:
    job_yaml, run_dir, endpoint, registry, ami, key_path, user, instances = argv
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("varuna_sdk.cluster.aws").setLevel(logging.INFO)   # adoptions, requests, terminations
    job = JobConfig.from_yaml(Path(job_yaml)).validate()
    run = Path(run_dir)
    check_run_free(run)
    cfg = AWSSpotConfig(region=REGION, instance_types=("c5.large",), ami=ami, user=user, python=sys.executable,
                        key_path=Path(key_path), on_demand_per_hour=0.085)
    provider = AWSSpotProvider(cfg, job_id=run.name, target=int(instances), endpoint_url=endpoint,
                               reach=registry_reach(registry), job_alive=jobs_alive_beside(run), poll_s=1.0).start()
    try:
        summary = launch_job(job, run_dir=run, provider=provider, heartbeat_interval_s=0.5, signals=True,
                             stop_timeout_s=60.0, grow=None, straggler=None, drift=None,
                             generation_options={"orphan_after_s": 1.5, "remote_run_dir": str(run), "sink": None})
    finally:
        provider.close()
    print(f"[aws-manager] job {summary['job_id']}: {summary['state']} {summary['error'] or ''}", flush=True)
    return 0 if summary["state"] == "SUCCEEDED" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
