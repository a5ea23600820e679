"""``varuna calibrate [CONFIG]`` and ``varuna plan [CONFIG] --gpus G``: measure the job's model
once (``profiling.job.calibrate_job``) and rank every (P, D, micro-batch) for G GPUs with the
simulator (``planner.plan``), refusing a profile measured on another model or other inputs.

Imports ``config`` and ``demo`` at the top; ``profiling``, ``planner`` and ``trainer`` only inside
the commands (``varuna --help`` stays fast). Never imports the dashboard.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from ..config import MAX_GPUS, ConfigError, JobConfig
from ..demo import demo_config


def calibrate_or_plan(args: argparse.Namespace) -> int:
    """``varuna calibrate`` (writes the profile) or ``varuna plan`` (prints the ranked table, and the
    best plan that keeps the config's P, D or stages when it fixes them). Returns the exit code:
    0, or 1 when no configuration fits. Raises ``ConfigError`` for a bad flag (a ``calibrate -o``
    path that cannot be written is refused before measuring), or a profile that is missing,
    unreadable, not a profile, or measured on another model or other inputs."""
    if args.cmd == "plan":
        _check_plan_flags(args)   # before torch is imported: a bad flag is answered at once
    elif args.output is not None:
        check_output_path(args.output)   # before the calibration: not a traceback after it
    from ..profiling.job import calibrate_job

    # every field checked, as `varuna train` does, before a calibration or a plan
    job = (JobConfig.from_yaml(Path(args.config)) if args.config else demo_config()).validate()
    if args.cmd == "calibrate":
        import time

        t0 = time.time()
        prof = calibrate_job(job, refresh=args.refresh)
        if args.output:
            try:
                prof.to_json(args.output)
            except OSError as e:
                raise ConfigError(f"cannot write the profile to -o {args.output}: {e.strerror or e}") from None
        cached = bool(prof.calibrated_at) and prof.calibrated_at < t0
        when = (f"the cached calibration of {time.strftime('%Y-%m-%d %H:%M', time.localtime(prof.calibrated_at))} "
                f"(it took {prof.calibration_s:.1f} s; --refresh measures again)" if cached
                else f"calibrated in {prof.calibration_s:.1f} s")
        print(f"[varuna] {prof.num_segments} segments at micro-batch sizes {prof.micro_batch_sizes}: {when}"
              + (f"; wrote {args.output}" if args.output else ""))
        return 0
    from ..planner.plan import config_settings, data_prefetch_for, plan
    from ..planner.rows import CLI_HINTS

    prof = load_profile(args.profile, args.config) if args.profile else calibrate_job(job)
    _check_profile_matches(prof, job, args.profile, args.config)
    G, B = args.gpus, args.global_batch or job.parallel.global_batch
    par = job.parallel
    placement, where = _placement(args, G)
    # the config's recompute, split backward and in-flight ceiling, as `varuna train` plans them
    common = dict(**config_settings(par, args.policy),
                  network_bandwidth_Bps=args.bandwidth_gbps * 1e9 / 8 if args.bandwidth_gbps else None,
                  memory_limit_bytes=args.memory_gib * 2**30 if args.memory_gib is not None else None,
                  prices=_prices(args), target_examples=args.target_examples, data_prefetch=data_prefetch_for(job, prof),
                  **placement)
    pl = plan(prof, G, B, exhaustive=not args.best_only, **common)
    said = [_refine_row(pl, depth, args.best_only) for depth in args.refine or []]
    print(pl.table(top=args.top, hints=CLI_HINTS))
    for line in said:
        print(f"  {line}")
    print(f"placement: {where}")
    if not pl.feasible:
        print(f"varuna: no configuration fits {G} GPUs and global batch {B}; see the reasons above", file=sys.stderr)
        return 1
    if par.P is not None or par.D is not None or par.boundaries:
        # the config fixes the depth, the width or the stages: the run `varuna train` would make
        return _plan_keeping_config(prof, par, pl, G, B, common)
    return 0


def check_output_path(path: str) -> None:
    """``varuna calibrate -o PATH``: a file that can be written — its folder exists and is writable
    and ``PATH`` is no folder (nor, existing, read-only). Raises ``ConfigError`` naming what is in
    the way; nothing is written."""
    p = Path(path)
    parent = p.parent
    if not path.strip() or p.is_dir():
        why = "is empty" if not path.strip() else "is a folder"
        raise ConfigError(f"-o {path!r} {why}; give the path of the profile file to write, e.g. -o "
                          f"{p / 'profile.json' if path.strip() else 'profile.json'}")
    from ..runner import file_in_the_way

    nearest = file_in_the_way(parent)
    if nearest is not None:
        raise ConfigError(f"-o {path}: {nearest} is a file, not a folder; give a path in a folder")
    if not parent.is_dir():
        raise ConfigError(f"-o {path}: the folder {parent} does not exist; make it first (mkdir -p {parent}) or "
                          "give a path in an existing folder")
    if not os.access(parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        what = f"the file {p}" if p.exists() and not os.access(p, os.W_OK) else f"the folder {parent}"
        raise ConfigError(f"-o {path}: {what} is not writable; give a path you can write")


def load_profile(path: str, config: str | None):
    """``varuna plan --profile PATH``: the ``Profile`` in that file. Raises ``ConfigError`` naming
    the file, why it cannot be used (not JSON, not a profile, another version, an entry missing)
    and the command that makes one (``varuna calibrate CONFIG -o PATH``)."""
    from ..profiling.profile import Profile

    make = f"make one with `varuna calibrate {config + ' ' if config else ''}-o {path}`"
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--profile {path}: cannot be read ({getattr(e, 'strerror', None) or e}); {make}") from None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"--profile {path} is not JSON ({e}): a profile is the JSON file `varuna calibrate` "
                          f"writes; {make}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--profile {path} holds a JSON {type(data).__name__}, not a profile (an object); {make}")
    try:
        return Profile.from_dict(data)
    except ValueError as e:   # ProfileError: another version, an entry missing or malformed
        why = str(e).removesuffix("; re-run calibrate()")
        raise ConfigError(f"--profile {path}: {why}; {make}") from None


def _refine_row(pl, depth: int, best_only: bool) -> str:
    """``--refine P``: refine the plan's row of depth P per stage (``Plan.refine``) and say what
    came of it — its recompute and time against the row as searched, that it was refined already,
    or why it still does not fit. Raises ``ConfigError`` for a depth the plan has no row of."""
    from ..planner.rows import format_duration

    before = next((r for r in pl.rows if r.P == depth), None)
    if before is not None and before.pruned and best_only:
        raise ConfigError(f"--refine {depth}: P={depth} was pruned by --best-only (never simulated, nothing to "
                          "refine); leave out --best-only to simulate every depth")
    try:
        row = pl.refine(depth)
    except ValueError as e:
        raise ConfigError(f"--refine {depth}: {e}") from None
    if before.refined:
        return (f"--refine {depth}: the row of P={depth} was refined per stage already (recompute "
                f"{row.recompute_label}{', ' + format_duration(row.time_s) if row.feasible else ''})")
    if not row.feasible:
        return f"--refine {depth}: refined per stage (in-flight caps tried), P={depth} still does not fit: {row.reason}"
    return (f"--refine {depth}: refined per stage: recompute {row.recompute_label}, {format_duration(row.time_s)} "
            f"per mini-batch (as searched: {before.recompute_label}, {format_duration(before.time_s)})")


def _check_plan_flags(args: argparse.Namespace) -> None:
    """``varuna plan``'s flags: the profile file exists, counts >= 1, ``--gpus`` at most ``MAX_GPUS``
    and (VMs) a multiple of ``--gpus-per-vm``, bandwidth > 0 and prices >= 0 (finite). Raises
    ``ConfigError`` naming the flag."""
    if args.profile and not Path(args.profile).is_file():
        raise ConfigError(f"profile file {args.profile!r} does not exist; make it with `varuna calibrate "
                          f"{args.config + ' ' if args.config else ''}-o {args.profile}`, or leave out --profile "
                          "to calibrate now")
    for flag, value in (("--gpus", args.gpus), ("--global-batch", args.global_batch), ("--gpus-per-vm", args.gpus_per_vm),
                        ("--target-examples", args.target_examples), ("--top", args.top)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} {value} must be >= 1")
    if not args.local and args.gpus % args.gpus_per_vm:
        n = args.gpus_per_vm
        near = " or ".join(str(k * n) for k in (args.gpus // n, args.gpus // n + 1) if k)
        raise ConfigError(f"--gpus {args.gpus} is not a multiple of --gpus-per-vm {n}: the plan places --gpus on "
                          f"whole VMs of {n} GPUs, which give {near}. Give --gpus as the VMs times their GPUs, or "
                          "--gpus-per-vm as the GPUs of each VM that the job uses")
    if args.local and args.per_pair_links:
        raise ConfigError("--per-pair-links applies to VMs; --local workers talk over this machine's loopback. Leave "
                          "out one of the two")
    if args.gpus > MAX_GPUS:
        raise ConfigError(f"--gpus {args.gpus} is more than the planner searches ({MAX_GPUS}); plan at most {MAX_GPUS} "
                          "GPUs")
    for flag, value in (("--bandwidth-gbps", args.bandwidth_gbps), ("--memory-gib", args.memory_gib),
                        ("--spot-price", args.spot_price),
                        ("--on-demand-price", args.on_demand_price)):
        if value is not None and not (math.isfinite(value) and (value >= 0 if flag.endswith("price") else value > 0)):
            raise ConfigError(f"{flag} {value} must be a finite number {'>= 0' if flag.endswith('price') else '> 0'}")


def _prices(args: argparse.Namespace):
    """The planner's ``Prices``: the example prices, or ``--spot-price``/``--on-demand-price`` over them."""
    from ..planner.rows import Prices

    prices = Prices()
    if args.spot_price is not None or args.on_demand_price is not None:
        prices = Prices(spot_per_gpu_hour=args.spot_price if args.spot_price is not None else prices.spot_per_gpu_hour,
                        on_demand_per_gpu_hour=(args.on_demand_price if args.on_demand_price is not None
                                                else prices.on_demand_per_gpu_hour), vm_type="user prices", example=False)
    return prices


def _placement(args: argparse.Namespace, G: int) -> tuple[dict, str]:
    """Where the ``G`` workers run, as ``plan``'s keyword arguments, and the same in words."""
    if args.local:  # as `varuna train` runs: every worker a local process sharing this machine's cores
        placement = dict(gpus_per_vm=G, compute_slots_per_vm=os.cpu_count() or 1)
        where = f"{G} local workers sharing this machine's {os.cpu_count() or 1} cores (as `varuna train` runs them)"
    else:  # as the manager plans VMs: a worker's sends to both neighbours leave its VM by one link
        placement = dict(gpus_per_vm=args.gpus_per_vm, shared_egress=not args.per_pair_links)
        where = (f"{args.gpus_per_vm} GPU(s) per VM, one worker per GPU, "
                 + ("a network link per pair of neighbouring workers" if args.per_pair_links else
                    "each worker's activations and gradients leaving its VM by one link (--per-pair-links: one per "
                    "neighbour)")
                 + "; pass --local to plan local workers sharing this machine's cores, as `varuna train` runs them")
    return placement, where


def _plan_keeping_config(prof, par, pl, G: int, B: int, common: dict) -> int:
    """The best plan that keeps the config's ``parallel.P``/``D``/``boundaries`` and, when set,
    ``micro_batch_size`` (the run ``varuna train`` would make), printed beside the best plan
    ``pl``; 1 when none can keep them."""
    from ..planner.plan import plan

    fixed = {k: v for k, v in (("P", par.P), ("D", par.D), ("micro_batch_size", par.micro_batch_size))
             if v is not None}
    what = ", ".join(f"parallel.{k}={v}" for k, v in fixed.items()) + (", parallel.boundaries" if par.boundaries else "")
    if par.D is not None and (par.D > G or B % par.D):
        print(f"varuna: parallel.D={par.D} from the config does not fit --gpus {G} and global batch {B} (D must "
              "be at most the GPUs and divide the global batch); set D to null to let the planner choose",
              file=sys.stderr)
        return 1
    try:
        kept = plan(prof, G, B, max_depth=None if par.boundaries else par.P, replicas=par.D,
                    boundaries=par.boundaries,
                    micro_batch_sizes=[par.micro_batch_size] if par.micro_batch_size is not None else None, **common)
    except ConfigError as e:
        print(f"varuna: {what} from the config cannot be kept with --gpus {G}: {e}", file=sys.stderr)
        return 1
    if par.P is not None and any(r.P == par.P for r in kept.rows):
        kept.refine(par.P)  # the depth the config keeps: refined per stage even when it is not the best
    rows = [r for r in kept.feasible if (par.P is None or r.P == par.P) and (par.D is None or r.D == par.D)
            and (par.micro_batch_size is None or r.micro_batch_size == par.micro_batch_size)]
    if not rows:
        why = "; ".join(dict.fromkeys(f"P={r.P}: {r.reason}" for r in kept.excluded
                                      if (par.P is None or r.P == par.P) and r.reason))
        if par.P is not None and par.P > prof.num_segments:
            why = (f"the model has {prof.num_segments} segments (cut-points + 1), so P is at most "
                   f"{prof.num_segments}" + (f"; {why}" if why else ""))
        if par.P is not None and par.P * (par.D or 1) > G:
            why = (f"P={par.P}{f' x D={par.D}' if par.D else ''} needs {par.P * (par.D or 1)} GPUs, more than "
                   f"--gpus {G}" + (f"; {why}" if why else ""))
        print(f"varuna: no feasible plan keeps {what} from the config" + (f" ({why})" if why else "")
              + "; set them to null to let the planner choose, or change them", file=sys.stderr)
        return 1
    from ..planner.rows import format_duration

    r = rows[0]
    print(f"with {what} from the config: P={r.P} D={r.D} micro-batch {r.micro_batch_size} (m={r.m}), "
          f"{format_duration(r.time_s)} per mini-batch, {r.examples_per_s:.1f} examples/s "
          f"({r.time_s / pl.best.time_s:.2f}x the best plan's time)")
    return 0


def _check_profile_matches(prof, job: JobConfig, path: str | None, config: str | None) -> None:
    """A profile measured on another model, or on other inputs (another sequence length, image size,
    dtype or precision: ``profiling.job.profile_misfit``), would plan the wrong thing: refuse it,
    naming the difference and the calibration to run. A profile file (``path``) of the same model and
    inputs is reused, its data reads timed again on this job's data (another dataset of the same
    shapes may read slower), as a cached calibration's are. Raises ``ConfigError``."""
    import warnings

    from ..profiling.job import measure_data_read, profile_misfit
    from ..trainer import model_structure, resolve

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
    misfit = profile_misfit(prof, job, r)
    if misfit:
        raise ConfigError(f"profile {path or ''} was measured on other inputs than this job's: " + "; ".join(misfit)
                          + "; its compute and memory figures are not this job's (the plan's times would be off)"
                          + fix)
    if not path:
        return
    if isinstance(measured, dict) and "inputs" not in prof.model:
        warnings.warn(f"profile {path} does not record the input shapes it was measured on (an older calibration), "
                      "so they cannot be checked: if it was made from a job with other inputs (another sequence "
                      "length, image size or precision), its times are not this job's; calibrate this job with "
                      f"`varuna calibrate {config + ' ' if config else ''}-o PROFILE.json`", stacklevel=2)
    if isinstance(measured, dict) or prof.data_read_s:
        prof.data_read_s, prof.data_draws_random = measure_data_read(r, job.data.seq_len)
