"""The ``varuna`` command: ``varuna train CONFIG.yaml``, ``varuna demo``, ``varuna config``.

Owns argument parsing and turning ``ConfigError``/``WorkerFailure`` into one clear line and a
non-zero exit. Sits at the top of the dependency graph.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .config import ConfigError, JobConfig, ModelConfig, ParallelConfig, TrainConfig


def demo_config(steps: int = 120) -> JobConfig:
    """The main job: a 4-layer GPT-2 (d=128, real 50,257-token BPE) on Shakespeare, P=2 × D=2."""
    return JobConfig(
        name="gpt2-shakespeare-demo",
        model=ModelConfig(preset="cpu-demo", dropout=0.0),
        parallel=ParallelConfig(P=2, D=2, global_batch=16, micro_batch_size=2, policy="varuna"),
        train=TrainConfig(steps=steps, lr=2e-3, min_lr=2e-4, warmup_steps=10, eval_batches=4),
    )


def _apply_overrides(job: JobConfig, args: argparse.Namespace) -> JobConfig:
    for field_name in ("P", "D", "global_batch", "micro_batch_size", "policy"):
        v = getattr(args, field_name, None)
        if v is not None:
            setattr(job.parallel, field_name, v)
    if getattr(args, "steps", None) is not None:
        job.train.steps = args.steps
    if getattr(args, "run_dir", None):
        job.train.run_dir = args.run_dir
    return job


def _calibrate_or_plan(args: argparse.Namespace) -> int:
    from .trainer import calibrate_job

    job = JobConfig.from_yaml(Path(args.config)) if args.config else demo_config()
    if args.cmd == "calibrate":
        prof = calibrate_job(job, refresh=args.refresh)
        if args.output:
            prof.to_json(args.output)
        print(f"[varuna] calibrated {prof.num_segments} segments at micro-batch sizes {prof.micro_batch_sizes} "
              f"in {prof.calibration_s:.1f} s" + (f"; wrote {args.output}" if args.output else ""))
        return 0
    from .planner.plan import Prices, plan
    from .profiling.profile import Profile

    if args.profile and not Path(args.profile).is_file():
        raise ConfigError(f"profile file {args.profile!r} does not exist; make it with `varuna calibrate "
                          f"{args.config + ' ' if args.config else ''}-o {args.profile}`, or leave out --profile "
                          "to calibrate now")
    prof = Profile.load(args.profile) if args.profile else calibrate_job(job)
    prices = Prices()
    if args.spot_price is not None or args.on_demand_price is not None:
        prices = Prices(spot_per_gpu_hour=args.spot_price if args.spot_price is not None else prices.spot_per_gpu_hour,
                        on_demand_per_gpu_hour=(args.on_demand_price if args.on_demand_price is not None
                                                else prices.on_demand_per_gpu_hour), vm_type="user prices", example=False)
    pl = plan(prof, args.gpus, args.global_batch or job.parallel.global_batch, policy=args.policy or job.parallel.policy,
              gpus_per_vm=args.gpus_per_vm,
              network_bandwidth_Bps=args.bandwidth_gbps * 1e9 / 8 if args.bandwidth_gbps else None,
              prices=prices, target_examples=args.target_examples)
    print(pl.table(top=args.top))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="varuna", description="Pipeline x data parallel training (Varuna)")
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name, help_ in (("train", "train a job from a YAML config"), ("demo", "train the demo GPT-2 on Shakespeare")):
        sp = sub.add_parser(name, help=help_)
        if name == "train":
            sp.add_argument("config", help="path to a job YAML (see `varuna config`)")
        sp.add_argument("--steps", type=int)
        sp.add_argument("--P", type=int, help="pipeline depth (stages)")
        sp.add_argument("--D", type=int, help="data-parallel width (replicas)")
        sp.add_argument("--global-batch", dest="global_batch", type=int)
        sp.add_argument("--micro-batch-size", dest="micro_batch_size", type=int)
        sp.add_argument("--policy", choices=["varuna", "gpipe", "1f1b"])
        sp.add_argument("--run-dir", dest="run_dir")
    sub.add_parser("config", help="print the demo job's YAML (a starting point for your own)")
    sp = sub.add_parser("calibrate", help="measure the job's model once and save its profile (JSON)")
    sp.add_argument("config", nargs="?", help="job YAML (default: the demo job)")
    sp.add_argument("-o", "--output", help="where to write the profile (default: the profile cache)")
    sp.add_argument("--refresh", action="store_true", help="re-measure even if a cached profile exists")
    sp = sub.add_parser("plan", help="rank every (P, D, micro-batch) for G GPUs with the simulator")
    sp.add_argument("config", nargs="?", help="job YAML (default: the demo job)")
    sp.add_argument("--gpus", type=int, required=True, help="G, the GPUs (workers) available")
    sp.add_argument("--global-batch", dest="global_batch", type=int)
    sp.add_argument("--profile", help="a profile JSON from `varuna calibrate` (default: calibrate/cache)")
    sp.add_argument("--gpus-per-vm", dest="gpus_per_vm", type=int, default=1)
    sp.add_argument("--policy", choices=["varuna", "gpipe", "1f1b"])
    sp.add_argument("--bandwidth-gbps", dest="bandwidth_gbps", type=float, help="what-if cross-VM bandwidth (Gbit/s)")
    sp.add_argument("--spot-price", dest="spot_price", type=float, help="$ per GPU-hour, spot")
    sp.add_argument("--on-demand-price", dest="on_demand_price", type=float, help="$ per GPU-hour, on-demand")
    sp.add_argument("--target-examples", dest="target_examples", type=int, help="show time and cost to this many examples")
    sp.add_argument("--top", type=int, default=12)
    args = parser.parse_args(argv)
    try:
        if args.cmd == "config":
            print(demo_config().to_yaml(), end="")
            return 0
        if args.cmd in ("calibrate", "plan"):
            return _calibrate_or_plan(args)
        job = demo_config() if args.cmd == "demo" else JobConfig.from_yaml(Path(args.config))
        job = _apply_overrides(job, args).validate()
        from .cluster.local import WorkerFailure
        from .launch import train_local

        try:
            result = train_local(job)
        except WorkerFailure as e:
            print(f"varuna: training failed: {e}", file=sys.stderr)
            for rank, (code, tb) in sorted(e.failures.items()):
                if tb:
                    print(f"--- rank {rank} (exit {code}) ---\n{tb}", file=sys.stderr)
            return 1
        print(f"[varuna] run folder: {result.run_dir} (metrics.jsonl, summary.json, config.yaml)")
        return 0
    except (ConfigError, ValueError) as e:
        print(f"varuna: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("varuna: interrupted; all workers stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
