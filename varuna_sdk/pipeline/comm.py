"""Point-to-point transport between adjacent stages: activations forward, gradients backward.

Owns the message format (a fixed-size int64 header describing any mix of tensors — float with
grad, float without grad, integer masks — followed by the tensors) and ``Channel``/``Receiver``:
one direction between two ranks over its own two-rank process group, sends asynchronous
(``isend``), receives on a background thread that fills an ordered inbox. Because each channel
has its own communicator with one sender and one receiver, the same code runs on gloo (CPU) and
NCCL (GPU) without ordering deadlocks. Paper §6; the original's thread-per-step CPU copies and
fixed shapes (varuna-original.md §3.3) are what this replaces.

Nothing received is unpickled: only raw tensor bytes and int64 headers cross the wire.
Must never import ``varuna_sdk.cluster`` or anything above ``pipeline``.
"""

from __future__ import annotations

import threading
import time
from typing import Sequence

import torch
import torch.distributed as dist

HEADER_LEN = 128
DTYPES: list[torch.dtype] = [
    torch.float32, torch.float16, torch.bfloat16, torch.float64,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
]
_CODE = {dt: i for i, dt in enumerate(DTYPES)}


_delivery_gate = None


def set_delivery_gate(gate) -> None:
    """Install (or, with ``None``, remove) a process-wide delivery gate — a test/benchmark hook
    that injects network delay without touching the transport. ``gate.on_send(peer)`` is called on
    the sending thread just before a message is handed to ``isend``; ``gate.on_recv(peer)`` on the
    receiving thread once a message from ``peer`` has fully arrived and *before* it becomes
    visible to the schedule (it may block to delay delivery; later messages on that channel wait
    behind it, as on an ordered link). Senders' compute is never blocked by it."""
    global _delivery_gate
    _delivery_gate = gate


class PeerLost(RuntimeError):
    """A neighbouring stage stopped sending (its process died or the network broke)."""


def encode_header(tensors: Sequence[torch.Tensor], flags: Sequence[bool], device: torch.device) -> torch.Tensor:
    """``[n, (dtype code, requires_grad, ndim, *shape) × n, 0…]`` as an int64 tensor of HEADER_LEN.

    Raises ``ValueError`` for an unsupported dtype or a header that does not fit.
    """
    vals: list[int] = [len(tensors)]
    for t, f in zip(tensors, flags):
        if t.dtype not in _CODE:
            raise ValueError(f"cannot send a {t.dtype} tensor between stages; supported: {DTYPES}")
        vals += [_CODE[t.dtype], int(bool(f)), t.dim(), *t.shape]
    if len(vals) > HEADER_LEN:
        raise ValueError(f"{len(tensors)} tensors with {len(vals)} header entries exceed {HEADER_LEN}; "
                         "send fewer or lower-rank tensors across a cut-point")
    h = torch.zeros(HEADER_LEN, dtype=torch.int64)
    h[: len(vals)] = torch.tensor(vals, dtype=torch.int64)
    return h.to(device)


def decode_header(h: torch.Tensor) -> list[tuple[torch.dtype, bool, tuple[int, ...]]]:
    """Inverse of ``encode_header``; raises ``ValueError`` on a malformed header."""
    v = h.cpu().tolist()
    n, i, out = int(v[0]), 1, []
    if not 0 <= n <= HEADER_LEN // 3:
        raise ValueError(f"malformed stage message header (n={n})")
    for _ in range(n):
        code, flag, nd = v[i], v[i + 1], v[i + 2]
        if not (0 <= code < len(DTYPES)) or not 0 <= nd <= 16:
            raise ValueError("malformed stage message header")
        out.append((DTYPES[code], bool(flag), tuple(int(x) for x in v[i + 3 : i + 3 + nd])))
        i += 3 + nd
    return out


