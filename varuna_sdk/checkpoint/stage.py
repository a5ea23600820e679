"""Per-layer checkpoints of one pipeline stage: what a rank saves, what it loads under any stage
map, and the agreement of all ranks on which checkpoint to resume from.

Owns ``StageCheckpointer`` and the write plan (``plan_writes``). Every parameter (and buffer)
belongs to the first cut-point segment that uses it and is saved with its AdamW state under its
canonical name in files of that segment (``seg-00003-r0005.pt``: segment 3, written by rank 5),
so a stage of *any* stage map loads exactly the files holding its names (paper §4.2, §4.5). The
writing is shared by every rank that holds a tensor — the D replicas of its stage and, for tied
weights, the other stages holding a copy (kept bitwise identical by the engine) — item by item
(the tensor, and its optimizer state in ``OPTIM_SLOTS`` slots), largest first to the least loaded
holder; so no bytes are written twice and no rank carries a whole embedding and its AdamW state
alone. ``common.pt`` (rank 0) holds the step, data-loader position, loss-scaler state, RNG state
(rank 0's; training randomness itself is derived from (seed, step, micro-batch, segment), so it
needs none), optimizer hyper-parameters and caller extras.

Why not ``torch.distributed.checkpoint``: its save is collective (plans gathered to a
coordinator, write results gathered before ``.metadata``), so it would either block training or
put a collective in the background thread, and its metadata has no checksums; a file per
cut-point segment keyed by parameter name reshards just as well for whole-tensor stages. Files
are ``torch.save`` of tensors and plain containers and load with ``weights_only=True``.

Sits on ``pipeline`` (the ``Varuna`` engine) and ``model``; never imports ``trainer``/``manager``.
"""

from __future__ import annotations

import io
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .store import CheckpointError, CheckpointInfo, Store, checkpoint_name, complete_checkpoints
from .writer import CheckpointWriter

COMMON_FILE = "common.pt"


OPTIM_SLOTS = 2  # a parameter's optimizer state is written in this many parts (AdamW: exp_avg, exp_avg_sq)


def unit_file(segment: int, rank: int) -> str:
    """File of segment ``segment``'s items written by ``rank``."""
    return f"seg-{segment:05d}-r{rank:05d}.pt"


def owner_segments(structure) -> dict[str, int]:
    """``{canonical parameter/buffer name: segment that owns it}`` — the first segment using it."""
    return {name: min(structure.segments_of(name)) for name in structure.state_segments}


def plan_writes(structure, stage_map, D: int, sizes: dict[str, int]) -> dict[tuple[str, str], int]:
    """Who writes what: ``{(name, unit): rank}`` with unit ``"tensor"`` for every parameter and
    buffer and ``"optim0"`` .. ``"optim{OPTIM_SLOTS-1}"`` for every parameter (its optimizer state
    keys, sorted, dealt to the slots round-robin). Holders of a name are the ranks of every stage
    using it, all D replicas (``rank = replica * P + stage``). Units, sized by the tensor's bytes
    (``sizes``), go largest first to the holder with the fewest bytes so far (ties: lower rank).
    Deterministic: every rank computes the same plan without communication."""
    P = stage_map.P
    params = set(structure.param_names)
    units = []
    for name in sorted(structure.state_segments):
        stages = sorted({stage_map.stage_of_segment(k) for k in structure.segments_of(name)})
        holders = sorted(d * P + st for st in stages for d in range(D))
        kinds = ["tensor"] + ([f"optim{j}" for j in range(OPTIM_SLOTS)] if name in params else [])
        units += [(sizes.get(name, 0), name, kind, holders) for kind in kinds]
    load = [0] * (P * D)
    plan = {}
    for size, name, kind, holders in sorted(units, key=lambda u: (-u[0], u[1], u[2])):
        r = min(holders, key=lambda r: (load[r], r))
        plan[(name, kind)] = r
        load[r] += size
    return plan


