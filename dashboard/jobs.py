"""The jobs page: every job in a folder of runs, for a team that runs many.

``build_jobs_app(root)`` returns a Panel object listing the run folders inside ``root``
(``varuna_sdk.manager.runs.find_runs``), newest first, one row a job: name (a link to its page,
``job?run=NAME``), state, plan, step of the total and its percentage, elapsed, ETA, cost so far, morphs and the
last event in words. It re-reads the folder every ``refresh_s`` seconds, so runs started later
appear. ``run_folder(root, name)`` is the run folder a job page may show: a direct child of
``root`` holding an event log — never a path outside it.

Read-only (``manager.runs`` only reads); imports panel and ``varuna_sdk.manager.runs``, never
torch or anything that drives a job.
"""

from __future__ import annotations

import html
from pathlib import Path

import panel as pn

from varuna_sdk.manager.billing import cost_text
from varuna_sdk.manager.runs import RunInfo, clip, find_runs, read_run

from .theme import CSS, STATE_COLORS

JOBS_CSS = CSS + """
table.jobs { border-collapse: collapse; width: 100%; font-size: 13px; background: white; }
table.jobs th, table.jobs td { text-align: left; padding: 6px 8px; border-bottom: 1px solid #e3e7ee; }
table.jobs th { color: #5f6b7a; font-weight: 600; font-size: 12px; }
table.jobs td.num { font-variant-numeric: tabular-nums; white-space: nowrap; }
table.jobs .badge { color: white; border-radius: 10px; padding: 1px 8px; font-size: 11px; }
table.jobs .bar { display: inline-block; height: 6px; background: #e3e7ee; width: 80px; vertical-align: middle;
                  margin-left: 6px; border-radius: 3px; overflow: hidden; }
table.jobs .bar i { display: block; height: 6px; background: #4C78A8; }
@media (max-width: 1000px) { table.jobs .wide { display: none; } }
"""


def _esc(v) -> str:
    return html.escape(str(v), quote=True)


def _duration(s: float | None) -> str:
    if s is None:
        return "–"
    s = max(0.0, float(s))
    return f"{s:.0f} s" if s < 90 else f"{s / 60:.0f} min" if s < 5400 else f"{s / 3600:.1f} h"


def run_folder(root: str | Path, name: str) -> Path:
    """The run folder ``name`` inside ``root`` (a direct child holding ``events.db``). Raises
    ``FileNotFoundError`` for any other name (``..``, slashes, a folder without an event log)."""
    base = Path(root).resolve()
    if not name or name != Path(name).name or name in (".", ".."):
        raise FileNotFoundError(f"no run {name!r} in {base}")
    path = (base / name).resolve()
    if path.parent != base or not (path / "events.db").is_file():
        raise FileNotFoundError(f"no run {name!r} in {base}")
    return path


def jobs_table_html(runs: list[RunInfo]) -> str:
    """The jobs table as HTML (every value escaped); each job's name links to its page."""
    if not runs:
        return '<p class="muted">No runs here yet: a run folder appears once its job has started.</p>'
    head = ("job", "state", "plan", "step", "elapsed", "ETA", "cost", "morphs", "last event")
    rows = []
    for r in runs:
        pct = r.percent
        bar = (f'<span class="bar"><i style="width:{min(100.0, pct):.0f}%"></i></span>' if pct is not None else "")
        step = f"{r.steps_done:,}/{r.steps_total:,}" if r.steps_total else f"{r.steps_done:,}/?"
        pct_text = f" ({pct:.0f} %)" if pct is not None else ""
        color = STATE_COLORS.get(r.state, "#455A64")
        rows.append(
            f'<tr data-job="{_esc(r.name)}"><td><a href="job?run={_esc(r.name)}">{_esc(r.name)}</a></td>'
            f'<td><span class="badge" style="background:{color}">{_esc(r.state_text)}</span></td>'
            f'<td class="wide">{_esc(r.plan)}</td><td class="num">{_esc(step + pct_text)}{bar}</td>'
            f'<td class="num">{_esc(_duration(r.elapsed_s))}</td><td class="num">{_esc(_duration(r.eta_s))}</td>'
            f'<td class="num" title="{_esc(r.cost_text)}">{_esc(cost_text(r.cost, short=True) if r.cost else "–")}</td>'
            f'<td class="num wide">{len(r.morphs)}</td><td class="wide">{_esc(clip(r.last_event, 160))}</td></tr>')
    return ('<table class="jobs"><thead><tr>' + "".join(
        f'<th class="{"wide" if h in ("plan", "morphs", "last event") else ""}">{_esc(h)}</th>' for h in head)
        + "</tr></thead><tbody>" + "".join(rows) + "</tbody></table>")


def read_runs(root: str | Path) -> list[RunInfo]:
    """``read_run`` of every run folder in ``root``, newest first; a folder that cannot be read
    right now (being created) is left out until the next refresh."""
    out = []
    for p in find_runs(root):
        try:
            out.append(read_run(p))
        except (OSError, ValueError):
            continue
    return out


def build_jobs_app(root: str | Path, *, refresh_s: float = 2.0, start: bool = True) -> pn.viewable.Viewable:
    """The jobs page of the folder of runs ``root`` (see the module docstring). Raises
    ``FileNotFoundError`` when ``root`` does not exist, ``NotADirectoryError`` when it is a file."""
    root = Path(root)
    find_runs(root)  # raises for a missing folder
    header = pn.pane.HTML("", stylesheets=[JOBS_CSS], sizing_mode="stretch_width", margin=(4, 8))
    table = pn.pane.HTML("", stylesheets=[JOBS_CSS], sizing_mode="stretch_width", margin=(4, 8), name="jobs_table")

    def update() -> None:
        runs = read_runs(root)
        active = sum(r.active for r in runs)
        header.object = (f'<div class="hdr"><div class="title">varuna · jobs in {_esc(root.resolve())}</div>'
                         f'<span class="muted">{len(runs)} job(s), {active} active</span></div>')
        new = jobs_table_html(runs)
        if new != table.object:
            table.object = new

    update()
    layout = pn.Column(header, table, sizing_mode="stretch_width", styles={"background": "#f3f5f8"}, margin=0)
    if start:
        layout.callback = pn.state.add_periodic_callback(update, period=int(refresh_s * 1000))  # type: ignore[attr-defined]
    return layout
