"""Values in words for the dashboard: numbers, bytes, clock times, durations, progress and
cut-point segment ranges, the smoothed loss (EMA), and the run folder's config read defensively.

Every function here takes input straight from the event log (a malformed payload, NaN, a bool
where a number belongs) and never raises on it: it returns a placeholder ("–", "?", None).
Imports numpy, pandas and yaml only; must never import panel, bokeh or ``varuna_sdk``.
"""

from __future__ import annotations

import html
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd


def esc(v: Any) -> str:
    """``v`` as text safe inside HTML: ``str(v)`` with ``&``, ``<``, ``>`` and both quote characters escaped."""
    return html.escape(str(v), quote=True)


def _finite(v: Any) -> bool:
    """True for an int or float (not a bool) that is neither NaN nor ±inf."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def clock(t: float | None) -> str:
    """Unix time ``t`` (seconds) as ``HH:MM:SS`` in UTC; "–" for None, 0, a non-number, NaN, ±inf or a time
    ``time.gmtime`` cannot show."""
    if not _finite(t) or not t:
        return "–"
    try:
        return time.strftime("%H:%M:%S", time.gmtime(t))
    except (OverflowError, OSError, ValueError):  # beyond the platform's time_t
        return "–"


def num(v: Any, fmt: str = "{:.3g}", none: str = "–") -> str:
    """``v`` formatted with ``fmt`` (default: 3 significant digits); ``none`` for a bool, a non-number, NaN or ±inf."""
    if not _finite(v):
        return none
    return fmt.format(v)


def fmt_bytes(b: Any) -> str:
    """A size in bytes in binary units (``"1.50 GiB"``, ``"12.00 MiB"``, ``"3.00 KiB"``, ``"512 B"``); "–" for a bool,
    a non-number, NaN or ±inf."""
    if not _finite(b):
        return "–"
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= k:
            return f"{b / k:.2f} {unit}"
    return f"{b:.0f} B"


def segments_text(segs: Any) -> str:
    """A stage's cut-point segments (paper §5.1) as text: ``"3"`` for one, ``"2–5"`` for a contiguous ascending run of
    ints, else the items joined by commas; ``"?"`` for an empty list or anything but a list."""
    if not isinstance(segs, list) or not segs:
        return "?"
    if all(isinstance(x, int) for x in segs) and segs == list(range(segs[0], segs[-1] + 1)):
        return f"{segs[0]}" if len(segs) == 1 else f"{segs[0]}–{segs[-1]}"
    return ",".join(str(x) for x in segs)



def safe_sentence(fn, arg) -> str:
    """``fn(arg)`` (a sentence of ``manager.runs``), or "" when a malformed payload breaks it."""
    try:
        return str(fn(arg))
    except Exception:  # noqa: BLE001 - the log is input: a view never fails on it
        return ""


def short(v: Any) -> str:
    """A payload value shortened for a table cell: a float to 4 significant digits, a dict as its first 4 items (values
    shortened the same way), anything else ``str(v)`` cut to 60 characters."""
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {short(x)}" for k, x in list(v.items())[:4]) + "}"
    return str(v)[:60]


def finite(v: Any) -> bool:
    """True for an int or float (not a bool) that is neither NaN nor ±inf."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def rounded(v: Any, nd: int) -> float | None:
    """``v`` as a float rounded to ``nd`` decimals, or None when it is not a finite number (``finite``)."""
    return round(float(v), nd) if finite(v) else None



def ema(values: np.ndarray, span: int, start: float | None = None) -> np.ndarray:
    """Exponential moving average of ``values`` (``alpha = 2 / (span + 1)``), continuing from
    ``start`` (the average before the first value; None: begin at the first finite value). NaNs
    (skipped steps) carry the average on."""
    v = np.asarray(values, dtype=float)
    v = np.where(np.isfinite(v), v, np.nan)
    head = [] if start is None else [start]
    out = pd.Series(np.concatenate([head, v])).ewm(span=span, adjust=False, ignore_na=True).mean().to_numpy()
    return out[len(head):]


def job_config(db: Path) -> dict:
    """The run folder's ``config.yaml`` (next to the event log) as plain data; ``{}`` when there is
    none or it cannot be read (a broken config must not break the dashboard)."""
    cfg = db.parent / "config.yaml"
    if not cfg.is_file():
        return {}
    try:
        import yaml

        doc = yaml.safe_load(cfg.read_text()[:1_000_000])
    except Exception:  # noqa: BLE001
        return {}
    return doc if isinstance(doc, dict) else {}


def duration(s: float | None) -> str:
    """A duration ``s`` in seconds in words: ``"45 s"`` below 90 s, ``"12 min"`` below 90 min, else ``"2.5 h"``; "–"
    for None, a non-number, NaN or ±inf."""
    if not _finite(s):
        return "–"
    return f"{s:.0f} s" if s < 90 else f"{s / 60:.0f} min" if s < 5400 else f"{s / 3600:.1f} h"


def progress_text(done: int, total: int | None) -> str:
    """"159 / 300 (53 %)", or "159" when the total is not known."""
    if not total:
        return f"{done:,}" if done else "–"
    return f"{done:,} / {total:,} ({100 * done / total:.0f} %)"