def _cpu_copy(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        v = v.detach()
        return v.clone() if v.device.type == "cpu" else v.to("cpu")
    return v


def _constructor_arguments(cls: type) -> set[str] | None:
    """The names an optimizer class's constructor takes (its settings, which the job's config
    gives), with ``params``, ``lr`` and ``weight_decay``: what a checkpoint's parameter groups
    must not override. ``None`` when the signature cannot be read (then nothing is restored)."""
    import inspect

    try:
        names = set(inspect.signature(cls.__init__).parameters)
    except (TypeError, ValueError):
        return None
    return names | {"params", "lr", "weight_decay", "initial_lr"}


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


@dataclass
class StageState:
    """What one rank read from a checkpoint: ``tensors`` {name: CPU tensor} and ``optim``
    {name: {state key: value}} for the names this stage holds, and the ``common`` dict."""

    info: CheckpointInfo
    tensors: dict[str, torch.Tensor]
    optim: dict[str, dict]
    common: dict


class StageCheckpointer:
    """Saves and loads one rank's part of per-layer checkpoints (paper §4.5).

    Args:
        engine: this rank's ``Varuna`` engine (its stage map decides what the rank holds).
        optimizer: built on ``engine.parameters()`` (AdamW or any torch optimizer).
        url: the published store (path or fsspec URL).
        staging_dir: this rank's local folder for files before publication.
        keep: complete checkpoints to keep; timeout_s: how long rank 0 waits for the other ranks'
            markers; generation: written into the manifest.

    Construction is collective when torch.distributed is initialised (rank 0 draws the write tag
    that names this run's checkpoints and broadcasts it). ``save`` is called by every rank at the
    same mini-batch boundary; it copies the state to CPU and returns; the rest is in the
    background (``CheckpointWriter``).
    """

    def __init__(self, engine, optimizer: torch.optim.Optimizer, url: str, staging_dir: str | Path, *,
                 keep: int = 3, timeout_s: float = 600.0, generation: int = 0, key: bytes | None = None):
        self.engine, self.optimizer = engine, optimizer
        self.key = key
        self.url, self.generation = str(url), generation
        self.rank, self.world = engine.rank, engine.topo.world_size
        self.device = engine.device
        structure = engine.structure
        self.owner = owner_segments(structure)
        every = {**dict(engine.model.named_parameters()), **dict(engine.model.named_buffers())}
        sizes = {n: t.numel() * t.element_size() for n, t in every.items() if n in self.owner}
        self.plan = plan_writes(structure, engine.stage_map, engine.D, sizes)
        self.my_units = sorted(u for u, r in self.plan.items() if r == self.rank)
        self.local = dict(engine.named_parameters())
        self.local_buffers = {n: b for n, b in engine.model.named_buffers()
                              if n in self.owner and b.device.type != "meta"}
        self.writer = CheckpointWriter(self.url, self.rank, self.world, staging_dir, keep=keep, timeout_s=timeout_s,
                                       key=key)
        # bytes this rank writes per checkpoint: its tensors, plus AdamW's two moments of parameters
        self.bytes_per_checkpoint = sum(sizes.get(name, 0) for (name, _unit), r in self.plan.items()
                                        if r == self.rank)
        self.staging_dir = Path(staging_dir)
        self.tag = self._agree_tag()
        self.last_save_s = 0.0

    def _agree_tag(self) -> str:
        value = torch.tensor([secrets.randbits(40)], dtype=torch.int64, device=self.device)
        if _distributed():
            dist.broadcast(value, src=0)
        return f"{int(value.item()):010x}"

    # ---- save -------------------------------------------------------------------------------
    def snapshot(self, step: int, common: dict | None = None) -> dict[str, Any]:
        """CPU copies of what this rank writes for a checkpoint after ``step`` steps:
        ``{file name: payload}`` (its share of the segment files; ``common.pt`` on rank 0 with
        ``common``)."""
        files: dict[str, Any] = {}
        state = self.optimizer.state
        for name, kind in self.my_units:
            f = files.setdefault(unit_file(self.owner[name], self.rank), {"params": {}, "buffers": {}, "optim": {}})
            if name in self.local:
                p = self.local[name]
                if kind == "tensor":
                    f["params"][name] = _cpu_copy(p)
                else:
                    st = state.get(p, {})
                    keys = sorted(st)
                    j = int(kind[len("optim"):])
                    f["optim"].setdefault(name, {}).update(  # one rank may write several slots of a name
                        {k: _cpu_copy(st[k]) for i, k in enumerate(keys) if i % OPTIM_SLOTS == j})
            elif name in self.local_buffers:
                f["buffers"][name] = _cpu_copy(self.local_buffers[name])
            else:  # cannot happen: plan_writes only picks ranks whose stage uses the name
                raise CheckpointError(f"rank {self.rank} is to write {name!r} but does not hold it")
        if self.rank == 0:
            rng = {"cpu": torch.get_rng_state()}
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                rng["cuda"] = torch.cuda.get_rng_state()
            groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
            files[COMMON_FILE] = {"step": step, "scaler": self.engine.scaler.state_dict(), "rng": rng,
                                  "param_groups": groups, **(common or {})}
        return files

    def _items_index(self) -> dict[str, dict]:
        """``{name: {"tensor": file, "optim": [file per slot], "shape": [...], "dtype": "float32"}}``
        of the whole model (manifest; shapes and dtypes from this rank's model, on meta outside its
        stage, so that a launcher can tell a changed model before any worker loads it)."""
        e = self.engine
        kinds: dict[str, torch.Tensor] = {}
        for n, t in [*e.model.named_parameters(remove_duplicate=False), *e.model.named_buffers(remove_duplicate=False)]:
            kinds.setdefault(n, t)
        index: dict[str, dict] = {}
        for (name, kind), r in sorted(self.plan.items()):
            f = unit_file(self.owner[name], r)
            entry = index.setdefault(name, {})
            if kind == "tensor":
                entry["tensor"] = f
                if name in kinds:
                    entry["shape"] = list(kinds[name].shape)
                    entry["dtype"] = str(kinds[name].dtype).replace("torch.", "")
            else:
                entry.setdefault("optim", [None] * OPTIM_SLOTS)[int(kind[len("optim"):])] = f
        return index

    def save(self, step: int, common: dict | None = None) -> float:
        """Checkpoint the state after ``step`` optimizer steps (collective in timing only: every
        rank calls it at the same boundary; no communication). ``common`` (rank 0): plain data to
        store with it, e.g. ``{"loader": loader.state_dict()}``. Returns the seconds this call
        blocked training (waiting for the previous write + the CPU snapshot)."""
        t0 = time.perf_counter()
        self.writer.wait()  # back-pressure first, so the snapshot is not held twice
        files = self.snapshot(step, common)
        e = self.engine
        name = checkpoint_name(step, self.tag)
        manifest = None
        if self.rank == 0:
            manifest = {"P": e.P, "D": e.D, "generation": self.generation, "num_segments": e.structure.num_segments,
                        "stage_map": e.stage_map.to_lists(), "items": self._items_index()}
        self.writer.save(name, step, files, manifest)
        self.last_save_s = time.perf_counter() - t0
        return self.last_save_s

    def check_store(self) -> None:
        """Before the first step: the store takes a write and has room for this rank's share of a
        checkpoint (``bytes_per_checkpoint`` x 1.1), and the local staging folder is writable.
        Raises ``CheckpointError`` naming the location and what to change."""
        self.writer.store.probe(int(self.bytes_per_checkpoint * 1.1))
        try:
            self.staging_dir.mkdir(parents=True, exist_ok=True)
            probe = self.staging_dir / ".probe"
            probe.write_bytes(b"x")
            probe.unlink()
        except OSError as e:
            raise CheckpointError(f"the local checkpoint staging folder {str(self.staging_dir)!r} is not writable "
                                  f"({e.strerror or e}); the run folder must be writable") from None

    def wait(self, timeout_s: float | None = None):
        """Join this rank's write in flight; rank 0 returns the published ``CheckpointInfo``."""
        return self.writer.wait(timeout_s)

    # ---- load -------------------------------------------------------------------------------
    def read(self, info: CheckpointInfo) -> StageState:
        """Read (and verify, SHA-256) the segment files holding this stage's parameters, buffers and
        optimizer state, and ``common.pt``. Touches nothing in the engine. Raises
        ``CheckpointError`` naming the file when one is missing or corrupt, or when the checkpoint
        was taken from a different model (other parameter names)."""
        try:
            return self._read(info)
        except (KeyError, TypeError, AttributeError, ValueError, IndexError) as e:
            raise CheckpointError(f"checkpoint {info.name!r} in {info.url!r} is malformed: its files do not hold "
                                  f"what its manifest says ({type(e).__name__}: {str(e)[:200]})") from None

    def _read(self, info: CheckpointInfo) -> StageState:
        store = Store(info.url, self.key)
        items = info.manifest["items"]
        where = f"checkpoint {info.name!r} in {info.url!r}"
        theirs, mine = set(items), set(self.owner)
        if theirs != mine:
            extra, missing = sorted(theirs - mine)[:5], sorted(mine - theirs)[:5]
            raise CheckpointError(f"{where} does not fit this model: checkpoint-only names {extra}, model-only "
                                  f"names {missing}; resume with the model it was saved from, or another store")
        wanted = sorted(set(self.local) | set(self.local_buffers))
        payloads: dict[str, dict] = {}
        for fname in sorted({f for n in wanted for f in [items[n]["tensor"], *items[n].get("optim", [])]}):
            if fname is None:
                raise CheckpointError(f"{where}: its manifest lists no file for part of the state")
            payloads[fname] = self._load(store, info, fname)
        tensors: dict[str, torch.Tensor] = {}
        optim: dict[str, dict] = {}
        for n in wanted:
            f = items[n]["tensor"]
            t = payloads[f]["params"].get(n, payloads[f]["buffers"].get(n))
            if t is None:
                raise CheckpointError(f"{where}: file {f!r} does not hold {n!r} (its manifest says it does)")
            tensors[n] = t
            if n in self.local:
                merged: dict = {}
                for f in items[n]["optim"]:
                    if n not in payloads[f]["optim"]:
                        raise CheckpointError(f"{where}: file {f!r} does not hold the optimizer state of {n!r}")
                    merged.update(payloads[f]["optim"][n])
                optim[n] = merged
        common = self._load(store, info, COMMON_FILE)
        rng = common.get("rng") if isinstance(common, dict) else None
        if not (isinstance(common, dict) and isinstance(common.get("step"), int) and isinstance(common.get("scaler"), dict)
                and isinstance(rng, dict) and isinstance(rng.get("cpu"), torch.Tensor)
                and all(isinstance(t, torch.Tensor) for t in tensors.values())):
            raise CheckpointError(f"checkpoint {info.name!r}: {COMMON_FILE} or a segment file lacks the step, "
                                  "loss scaler, RNG state or tensors it should hold")
        return StageState(info, tensors, optim, common)

    @staticmethod
    def _load(store: Store, info: CheckpointInfo, fname: str) -> dict:
        return load_verified(store, info, fname)

    def apply(self, state: StageState) -> dict:
        """Copy ``state`` into the engine's parameters and buffers (bitwise), the optimizer's state
        (per parameter, and what it keeps in its parameter groups besides its settings, as rank 0
        saved it), the loss scaler, the step counter and the RNG; returns the ``common`` dict. Raises
        ``CheckpointError`` for a shape or dtype that does not match."""
        where = f"checkpoint {state.info.name!r}"
        with torch.no_grad():
            for n, target in {**self.local, **self.local_buffers}.items():
                src = state.tensors[n]
                if src.shape != target.shape or src.dtype != target.dtype:
                    raise CheckpointError(f"{where}: {n!r} is {src.dtype} {tuple(src.shape)} in the checkpoint but "
                                          f"{target.dtype} {tuple(target.shape)} in the model")
                target.copy_(src)
        sd = self.optimizer.state_dict()
        index = {}
        i = 0
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                index[id(p)] = i
                i += 1
        sd["state"] = {index[id(p)]: state.optim[n] for n, p in self.local.items()
                       if id(p) in index and state.optim.get(n)}
        self.optimizer.load_state_dict(sd)
        common = state.common
        # state an optimizer keeps in its parameter groups (a step count, Prodigy's d): entries that are
        # no setting of its constructor, as rank 0 saved them (settings come from the job's config)
        saved = common.get("param_groups") or []
        settings = _constructor_arguments(type(self.optimizer))
        if settings is not None and len(saved) == len(self.optimizer.param_groups):
            for g, was in zip(self.optimizer.param_groups, saved):
                g.update({k: v for k, v in was.items() if k not in settings})
        self.engine.scaler.load_state_dict(common["scaler"])
        self.engine.step_count = int(common["step"])
        torch.set_rng_state(common["rng"]["cpu"])
        if "cuda" in common["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state(common["rng"]["cuda"])
        return common

    def resume(self, url: str | None = None) -> tuple[CheckpointInfo | None, dict | None]:
        """Load the newest complete checkpoint of ``url`` (default: this checkpointer's store) that
        every rank reads without error (collective). Rank 0 picks the candidate and broadcasts its
        name; every rank reads and verifies its files; one MAX all-reduce says whether any failed;
        if so all move on to the next older one. Returns ``(info, common)``, or ``(None, None)``
        when there is no usable checkpoint (then nothing was changed).

        Every fallback is said (stdout, the worker log): rank 0 names each checkpoint newer than the
        one it resumes from that it skipped — incomplete, torn, malformed, not signed with the job's
        secret, or unreadable on some rank — with the reason."""
        url = str(url or self.url)
        skipped: list[tuple[str, str]] = []
        candidates = complete_checkpoints(url, self.key, skipped) if self.rank == 0 else []
        k = 0
        while True:
            name = candidates[k].name if k < len(candidates) else ""
            name = self._broadcast_name(name)
            if not name:
                self._say_skipped(skipped, None)
                return None, None
            info = candidates[k] if self.rank == 0 else None
            error = None
            try:
                if info is None:
                    store = Store(url, self.key)
                    body = store.read_manifest(name)
                    info = CheckpointInfo(store.url, name, int(body["step"]), body)
                state = self.read(info)
            except CheckpointError as e:
                error = e
            failed = torch.tensor([1 if error else 0], dtype=torch.int32, device=self.device)
            if _distributed():
                dist.all_reduce(failed, op=dist.ReduceOp.MAX)
            if not int(failed.item()):
                self._say_skipped(skipped, info)
                return info, self.apply(state)
            if error is not None:
                print(f"[varuna] rank {self.rank}: skipping checkpoint {name}: {error}", flush=True)
            if self.rank == 0:
                skipped.append((name, str(error) if error is not None else "another rank could not read its files "
                                "(see that rank's log)"))
            k += 1

    def _say_skipped(self, skipped: list[tuple[str, str]], chosen: CheckpointInfo | None) -> None:
        """Rank 0: the outcome said once — ``falling back to NAME`` or ``no usable checkpoint:
        starting from scratch`` — followed by one line per skipped checkpoint newer than ``chosen``
        (all of them when None) with its reason. Nothing when none was skipped."""
        if self.rank != 0:
            return
        from .store import parse_name

        floor = -1 if chosen is None else chosen.step
        passed = [(name, reason) for name, reason in skipped
                  if (p := parse_name(name)) is not None and p[0] >= floor and (chosen is None or name != chosen.name)]
        if not passed:
            return
        target = f"falling back to {chosen.name}" if chosen else "no usable checkpoint: starting from scratch"
        lines = [f"[varuna] {target}; skipped {len(passed)} newer checkpoint(s):" if chosen else
                 f"[varuna] {target}; skipped {len(passed)} checkpoint(s):"]
        lines += [f"[varuna]   skipped checkpoint {name} ({reason})" for name, reason in passed]
        print("\n".join(lines), flush=True)

    def _broadcast_name(self, name: str, size: int = 128) -> str:
        raw = name.encode()
        if len(raw) > size:
            raise CheckpointError(f"checkpoint name {name!r} is longer than {size} bytes")
        buf = torch.zeros(size, dtype=torch.uint8, device=self.device)
        if raw:
            buf[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
        if _distributed():
            dist.broadcast(buf, src=0)
        return bytes(buf.cpu().tolist()).rstrip(b"\0").decode()


def load_verified(store: Store, info: CheckpointInfo, fname: str) -> dict:
    """One file of checkpoint ``info``, its SHA-256 checked against the manifest, unpickled with
    ``torch.load(weights_only=True)`` (plain tensors and containers only: no code runs) onto the
    CPU. Raises ``CheckpointError`` naming the file when it is missing, altered or not loadable."""
    data = store.read_verified(info.name, fname, info.manifest)
    try:
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - any unpickling failure is a corrupt file
        raise CheckpointError(f"checkpoint {info.name!r}: file {fname!r} does not load ({e})") from None


def default_staging_dir(run_dir: str | Path, rank: int) -> Path:
    """``<run_dir>/.checkpoint-staging/rank-<r>``: where a rank stages files before publishing."""
    return Path(run_dir) / ".checkpoint-staging" / f"rank-{rank:05d}"


def default_store_url(run_dir: str | Path) -> str:
    """``<run_dir>/checkpoints`` (absolute): the default published store."""
    return os.path.abspath(os.path.join(str(run_dir), "checkpoints"))