class Channel:
    """One direction of traffic to/from ``peer`` over a dedicated two-rank ``group``.

    A message is a header (``encode_header``: the tensors' dtypes, grad flags and shapes) and its
    tensors, one send each. Where every micro-batch of a step crosses with the same tensors (the
    batch identity makes them equal), the header travels once per step: after ``begin_step()`` the
    first message carries it and the rest are bare tensors. With ``header_per_message`` (a
    cut-point crossed by tensors computed from the inputs, whose presence may change between
    micro-batches: a Hugging Face model builds an attention mask for a padded micro-batch only)
    every message carries its own, made once per signature. Raises ``ValueError`` if the signature
    changes within a step without it.
    """

    #: signatures whose encoded header a channel keeps (a step's micro-batches use one or a few)
    HEADERS_KEPT = 64

    def __init__(self, peer: int, group, device: torch.device, max_outstanding: int = 64, *,
                 header_per_message: bool = False):
        self.peer, self.group, self.device = peer, group, device
        self.pending: list[tuple[object, list[torch.Tensor]]] = []
        self.max_outstanding = max_outstanding
        self.header_per_message = header_per_message
        self._send_sig: tuple | None = None
        self._recv_sig: list[tuple[torch.dtype, bool, tuple[int, ...]]] | None = None
        self._headers: dict[tuple, torch.Tensor] = {}

    def begin_step(self) -> None:
        """Forget the per-step signature: the next message sends (or expects) a header."""
        self._send_sig = None
        self._recv_sig = None

    def _header(self, sig: tuple, tensors: Sequence[torch.Tensor], flags: list[bool]) -> torch.Tensor:
        header = self._headers.get(sig)
        if header is None:
            header = encode_header(tensors, flags, self.device)
            if len(self._headers) >= self.HEADERS_KEPT:
                self._headers.clear()
            self._headers[sig] = header
        return header

    def send(self, tensors: Sequence[torch.Tensor], flags: Sequence[bool] | None = None) -> None:
        """Queue ``tensors`` (detached, contiguous) for asynchronous delivery to the peer, with
        ``flags`` (which of them the peer sends a gradient back for; default none)."""
        flags = list(flags) if flags is not None else [False] * len(tensors)
        sig = tuple((t.dtype, bool(f), tuple(t.shape)) for t, f in zip(tensors, flags))
        payload = [t.detach().contiguous() for t in tensors]
        if self.header_per_message or self._send_sig is None:
            payload.insert(0, self._header(sig, tensors, flags))
            self._send_sig = sig
        elif sig != self._send_sig:
            raise ValueError(
                f"the tensors crossing a cut-point changed within a step ({self._send_sig} -> {sig}); every "
                "micro-batch must send the same shapes and dtypes"
            )
        if _delivery_gate is not None:
            _delivery_gate.on_send(self.peer)
        works = [dist.isend(t, self.peer, group=self.group) for t in payload]
        self.pending.append((works, payload))
        while len(self.pending) > self.max_outstanding:
            self._wait_one()

    def _wait_one(self) -> None:
        works, _ = self.pending.pop(0)
        for w in works:
            w.wait()

    def wait_sends(self) -> None:
        """Block until every queued send has completed."""
        while self.pending:
            self._wait_one()

    def recv(self) -> tuple[list[torch.Tensor], list[bool]]:
        """Blocking receive of one message: (tensors, requires_grad flags)."""
        if self.header_per_message or self._recv_sig is None:
            h = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
            dist.recv(h, self.peer, group=self.group)
            self._recv_sig = decode_header(h)
        tensors, flags = [], []
        for dtype, flag, shape in self._recv_sig:
            t = torch.empty(shape, dtype=dtype, device=self.device)
            dist.recv(t, self.peer, group=self.group)
            tensors.append(t)
            flags.append(flag)
        return tensors, flags


class Receiver:
    """Receives a channel's messages on one long-lived background thread into an ordered inbox.

    ``start(count)`` opens a step's batch of ``count`` messages (the thread is created once, at
    the first ``start``, not every step); ``arrived`` is how many of them have landed (the
    schedule's ``acts_arrived``/``grads_arrived``); ``get(i)`` blocks for message ``i``;
    ``join()`` waits for the whole batch. ``get``/``join`` raise ``PeerLost`` if the channel broke
    or ``timeout_s`` passed; after a failure every later call raises it too.
    """

    def __init__(self, channel: Channel, timeout_s: float):
        self.channel, self.timeout_s = channel, timeout_s
        self.count = 0
        self.inbox: list[tuple[list[torch.Tensor], list[bool]]] = []
        self.error: BaseException | None = None
        self.cond = threading.Condition()
        self.thread: threading.Thread | None = None

    def start(self, count: int) -> None:
        """Begin receiving the next ``count`` messages (the previous batch must be complete)."""
        with self.cond:
            if len(self.inbox) < self.count and self.error is None:
                raise RuntimeError(f"receiver from rank {self.channel.peer}: {self.count - len(self.inbox)} "
                                   "messages of the previous step are still outstanding")
            self.inbox = []
            self.count = count
            self.cond.notify_all()
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, daemon=True, name=f"varuna-recv-{self.channel.peer}")
            self.thread.start()

    def _run(self) -> None:
        try:
            while True:
                with self.cond:
                    while len(self.inbox) >= self.count:
                        self.cond.wait()
                msg = self.channel.recv()
                if _delivery_gate is not None:
                    _delivery_gate.on_recv(self.channel.peer)
                with self.cond:
                    self.inbox.append(msg)
                    self.cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - surfaced to the compute thread in get()/join()
            with self.cond:
                self.error = e
                self.cond.notify_all()

    @property
    def arrived(self) -> int:
        """How many messages of this step have arrived (the policy's view of the inbox)."""
        return len(self.inbox)

    def _wait_for(self, n: int) -> None:
        deadline = time.monotonic() + self.timeout_s
        while len(self.inbox) < n:
            if self.error is not None:
                raise PeerLost(f"stage neighbour rank {self.channel.peer} was lost: {self.error}") from self.error
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerLost(f"no message from rank {self.channel.peer} within {self.timeout_s:.0f} s")
            self.cond.wait(timeout=min(left, 1.0))

    def get(self, i: int) -> tuple[list[torch.Tensor], list[bool]]:
        """Message ``i`` of the step, ``(tensors, requires-grad flags)``, waiting for it; raises
        ``PeerLost`` if the channel broke or nothing came within ``timeout_s``."""
        with self.cond:
            self._wait_for(i + 1)
            return self.inbox[i]

    def release(self, i: int) -> None:
        """Drop message ``i`` from the inbox once used (keeps memory bounded)."""
        with self.cond:
            self.inbox[i] = ([], [])

    def join(self) -> None:
        """Wait until every message of the batch has arrived."""
        with self.cond:
            self._wait_for(self.count)
