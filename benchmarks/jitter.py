"""Seeded delivery jitter at pipeline stage boundaries, applied identically to Varuna's transport
and to torch.distributed.pipelining's.

Network model (the same for both systems): message ``seq`` of a step on the directed link
``src -> dst`` may not be *used* by the receiver before ``t_send + d``, where ``t_send`` is when
the sender handed it to the transport (``isend`` posted) and ``d`` is drawn from an exponential
distribution with mean ``mean_s``, seeded by ``(seed, step key, src, dst, seq)`` — so both systems
see exactly the same delay for the same message of the same step. Messages on a link stay in
order (a later one is never visible before an earlier one). Only *delivery* is delayed: the
sender's compute never waits for it.

``t_send`` travels out of band: every process maps one shared file of float64 send times indexed
``[src, dst, seq]``, and all processes read ``time.monotonic()``, which Linux keeps system-wide
(the workers run on one machine). Delaying from the sender's hand-off (rather than from when the
receiver happened to post its receive) charges a schedule that posts receives late nothing extra
for messages that would already have arrived.

Hooks: Varuna — ``varuna_sdk.pipeline.comm.set_delivery_gate`` (``on_send`` before ``isend``,
``on_recv`` on the receiver thread before the message enters the inbox); torch — a replacement of
``torch.distributed.pipelining.schedules._batch_p2p`` that calls ``on_send`` before each ``isend``
and wraps each ``irecv`` work so that ``wait()`` returns no earlier than the delivery time.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np


def create_send_time_table(path: str | Path, world: int, max_msgs: int) -> None:
    """Create the shared send-time file (zeros) before the workers start."""
    np.zeros((world, world, max_msgs), dtype=np.float64).tofile(path)


class JitterGate:
    """Per-process gate. ``begin(key, enabled)`` at the start of every timed step (before the
    step's barrier) resets the per-link message counters and selects the delay stream."""

    def __init__(self, path: str | Path, world: int, rank: int, max_msgs: int, seed: int = 0):
        self.ts = np.memmap(path, dtype=np.float64, mode="r+", shape=(world, world, max_msgs))
        self.rank, self.max_msgs, self.seed = rank, max_msgs, seed
        self.mean_s = 0.0
        self.enabled = False
        self.key = 0
        self._lock = threading.Lock()
        self._sent: dict[int, int] = {}
        self._recv: dict[int, int] = {}
        self.delays: list[float] = []  # applied extra waits (s), for the report

    def begin(self, key: int, enabled: bool) -> None:
        with self._lock:
            self.key, self.enabled = key, enabled
            self._sent.clear()
            self._recv.clear()

    def delay(self, src: int, dst: int, seq: int) -> float:
        rng = np.random.default_rng([self.seed, self.key, src, dst, seq])
        return float(rng.exponential(self.mean_s)) if self.mean_s > 0 else 0.0

    # -- sender side ------------------------------------------------------------------------
    def on_send(self, peer: int) -> None:
        with self._lock:
            seq = self._sent.get(peer, 0)
            self._sent[peer] = seq + 1
        if seq >= self.max_msgs:
            raise RuntimeError(f"jitter gate: more than {self.max_msgs} messages to rank {peer} in one step")
        self.ts[self.rank, peer, seq] = time.monotonic()

    # -- receiver side ----------------------------------------------------------------------
    def next_recv_seq(self, peer: int) -> int:
        with self._lock:
            seq = self._recv.get(peer, 0)
            self._recv[peer] = seq + 1
        return seq

    def deliver(self, peer: int, seq: int) -> None:
        """Block until message ``seq`` from ``peer`` (already fully received) may be used."""
        if not self.enabled:
            return
        ready = float(self.ts[peer, self.rank, seq]) + self.delay(peer, self.rank, seq)
        wait = ready - time.monotonic()
        if wait > 0:
            time.sleep(wait)
            self.delays.append(wait)
        else:
            self.delays.append(0.0)

    def on_recv(self, peer: int) -> None:
        """Varuna's hook: called in order on the channel's receiver thread."""
        self.deliver(peer, self.next_recv_seq(peer))


class _GatedWork:
    """A receive work whose ``wait()`` returns no earlier than the gate's delivery time."""

    def __init__(self, work, gate: JitterGate, peer: int, seq: int):
        self.work, self.gate, self.peer, self.seq = work, gate, peer, seq
        self._done = False

    def wait(self, *args, **kwargs):
        r = self.work.wait(*args, **kwargs)
        if not self._done:
            self._done = True
            self.gate.deliver(self.peer, self.seq)
        return r

    def __getattr__(self, name):
        return getattr(self.work, name)


def install_torch_gate(gate: JitterGate) -> None:
    """Replace ``schedules._batch_p2p`` (looked up at call time by every schedule) with a version
    that issues the same ops in the same order — as torch itself does on a backend without
    coalescing (gloo) — and gates the receives."""
    import torch.distributed as dist
    from torch.distributed.pipelining import schedules

    def gated_batch_p2p(p2p_ops, desc=None):
        works = []
        for p in p2p_ops:
            if p.op is dist.isend:
                gate.on_send(p.peer)
                works.append(p.op(p.tensor, group=p.group, tag=p.tag, group_dst=p.group_peer))
            elif p.op is dist.irecv:
                seq = gate.next_recv_seq(p.peer)
                w = p.op(p.tensor, group=p.group, tag=p.tag, group_src=p.group_peer)
                works.append(_GatedWork(w, gate, p.peer, seq))
            else:
                raise RuntimeError(f"jitter gate: unexpected P2P op {p.op}")
        return works

    schedules._batch_p2p = gated_batch_p2p
