"""What a job's VMs cost so far, from the prices their provider gave — for the dashboard's
header, the jobs table, ``varuna status`` and ``Job.list()``.

A VM is billed from its ``host_added`` event to its ``host_removed`` event (pre-empted or
released) at the ``price_per_hour`` (US $) its provider put in the event's payload or labels
(``"0.92"``, ``"$0.92/h"``); the saving is against the same VM-hours at its
``on_demand_per_hour`` (the spot price when none is given). Labels ``prices="example"`` mark
illustrative prices (the emulator's), and ``kind="local"`` a slot of this machine (free).

Owns ``price``, ``Meter``, ``Billing``, ``cost_text``. Imports ``manager.events`` only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable

from .events import Event, Kind

__all__ = ["BILLED_KINDS", "Billing", "Meter", "cost_text", "price"]

#: the event kinds a ``Billing`` reads
BILLED_KINDS = (Kind.HOST_ADDED, Kind.HOST_REMOVED)


def price(v: Any) -> float | None:
    """US $ per hour from a payload number or a label string ("0.92", "$0.92/h"); else None."""
    if isinstance(v, str):
        try:
            v = float(v.strip().lstrip("$").split("/")[0])
        except ValueError:
            return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        return None
    return float(v)


@dataclass
class Meter:
    """One VM's bill: its prices ($/h), the kind of VM, when its current billed period began
    (``up_since``, Unix s; None while it is not held) and the $ of its earlier periods."""

    price_per_hour: float | None = None
    on_demand_per_hour: float | None = None
    example: bool = False
    kind: str | None = None
    up_since: float | None = None
    spent: float = 0.0
    spent_on_demand: float = 0.0

    def settle(self, t: float) -> None:
        """End the billed period at ``t`` (the VM left)."""
        if self.up_since is not None:
            hours = max(0.0, t - self.up_since) / 3600.0
            self.spent += hours * (self.price_per_hour or 0.0)
            self.spent_on_demand += hours * (self.on_demand_per_hour or self.price_per_hour or 0.0)
        self.up_since = None

    def cost(self, now: float) -> tuple[float, float]:
        """($ spent, $ the same time on demand) up to ``now`` (Unix s)."""
        hours = max(0.0, now - self.up_since) / 3600.0 if self.up_since is not None else 0.0
        return (self.spent + hours * (self.price_per_hour or 0.0),
                self.spent_on_demand + hours * (self.on_demand_per_hour or self.price_per_hour or 0.0))


@dataclass
class Billing:
    """The bill of a pool of VMs, fed its ``BILLED_KINDS`` events in log order (others are
    ignored; a malformed payload bills nothing)."""

    meters: dict[str, Meter] = field(default_factory=dict)

    @classmethod
    def of(cls, events: Iterable[Event]) -> "Billing":
        """The billing of a job's ``host_added``/``host_removed`` events (oldest first)."""
        b = cls()
        for e in events:
            b.feed(e)
        return b

    def feed(self, e: Event) -> None:
        """Account one event (events of other kinds, or without a VM, are ignored)."""
        if not e.host or e.kind not in BILLED_KINDS:
            return
        m = self.meters.setdefault(e.host, Meter())
        if e.kind == Kind.HOST_REMOVED:
            m.settle(e.time)
            return
        p = e.payload if isinstance(e.payload, dict) else {}
        labels = p.get("labels") if isinstance(p.get("labels"), dict) else {}
        spot = price(p.get("price_per_hour", labels.get("price_per_hour")))
        if spot is not None:
            m.price_per_hour = spot
        od = price(p.get("on_demand_per_hour", labels.get("on_demand_per_hour")))
        if od is not None:
            m.on_demand_per_hour = od
        m.example = str(labels.get("prices", "")) == "example"
        kind = labels.get("instance_type") or labels.get("kind")
        m.kind = str(kind) if kind else m.kind
        if m.up_since is None:
            m.up_since = e.time

    def cost(self, now: float) -> dict | None:
        """``{"local": False, "spent": $, "on_demand": $ the same VM-hours on demand, "per_hour": $/h
        of the VMs held now, "example": some prices are an example}``; ``{"local": True}`` when every
        VM is a slot of this machine; None when no VM has a price."""
        if self.meters and all(m.kind == "local" for m in self.meters.values()):
            return {"local": True}
        priced = [m for m in self.meters.values() if m.price_per_hour is not None]
        if not priced:
            return None
        spent = [m.cost(now) for m in priced]
        return {"local": False, "spent": sum(c[0] for c in spent), "on_demand": sum(c[1] for c in spent),
                "per_hour": sum(m.price_per_hour for m in priced if m.up_since is not None),
                "example": any(m.example for m in priced)}


def cost_text(c: dict | None, short: bool = False) -> str:
    """A ``Billing.cost`` in words: free for local slots; else $ spent so far, $/h now and the saving
    against the same VM-hours on demand (saying when the prices are an example). ``short``: for a
    table column ("$1.20, -70 %", "free", "-")."""
    if c is None:
        return "-" if short else "no prices given"
    if c.get("local"):
        return "free" if short else "free (local)"
    saves = 1 - c["spent"] / c["on_demand"] if c["on_demand"] > 0 and c["on_demand"] > c["spent"] else None
    if short:
        return f"${c['spent']:,.2f}" + (f", -{saves:.0%}" if saves is not None else "") + ("*" if c.get("example") else "")
    text = f"${c['spent']:,.2f} spent · ${c['per_hour']:,.2f}/h"
    if saves is not None:
        text += f" · saves {saves:.0%} vs on-demand"
    return text + (" (example prices)" if c.get("example") else "")
