"""The dashboard itself: Panel layout + Bokeh figures over a ``TelemetryStore``, updated live.

``build_app(source)`` returns the Panel object for one job (a run folder or its ``events.db``):
embed it in a notebook (``job.dashboard()``), or serve it (``dashboard.server.serve`` adds the
login). Every browser session gets its own ``Dashboard`` (figures, cursors) over one shared store
per event log, and one periodic callback that reads only rows appended since the last tick
(``EventLog.*(since_id=...)``) and pushes only what changed: ``ColumnDataSource.stream`` for new
metric points, new ``data`` / ``object`` / ``value`` for the rest.

Views (issue 6): job state header; VM pool (up / notice / pre-empted / lost, straggler, GPUs,
$ per hour); partition map (stages x replicas from the latest ``plan``: segments per stage, host
per cell, memory per stage); throughput (measured vs the plan's predicted examples/s) and loss,
streaming, with morphs marked; simulator estimates (predicted vs measured step time per plan
generation, the ranked configuration table); pipeline timeline (the plan's simulated Gantt of
F/R/B per stage, and per-stage compute per step simulated vs measured from heartbeats); morph
history; recent events.

Large runs: the line charts hold at most ``2 * max_points`` points per series: history is drawn
min/max-downsampled to ``max_points`` (``store.minmax_indices``), new points are streamed, and the
series is re-downsampled from the store when it reaches twice that.

Read-only by construction: no widget here changes anything outside the browser, and the store
opens the event log read-only. Imports panel, bokeh, pandas, ``dashboard.store`` and
``varuna_sdk.manager.runs`` (sentences for morphs and events; read-only); must never import
torch or any part of ``varuna_sdk`` that drives a job.
"""

from __future__ import annotations

import html
import logging
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import panel as pn
from bokeh.models import ColumnDataSource, FactorRange, HoverTool, LabelSet, NumeralTickFormatter
from bokeh.plotting import figure

from varuna_sdk.manager.billing import cost_text
from varuna_sdk.manager.decisions import DriftRule, step_time_drift
from varuna_sdk.manager.runs import drift_sentence, event_sentence, log_label, log_tail, morph_sentence, worker_logs

from .store import VM_STATES, TelemetryStore, minmax_indices

log = logging.getLogger(__name__)

#: Colours (colour-blind safe Tableau 10) of the pipeline actions and the VM states.
ACTION_COLORS = {"F": "#4C78A8", "R": "#F58518", "B": "#54A24B", "other": "#BAB0AC"}
# per-stage compute per step: measured waiting (blocked on a neighbour stage) is its own segment
STEP_PARTS = ("F", "R", "B", "wait", "other")
PART_COLORS = {**ACTION_COLORS, "wait": "#E8E0C8"}
PART_NAMES = {"F": "forward", "R": "recompute", "B": "backward", "wait": "waiting for a neighbour stage (measured)",
              "other": "rest: comm, all-reduce, optimizer, idle"}
LOG_TAIL_BYTES = 32 * 1024   # of a worker log shown on the page
DRIFT_RULE = DriftRule()   # the manager's default: 15 % off the prediction for 5 steps
LOSS_SPAN = 20   # steps of the smoothed loss line (EMA span)
CAUSE_LABELS = {"notice": "pre-emption notice", "loss": "VM lost (no notice)", "grow": "VM back: grow",
                "straggler": "straggler excluded", "failure": "worker failure", "stop_timeout": "stop timed out",
                "manager_restart": "manager restarted"}
STATUS_COLORS = {"up": "#2E7D32", "notice": "#E08E00", "pre-empted": "#C62828", "lost": "#7B1F1F",
                 "released": "#757575"}
STATE_COLORS = {"PENDING": "#607D8B", "PROVISIONING": "#1565C0", "RUNNING": "#2E7D32", "MORPHING": "#E08E00",
                "RECOVERING": "#E08E00", "SUCCEEDED": "#00695C", "FAILED": "#C62828", "STOPPED": "#616161"}
STAGE_COLORS = ["#C6DBEF", "#FDD0A2", "#C7E9C0", "#DADAEB", "#FCBBA1", "#D9D9D9", "#FDE0EF", "#E5F5E0",
                "#DEEBF7", "#FEE6CE"]

CSS = """
:host { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #1d2330; }
h3 { margin: 2px 0 6px 0; font-size: 15px; font-weight: 600; color: #1d2330; }
.muted { color: #5f6b7a; font-size: 12px; }
.hdr { display: flex; flex-wrap: wrap; align-items: center; gap: 10px 18px; }
.title { font-size: 20px; font-weight: 700; }
.title .job { font-size: 13px; font-weight: 400; color: #5f6b7a; margin-left: 8px; }
.badge { display: inline-block; padding: 2px 9px; border-radius: 10px; color: white; font-size: 12px;
         font-weight: 600; letter-spacing: .02em; }
.tiles { display: flex; flex-wrap: wrap; gap: 8px; width: 100%; }
.tile { background: #f3f5f8; border-radius: 6px; padding: 5px 12px; min-width: 92px; }
.tile .k { font-size: 11px; color: #5f6b7a; text-transform: uppercase; letter-spacing: .04em; }
.tile .v { font-size: 17px; font-weight: 600; white-space: nowrap; }
.pool { display: grid; grid-template-columns: repeat(auto-fill, minmax(178px, 1fr)); gap: 8px; }
.vm { border: 1px solid #d5dae1; border-left: 6px solid #999; border-radius: 6px; padding: 6px 8px;
      background: white; font-size: 12px; line-height: 1.45; }
.vm .name { font-weight: 600; font-size: 13px; word-break: break-all; }
.vm.gone { background: #f7f7f7; color: #6b6b6b; }
.flag { display: inline-block; margin-top: 2px; padding: 0 6px; border-radius: 8px; background: #6A3D9A;
        color: white; font-size: 11px; }
pre.logs { max-height: 320px; overflow: auto; background: #1e1e1e; color: #ddd; padding: 8px; font-size: 11.5px;
           white-space: pre-wrap; overflow-wrap: anywhere; margin: 4px 0; }
.drift { background: #FFF4E0; border-left: 4px solid #E08E00; padding: 6px 10px; margin: 2px 0 6px 0;
         font-size: 12.5px; line-height: 1.4; overflow-wrap: anywhere; }
table.cmp { border-collapse: collapse; font-size: 12px; margin-top: 4px; }
table.cmp th, table.cmp td { border-bottom: 1px solid #e3e6ea; padding: 2px 10px; text-align: right; }
table.cmp th:first-child, table.cmp td:first-child { text-align: left; }
.legend span { display: inline-block; margin-right: 12px; font-size: 12px; }
.legend i { display: inline-block; width: 11px; height: 11px; margin-right: 4px; vertical-align: -1px;
            border-radius: 2px; }
"""

FLEX_HALF = {"flex": "1 1 460px", "min-width": "0"}   # half a wide screen, the whole of a narrow one
SECTION_STYLE = {"background": "white", "border": "1px solid #dde1e6", "border-radius": "8px",
                 "padding": "6px 10px", "overflow-x": "auto"}   # a wide table scrolls in its card, not the page


def _esc(v: Any) -> str:
    return html.escape(str(v), quote=True)


def _clock(t: float | None) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(t)) if t else "–"


def _num(v: Any, fmt: str = "{:.3g}", none: str = "–") -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return none
    return fmt.format(v)


def _bytes(b: Any) -> str:
    if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b):
        return "–"
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= k:
            return f"{b / k:.2f} {unit}"
    return f"{b:.0f} B"


def _plan_label(p: dict | None) -> str:
    """``P=2×D=2 (mbs 4, m 2)`` for a plan payload (or a morph's ``old``/``new``)."""
    if not isinstance(p, dict):
        return "–"
    s = f"P={p.get('P', '?')}×D={p.get('D', '?')}"
    extra = [f"mbs {p['micro_batch_size']}"] if p.get("micro_batch_size") is not None else []
    m = p.get("num_micro_batches", p.get("m"))
    if m is not None:
        extra.append(f"m {m}")
    return s + (f" ({', '.join(extra)})" if extra else "")


def _segments(segs: Any) -> str:
    if not isinstance(segs, list) or not segs:
        return "?"
    if all(isinstance(x, int) for x in segs) and segs == list(range(segs[0], segs[-1] + 1)):
        return f"{segs[0]}" if len(segs) == 1 else f"{segs[0]}–{segs[-1]}"
    return ",".join(str(x) for x in segs)


def _section(title: str, *objs, half: bool = False, **kw) -> pn.Column:
    """A titled white card; ``half``: one of two side by side on a wide screen (``_wrap``)."""
    styles = {**SECTION_STYLE, **(FLEX_HALF if half else {})}
    return pn.Column(pn.pane.HTML(f"<h3>{_esc(title)}</h3>", stylesheets=[CSS], margin=(0, 0)), *objs,
                     styles=styles, sizing_mode="stretch_width", margin=(6, 6), **kw)


def _wrap(*objs) -> pn.FlexBox:
    """Side by side while each gets at least its flex basis (``FLEX_HALF``: 460 px), else one under
    the other: two columns on a laptop, one below ~1000 px."""
    return pn.FlexBox(*objs, flex_wrap="wrap", sizing_mode="stretch_width", margin=0)


def _fig(**kw) -> figure:
    kw = {"toolbar_location": "right", "tools": "pan,wheel_zoom,box_zoom,reset,save", "sizing_mode": "stretch_width",
          **kw}
    f = figure(**kw)
    f.toolbar.logo = None
    f.background_fill_color = "white"
    f.border_fill_color = "white"
    f.outline_line_color = None
    f.grid.grid_line_color = "#eceff3"
    f.axis.axis_line_color = "#9aa3ae"
    f.axis.major_label_text_color = "#333a45"
    f.axis.axis_label_text_font_style = "normal"
    f.axis.axis_label_text_color = "#333a45"
    f.title.text_font_size = "12px"
    return f


class Dashboard:
    """One browser session's views over ``store``. ``layout`` is the Panel object; ``update()``
    (called every ``refresh_s`` seconds once ``start()`` ran) refreshes the store and pushes what
    changed. ``max_points``: points per line series drawn from history (see module doc)."""

    def __init__(self, store: TelemetryStore, *, refresh_s: float = 1.0, max_points: int = 2000,
                 title: str | None = None):
        if refresh_s <= 0:
            raise ValueError(f"refresh_s must be > 0 seconds, got {refresh_s}")
        if max_points < 100:
            raise ValueError(f"max_points must be at least 100, got {max_points}")
        self.store = store
        self.refresh_s = refresh_s
        self.max_points = max_points
        config = _job_config(store.path)
        self.title = title or (config.get("name") if isinstance(config.get("name"), str) else None) \
            or store.path.parent.name
        steps = (config.get("train") or {}).get("steps") if isinstance(config.get("train"), dict) else None
        self.steps_total = steps if isinstance(steps, int) and not isinstance(steps, bool) and steps > 0 else None
        self._seen_events = -1
        self._seen_hb = -1
        self._streamed = 0  # metric rows already in the line sources
        self._callback = None
        self._failed: set[str] = set()
        self.updates = 0
        self._build()
        self.update()

    # -------------------------------------------------------------------------------- build
    def _build(self) -> None:
        self.header = pn.pane.HTML("", stylesheets=[CSS], sizing_mode="stretch_width", margin=(4, 8))
        self.pool = pn.pane.HTML("", stylesheets=[CSS], sizing_mode="stretch_width", min_height=120)

        # partition map: stages (rows) x replicas (columns), memory per stage beside it
        self.cells = ColumnDataSource(dict(x=[], y=[], color=[], line=[], label=[], host=[], rank=[],
                                           stage=[], replica=[], segs=[], mem=[], status=[]),
                                      name="partition_cells")
        self.pmap = _fig(height=300, x_range=FactorRange(), y_range=FactorRange(), tools="hover,save",
                         title="")
        self.pmap.rect("x", "y", 0.94, 0.9, source=self.cells, fill_color="color", line_color="line",
                       line_width=3)
        self.pmap_text = self.pmap.text("x", "y", text="label", source=self.cells, text_align="center",
                                        text_baseline="middle", text_font_size="12px", text_color="#1d2330")
        self.pmap.select_one(HoverTool).tooltips = [("rank", "@rank"), ("stage", "@stage"), ("replica", "@replica"),
                                                    ("host", "@host (@status)"), ("segments", "@segs"),
                                                    ("memory", "@mem")]
        self.pmap.grid.visible = False
        self.pmap.xaxis.major_label_orientation = 0
        self.mem_src = ColumnDataSource(dict(y=[], gib=[], text=[]), name="stage_memory")
        self.mem = _fig(height=150, y_range=self.pmap.y_range, tools="hover", title="memory per GPU (GiB)")
        self.mem.hbar(y="y", right="gib", height=0.6, source=self.mem_src, color="#8DA0CB")
        self.mem.text(x=0, y="y", text="text", source=self.mem_src, text_baseline="middle", text_font_size="11px",
                      x_offset=4, text_color="#1d2330")
        self.mem.yaxis.major_label_text_font_size = "11px"
        self.mem.x_range.start = 0
        self.mem.select_one(HoverTool).tooltips = [("stage", "@y"), ("memory", "@text")]

        # throughput and loss
        self.tput = ColumnDataSource(dict(step=[], value=[]), name="throughput")
        self.loss = ColumnDataSource(dict(step=[], value=[]), name="loss")
        self.loss_smooth = ColumnDataSource(dict(step=[], value=[]), name="loss_smoothed")
        self._ema: float | None = None   # the smoothed loss at the last streamed point
        self.pred = ColumnDataSource(dict(x0=[], x1=[], y=[], gen=[]), name="predicted")
        self.morph_marks = ColumnDataSource(dict(x=[], label=[]), name="morph_marks")
        self.tput_fig = _fig(height=260, title="examples/s: measured (line) vs simulator (dashed)",
                             x_axis_label="step", y_axis_label="examples / s")
        self.tput_fig.line("step", "value", source=self.tput, line_width=1.6, color="#4C78A8",
                           legend_label="measured")
        self.tput_fig.segment("x0", "y", "x1", "y", source=self.pred, line_dash="dashed", line_width=2,
                              color="#E45756", legend_label="predicted")
        self.loss_fig = _fig(height=260, title="training loss", x_axis_label="step", y_axis_label="loss",
                             x_range=self.tput_fig.x_range)
        self.loss_fig.line("step", "value", source=self.loss, line_width=1.2, color="#54A24B", alpha=0.45,
                           legend_label="per step")
        self.loss_fig.line("step", "value", source=self.loss_smooth, line_width=2.2, color="#1B5E20",
                           legend_label=f"smoothed (EMA, span {LOSS_SPAN} steps)")
        self.loss_fig.legend.location = "top_right"
        self.loss_fig.legend.label_text_font_size = "11px"
        self.loss_fig.legend.background_fill_alpha = 0.8
        for f in (self.tput_fig, self.loss_fig):   # each morph: a dotted line at its step, labelled with its cause
            f.vspan(x="x", source=self.morph_marks, line_color="#E08E00", line_width=2, line_dash="dotted")
            f.add_layout(LabelSet(x="x", y=6, y_units="screen", text="label", source=self.morph_marks, angle=math.pi / 2,
                                  x_offset=-3, text_font_size="10px", text_color="#9A5B00", text_align="left",
                                  text_baseline="bottom"))
        self.tput_fig.y_range.start = 0
        self.tput_fig.legend.location = "bottom_right"
        self.tput_fig.legend.label_text_font_size = "11px"
        self.tput_fig.legend.background_fill_alpha = 0.8
        self.tput_fig.yaxis.formatter = NumeralTickFormatter(format="0.[0]")

        # simulator estimates
        self.compare = pn.pane.HTML("", stylesheets=[CSS], sizing_mode="stretch_width")
        self.ranked = pn.widgets.Tabulator(pd.DataFrame(), disabled=True, show_index=False, height=230,
                                           sizing_mode="stretch_width", layout="fit_data_stretch",
                                           selectable=False)

        # pipeline timeline: simulated Gantt, then per-stage compute per step, simulated vs measured
        self.gantt_src = {k: ColumnDataSource(dict(y=[], left=[], right=[], mb=[], action=[]), name=f"timeline_{k}")
                          for k in ACTION_COLORS}
        self.gantt = _fig(height=240, y_range=FactorRange(), x_axis_label="seconds into the mini-batch",
                          title="simulated mini-batch (plan)", tools="pan,wheel_zoom,box_zoom,reset,hover,save")
        for k, src in self.gantt_src.items():
            self.gantt.hbar(y="y", left="left", right="right", height=0.72, source=src, color=ACTION_COLORS[k],
                            line_color="white", line_width=0.5)
        self.gantt.select_one(HoverTool).tooltips = [("", "@action micro-batch @mb"), ("stage", "@y"),
                                                     ("start", "@left{0.000} s"), ("end", "@right{0.000} s")]
        self.stage_src = ColumnDataSource({"y": [], **{k: [] for k in STEP_PARTS}}, name="stage_compute")
        self.stage_fig = _fig(height=240, y_range=FactorRange(), x_axis_label="seconds per step",
                              title="compute per step by stage: simulated vs measured (heartbeats)",
                              tools="hover,save")
        self.stage_fig.hbar_stack(list(STEP_PARTS), y="y", height=0.7, source=self.stage_src,
                                  color=[PART_COLORS[k] for k in STEP_PARTS], line_color="white")
        self.stage_fig.select_one(HoverTool).tooltips = [("", "@y"), ("forward", "@F{0.000} s"),
                                                         ("recompute", "@R{0.000} s"), ("backward", "@B{0.000} s"),
                                                         ("waiting for a neighbour stage", "@wait{0.000} s"),
                                                         ("rest of step", "@other{0.000} s")]
        self.stage_fig.x_range.start = 0

        # morphs and events
        # the sentence wraps in a column of its own width (a long one is never cut off at the edge)
        said = {"formatters": {"what happened": {"type": "textarea"}}, "widths": {"what happened": 560}}
        self.morph_table = pn.widgets.Tabulator(pd.DataFrame(), disabled=True, show_index=False, height=150,
                                                sizing_mode="stretch_width", layout="fit_data_stretch",
                                                selectable=False, **said)
        self.event_table = pn.widgets.Tabulator(pd.DataFrame(), disabled=True, show_index=False, height=360,
                                                sizing_mode="stretch_width", layout="fit_data_stretch",
                                                selectable=False, **said)
        # the workers' output of a generation (the run folder's gen<N>/workers.log), newest first
        self.log_pick = pn.widgets.Select(label="generation", options=[], width=220)
        self.log_view = pn.pane.HTML('<pre class="logs">no worker output yet</pre>', stylesheets=[CSS],
                                     sizing_mode="stretch_width")
        self.log_pick.param.watch(lambda _e: self._safe(self._update_logs), "value")
        self._log_seen: tuple | None = None
        legend = "".join(f'<span><i style="background:{c}"></i>{_esc(k)}</span>' for k, c in STATUS_COLORS.items())
        actions = ('<div class="legend">' + "".join(f'<span><i style="background:{PART_COLORS[k]}"></i>{_esc(n)}</span>'
                                                    for k, n in PART_NAMES.items()) + "</div>")
        self.layout = pn.Column(
            self.header,
            _wrap(_section("VM pool", pn.pane.HTML(f'<div class="legend">{legend}'
                                                   '<span><i style="background:#6A3D9A"></i>straggler</span></div>',
                                                   stylesheets=[CSS], margin=(0, 0, 4, 0)), self.pool, half=True),
                  _section("Partition map (stages × replicas)",
                           pn.pane.Bokeh(self.pmap, sizing_mode="stretch_width"),
                           pn.pane.Bokeh(self.mem, sizing_mode="stretch_width"), half=True)),
            _wrap(_section("Throughput", pn.pane.Bokeh(self.tput_fig, sizing_mode="stretch_width"), half=True),
                  _section("Loss", pn.pane.Bokeh(self.loss_fig, sizing_mode="stretch_width"), half=True)),
            _section("Simulator estimates", self.compare, self.ranked),
            _section("Pipeline timeline", pn.pane.HTML(actions, stylesheets=[CSS], margin=(0, 0, 4, 0)),
                     _wrap(pn.pane.Bokeh(self.gantt, sizing_mode="stretch_width", styles=FLEX_HALF),
                           pn.pane.Bokeh(self.stage_fig, sizing_mode="stretch_width", styles=FLEX_HALF))),
            _section("Morph history", self.morph_table),
            _section("Recent events", self.event_table),
            _section("Worker logs", self.log_pick, self.log_view),
            sizing_mode="stretch_width", styles={"background": "#f3f5f8"}, margin=0,
        )
        self._bokeh_panes = [o for o in self.layout.select(pn.pane.Bokeh)]

    # -------------------------------------------------------------------------------- update
    def start(self) -> "Dashboard":
        """Start the periodic refresh in the current session (server or notebook)."""
        if self._callback is None:
            self._callback = pn.state.add_periodic_callback(self.update, period=int(self.refresh_s * 1000))
        return self

    def stop(self) -> None:
        if self._callback is not None:
            self._callback.stop()
            self._callback = None

    def _safe(self, view) -> None:
        """Run one view's update; a payload it cannot draw is logged, the other views go on."""
        try:
            view()
        except Exception:  # noqa: BLE001 - one malformed event must not freeze the dashboard
            if view.__name__ not in self._failed:
                self._failed.add(view.__name__)
                log.exception("dashboard view %s failed on the event log's data", view.__name__)

    def update(self) -> None:
        """Read new rows and push what changed (one periodic tick)."""
        st = self.store
        st.refresh()
        v = st.version
        events_changed = v.events != self._seen_events
        if events_changed:
            self._seen_events = v.events
            for view in (self._update_partition, self._update_ranked, self._update_timeline, self._update_tables,
                         self._update_morph_marks):
                self._safe(view)
        hb_changed = v.heartbeats != self._seen_hb
        if hb_changed:
            self._seen_hb = v.heartbeats
        if events_changed or hb_changed:
            self._safe(self._update_pool)
            self._safe(self._update_stage_compute)
        metrics_changed = len(st.metrics) != self._streamed
        if metrics_changed:
            self._safe(self._update_lines)
        if events_changed or metrics_changed:
            self._safe(self._update_compare)
            self._safe(self._update_predicted)
        self._safe(self._update_header)
        self._safe(self._update_logs)
        self.updates += 1
        if (events_changed or hb_changed or metrics_changed) and not _served():
            pn.io.push_notebook(*self._bokeh_panes)  # notebooks need Bokeh changes pushed

    def _update_logs(self) -> None:
        """The chosen generation's worker output, its last ``LOG_TAIL_BYTES`` (re-read only when the
        file changed); the newest generation is chosen until the user picks another."""
        logs = worker_logs(Path(self.store.path).parent)   # generation order, then the workers' own
        files = {log_label(f): f for f in logs}
        gens = [log_label(f) for f in logs if f.name == "workers.log"]
        names = gens[::-1] + [n for n in files if n not in gens]   # the newest generation first
        if names != self.log_pick.options:
            follow = self.log_pick.value in (None, (self.log_pick.options or [None])[0])
            self.log_pick.options = names
            if follow and names:
                self.log_pick.value = names[0]
        f = files.get(self.log_pick.value)
        if f is None:
            return
        try:
            st = f.stat()
        except OSError:
            return
        seen = (str(f), st.st_size, st.st_mtime_ns)
        if seen == self._log_seen:
            return
        self._log_seen = seen
        text = log_tail(f, LOG_TAIL_BYTES)
        self.log_view.object = (f'<div class="muted">{_esc(log_label(f))}, last {len(text.splitlines())} '
                                f'lines (varuna logs RUN prints all)</div><pre class="logs">{_esc(text) or "(empty)"}</pre>')

    def _update_morph_marks(self) -> None:
        marks = [e.payload for e in self.store.morphs if _finite(e.payload.get("from_step"))]
        self.morph_marks.data = dict(x=[float(p["from_step"]) for p in marks],
                                     label=[CAUSE_LABELS.get(str(p.get("cause")), str(p.get("cause"))) for p in marks])

    def _update_header(self) -> None:
        st = self.store
        js = st.job_state.payload if st.job_state else {}
        state = str(js.get("state") or ("RUNNING" if len(st.metrics) else "WAITING"))
        color = STATE_COLORS.get(state.upper(), "#455A64")
        n = len(st.metrics)
        last = lambda c: st.metrics[c][-1] if n else math.nan  # noqa: E731
        counts = st.vm_counts()
        plan = st.plan
        job_id = next((e.job_id for e in (st.plans or list(st.recent)) if e.job_id), None)
        since = f" since {_clock(st.job_state.time)} UTC" if st.job_state else ""
        reason = str(js.get("reason") or "")
        done = int(last("step")) + 1 if n and _finite(last("step")) else 0
        ended = state.upper() in ("SUCCEEDED", "FAILED", "STOPPED")
        tiles = [("step", _progress(done, self.steps_total)), ("elapsed", _duration(self._elapsed(ended))),
                 ("ETA", "–" if ended else _duration(self._eta(done))), ("loss", _num(last("loss"), "{:.4f}")),
                 ("examples/s", _num(last("examples_per_s"), "{:,.1f}")),
                 ("tokens/s", _num(last("tokens_per_s"), "{:,.0f}")),
                 ("model", str((plan or {}).get("labels", {}).get("model") or "–")),
                 ("plan", (f"P={plan.get('P')} × D={plan.get('D')} · gen {plan.get('generation', '?')}"
                           if plan else "–")),
                 ("VMs up", f"{counts['up'] + counts['notice']} / {len(st.vms)}"),
                 ("cost", cost_text(st.cost())),
                 ("last step", _clock(last("time") if n else None) + (" UTC" if n else ""))]
        html_ = (f'<div class="hdr"><div class="title">varuna · {_esc(self.title)}'
                 + (f'<span class="job">job {_esc(job_id)}</span>' if job_id else "") + "</div>"
                 f'<span class="badge" data-state="{_esc(state)}" style="background:{color}">{_esc(state)}</span>'
                 f'<span class="muted">{_esc(since)}{" — " + _esc(reason) if reason else ""}</span>'
                 '<div class="tiles">' + "".join(
                     f'<div class="tile"><div class="k">{_esc(k)}</div><div class="v">{_esc(v)}</div></div>'
                     for k, v in tiles) + "</div></div>")
        if html_ != self.header.object:
            self.header.object = html_

    def _elapsed(self, ended: bool) -> float | None:
        """Seconds from the job's first event to now, or to its end."""
        st = self.store
        if st.first_event_time is None:
            return None
        end = st.job_state.time if ended and st.job_state is not None else time.time()
        return max(0.0, end - st.first_event_time)

    def _eta(self, done: int) -> float | None:
        """Steps left × the median time of the latest 20 steps (None: total or step times unknown)."""
        if self.steps_total is None:
            return None
        times = self.store.metrics["step_time_s"][-20:]
        times = times[np.isfinite(times)]
        return max(0, self.steps_total - done) * float(np.median(times)) if len(times) else None

    def _update_pool(self) -> None:
        st = self.store
        cards = []
        for vm in st.vms.values():
            color = STATUS_COLORS.get(vm.status, "#999")
            ranks = st.ranks_of(vm.name) if vm.status in ("up", "notice") else []
            lines = [f'<div class="name">{_esc(vm.name)}</div>',
                     f'<span class="badge" style="background:{color}">{_esc(vm.status)}</span>'
                     f'<div class="muted">since {_clock(vm.since)} UTC</div>',
                     "<div>" + ("CPU worker" if vm.gpus == 0 else
                                (f"{vm.gpus} GPU{'' if vm.gpus == 1 else 's'}" if vm.gpus is not None
                                 else "GPUs not reported"))
                     + (f" · {_esc(vm.kind)}" if vm.kind else "")
                     + (f" · ${vm.price_per_hour:.2f}/h" if vm.price_per_hour is not None else "") + "</div>"]
            if ranks:
                lines.append("<div>" + ", ".join(f"rank {r} (S{s}·R{d})" for r, s, d in ranks) + "</div>")
            elif vm.status in ("up", "notice"):
                lines.append('<div class="muted">no rank in the plan</div>')
            if vm.status == "notice" and vm.notice_deadline:
                lines.append(f"<div>leaves by {_clock(vm.notice_deadline)} UTC</div>")
            if vm.reason and vm.status not in ("up", "notice"):
                lines.append(f'<div class="muted">{_esc(vm.reason)}</div>')
            if vm.straggler:
                s = vm.straggler
                lines.append(f'<span class="flag">straggler ×{_num(s.get("slowdown"), "{:.2f}", "?")}'
                             f'{" · " + _esc(s["action"]) if s.get("action") else ""}</span>')
            gone = "" if vm.status in ("up", "notice") else " gone"
            cards.append(f'<div class="vm{gone}" data-vm="{_esc(vm.name)}" data-status="{_esc(vm.status)}" '
                         f'data-straggler="{"1" if vm.straggler else "0"}" style="border-left-color:{color}">'
                         + "".join(lines) + "</div>")
        c = st.vm_counts()
        summary = " · ".join(f"{c[s]} {s}" for s in VM_STATES if c[s]) or "no VMs yet"
        if c["stragglers"]:
            summary += f" · {c['stragglers']} straggler{'s' if c['stragglers'] > 1 else ''}"
        known = [vm.gpus for vm in st.vms.values() if vm.status in ("up", "notice") and vm.gpus is not None]
        gpus = f" · {sum(known)} GPUs up" if known else ""
        obj = (f'<div class="muted" data-vms="{len(st.vms)}" style="margin-bottom:6px">{len(st.vms)} VMs: '
               f'{_esc(summary)}{gpus}</div><div class="pool">' + "".join(cards) + "</div>")
        if obj != self.pool.object:
            self.pool.object = obj

    def _update_partition(self) -> None:
        st = self.store
        plan = st.plan or {}
        P, D = plan.get("P"), plan.get("D")
        if not (isinstance(P, int) and isinstance(D, int) and P >= 1 and D >= 1):
            self.cells.data = {k: [] for k in self.cells.data}
            self.mem_src.data = dict(y=[], gib=[], text=[])
            self.pmap.title.text = "no plan yet"
            return
        bounds = plan.get("boundaries") or []
        hosts = plan.get("hosts") or []
        mem = plan.get("mem_per_stage_bytes") or []
        ylab = [f"stage {s} · seg {_segments(bounds[s]) if s < len(bounds) else '?'}" for s in range(P)]
        xlab = [f"replica {d}" for d in range(D)]
        self.pmap.y_range.factors = list(reversed(ylab))
        self.pmap.x_range.factors = xlab
        data = {k: [] for k in self.cells.data}
        small = P * D > 48
        for d in range(D):
            for s in range(P):
                r = d * P + s  # rank = replica * P + stage (varuna_sdk.pipeline.groups.Topology)
                host = hosts[r] if r < len(hosts) and isinstance(hosts[r], str) else "?"
                vm = st.vms.get(host)
                status = vm.status if vm else "unknown"
                data["x"].append(xlab[d])
                data["y"].append(ylab[s])
                data["color"].append(STAGE_COLORS[s % len(STAGE_COLORS)])
                # a cell on a VM that is not up (notice, pre-empted, lost) gets its status colour as border
                data["line"].append("#ffffff" if status in ("up", "unknown") else STATUS_COLORS.get(status, "#999"))
                data["label"].append(f"{r}" if small else f"rank {r}\n{host}")
                data["host"].append(host)
                data["rank"].append(r)
                data["stage"].append(s)
                data["replica"].append(d)
                data["segs"].append(_segments(bounds[s]) if s < len(bounds) else "?")
                data["mem"].append(_bytes(mem[s]) if s < len(mem) else "–")
                data["status"].append(status)
        self.cells.data = data
        self.pmap_text.glyph.text_font_size = "10px" if small or D > 6 else "12px"
        self.pmap.title.text = (f"generation {plan.get('generation', '?')}: P={P} × D={D} = {P * D} GPUs "
                                "(cell: rank, host)")
        raw = [float(mem[s]) if s < len(mem) and isinstance(mem[s], (int, float)) else 0.0 for s in range(P)]
        unit, scale = ("GiB", 2**30) if max(raw + [0.0]) >= 2**30 else ("MiB", 2**20)   # the labels' unit
        vals = [b / scale for b in raw]
        self.mem_src.data = dict(y=ylab, gib=vals, text=[_bytes(mem[s]) if s < len(mem) else "–" for s in range(P)])
        self.mem.x_range.end = max(vals + [1e-3]) * 1.6
        self.mem.title.text = f"memory per GPU by stage ({unit})"
        self.mem.height = 70 + 26 * max(P, 1)

    def _update_ranked(self) -> None:
        plan = self.store.plan or {}
        rows = [r for r in plan.get("rows") or [] if isinstance(r, dict)][:40]  # big G: hundreds of rows
        if not rows:
            self.ranked.value = pd.DataFrame({"": ["no plan yet"]})
            return
        out = []
        prices = plan.get("prices") if isinstance(plan.get("prices"), dict) else {}
        cost_col = "$/1k ex spot" + ("" if prices and not prices.get("example") else " (example prices)")
        key = (plan.get("P"), plan.get("D"), plan.get("micro_batch_size"))
        for i, r in enumerate(rows):
            feasible = r.get("feasible", True)
            mem = r.get("stage_memory_bytes")
            running = (r.get("P"), r.get("D"), r.get("micro_batch_size")) == key
            out.append({
                "": "▶ running" if running else "",
                "rank": i + 1 if feasible else None,
                "P": r.get("P"), "D": r.get("D"), "micro-batch": r.get("micro_batch_size"),
                "m": r.get("m", r.get("num_micro_batches")), "idle GPUs": r.get("idle_gpus"),
                "step (s)": _round(r.get("time_s"), 4), "examples/s": _round(r.get("examples_per_s"), 2),
                "bubble": f"{r['bubble_fraction']:.1%}" if _finite(r.get("bubble_fraction")) else "",
                "max mem/GPU": _bytes(max(mem)) if isinstance(mem, list) and mem else "",
                cost_col: _round(r.get("cost_per_1k_spot"), 4),
                "stages (segments)": " | ".join(_segments(s) for s in r.get("stages") or []),
                "note": "" if feasible else str(r.get("reason") or "excluded"),
            })
        if not any(o["note"] for o in out):
            for o in out:
                del o["note"]
        self.ranked.height = min(260, 40 + 31 * len(out))
        self.ranked.value = pd.DataFrame(out)

    def _update_compare(self) -> None:
        st = self.store
        if not st.plans:
            self.compare.object = '<span class="muted">waiting for the first plan</span>'
            return
        rows = []
        cur = st.plan
        for e in st.plans[-6:]:
            p = e.payload
            gen = p.get("generation")
            pred = p.get("predicted_step_s")
            meas = st.measured_step_s(gen if isinstance(gen, int) else None) if (
                isinstance(gen, int) or p is cur) else None
            err = (meas - pred) / pred if _finite(pred) and pred and meas is not None else None
            meas_eps = (st.metric_median("examples_per_s", gen if isinstance(gen, int) else None)
                        if isinstance(gen, int) or p is cur else None)
            rows.append(f"<tr><td>{'▶ ' if p is cur else ''}gen {_esc(gen)} · {_esc(_plan_label(p))}</td>"
                        f"<td>{_num(pred, '{:.3f} s')}</td><td>{_num(meas, '{:.3f} s')}</td>"
                        f"<td>{_num(err, '{:+.1%}')}</td>"
                        f"<td>{_num(p.get('examples_per_s'), '{:,.1f}')}</td>"
                        f"<td>{_num(meas_eps, '{:,.1f}')}</td></tr>")
        self.compare.object = self._drift_banner(cur) + (
            '<table class="cmp"><tr><th>plan</th><th>predicted step</th><th>measured step (median, last 20)</th>'
            '<th>error</th><th>predicted ex/s</th><th>measured ex/s</th></tr>' + "".join(rows) + "</table>"
            '<div class="muted" style="margin-top:4px">Ranked configurations of the running plan '
            '(simulator; fastest first, excluded ones last):</div>')

    def _drift_banner(self, plan: dict | None) -> str:
        """A warning above the estimates when the running plan's step time has left its prediction:
        the manager's ``estimate_drift`` event (why, and the estimate re-calibrated from heartbeats),
        or, for a log without one, the same rule applied to the metrics here."""
        st = self.store
        gen = (plan or {}).get("generation")
        ev = next((e for e in reversed(st.drifts) if isinstance(e.payload, dict)
                   and e.payload.get("generation") == gen), None)
        if ev is not None:
            text = drift_sentence(ev.payload, time.time())
        else:
            sel = st.generation_rows(gen if isinstance(gen, int) else None)
            times = [] if sel is None else [float(x) for x in st.metrics["step_time_s"][sel[-50:]]]
            drift = step_time_drift(times, (plan or {}).get("predicted_step_s"), DRIFT_RULE)
            if drift is None:
                return ""
            text = drift_sentence({"drift": drift, "steps": DRIFT_RULE.steps,
                                   "predicted_step_s": plan.get("predicted_step_s"),
                                   "measured_step_s": float(np.median(times[-DRIFT_RULE.steps:]))})
            text += " (no re-calibration recorded for this plan)"
        return f'<div class="drift" data-drift="1">⚠ {_esc(text)}</div>'

    def _update_predicted(self) -> None:
        st = self.store
        spans = st.generation_spans()
        x0, x1, y, gen = [], [], [], []
        for e in st.plans:
            g = e.payload.get("generation")
            eps = e.payload.get("examples_per_s")
            if isinstance(g, int) and g in spans and _finite(eps):
                a, b = spans[g]
                x0.append(a)
                x1.append(max(b, a + 0.5))
                y.append(float(eps))
                gen.append(g)
        if not gen and st.plan and _finite(st.plan.get("examples_per_s")) and len(st.metrics):
            s = st.metrics["step"]
            x0, x1, y, gen = [float(np.nanmin(s))], [float(np.nanmax(s))], [float(st.plan["examples_per_s"])], [0]
        new = dict(x0=x0, x1=x1, y=y, gen=gen)
        if new != dict(self.pred.data):
            self.pred.data = new

    def _update_lines(self) -> None:
        st = self.store
        n = len(st.metrics)
        step = st.metrics["step"]
        if n < self._streamed or len(self.tput.data["step"]) + (n - self._streamed) > 2 * self.max_points:
            self._streamed = 0  # redraw from history, downsampled
        if self._streamed == 0:
            for src, col in ((self.tput, "examples_per_s"), (self.loss, "loss")):
                y = st.metrics[col]
                idx = minmax_indices(y, self.max_points)
                src.data = dict(step=step[idx], value=y[idx])
            smooth = ema(st.metrics["loss"], LOSS_SPAN)
            idx = np.linspace(0, n - 1, min(n, self.max_points)).astype(int) if n else np.zeros(0, int)
            self.loss_smooth.data = dict(step=step[idx], value=smooth[idx])
            self._ema = float(smooth[-1]) if n and np.isfinite(smooth[-1]) else None
        else:
            sl = slice(self._streamed, n)
            for src, col in ((self.tput, "examples_per_s"), (self.loss, "loss")):
                src.stream(dict(step=step[sl], value=st.metrics[col][sl]))
            smooth = ema(st.metrics["loss"][sl], LOSS_SPAN, start=self._ema)
            self.loss_smooth.stream(dict(step=step[sl], value=smooth))
            self._ema = float(smooth[-1]) if len(smooth) and np.isfinite(smooth[-1]) else self._ema
        self._streamed = n

    def _update_timeline(self) -> None:
        plan = self.store.plan or {}
        P = plan.get("P") if isinstance(plan.get("P"), int) else 0
        tl = [t for t in plan.get("timeline") or [] if isinstance(t, dict)]
        labels = [f"stage {s}" for s in range(P)]
        self.gantt.y_range.factors = list(reversed(labels))
        parts = {k: dict(y=[], left=[], right=[], mb=[], action=[]) for k in ACTION_COLORS}
        for t in tl[:50_000]:
            s, a = t.get("stage"), str(t.get("action"))
            if not isinstance(s, int) or not 0 <= s < P or not (_finite(t.get("start_s")) and _finite(t.get("end_s"))):
                continue
            d = parts[a if a in ("F", "R", "B") else "other"]
            d["y"].append(labels[s])
            d["left"].append(float(t["start_s"]))
            d["right"].append(float(t["end_s"]))
            d["mb"].append(t.get("micro_batch") if isinstance(t.get("micro_batch"), int) else -1)
            d["action"].append(a)
        for k, src in self.gantt_src.items():
            src.data = parts[k]
        self.gantt.title.text = ("simulated mini-batch of the running plan "
                                 f"({_num(plan.get('predicted_step_s'), '{:.3f} s')}, "
                                 f"bubble {_num(plan.get('bubble'), '{:.0%}')})" if tl else
                                 "no simulated timeline in the plan")

    def _update_stage_compute(self) -> None:
        st = self.store
        plan = st.plan or {}
        P = plan.get("P") if isinstance(plan.get("P"), int) else 0
        sim: dict[int, dict[str, float]] = {}
        for t in plan.get("timeline") or []:
            if isinstance(t, dict) and isinstance(t.get("stage"), int) and _finite(t.get("start_s")) \
                    and _finite(t.get("end_s")):
                k = t.get("action") if t.get("action") in ("F", "R", "B") else None
                if k:
                    d = sim.setdefault(t["stage"], {"F": 0.0, "R": 0.0, "B": 0.0})
                    d[k] += float(t["end_s"]) - float(t["start_s"])
        pred = plan.get("predicted_step_s")
        meas = st.stage_compute()
        ys, cols = [], {k: [] for k in STEP_PARTS}
        for s in range(P):
            for label, src, step in (("simulated", sim.get(s), pred), ("measured", meas.get(s), None)):
                if not src:
                    continue
                vals = {k: (src.get(k) if _finite(src.get(k)) else 0.0) for k in ("F", "R", "B", "wait")}
                total = step if _finite(step) else src.get("step")
                busy = sum(vals.values())
                ys.append(f"stage {s} · {label}")
                for k in ("F", "R", "B", "wait"):
                    cols[k].append(vals[k])
                cols["other"].append(max(0.0, total - busy) if _finite(total) else 0.0)
        self.stage_fig.y_range.factors = list(reversed(ys))
        self.stage_src.data = dict(y=ys, **cols)

    def _update_tables(self) -> None:
        st = self.store
        rows = []
        for e in reversed(st.morphs):
            p = e.payload if isinstance(e.payload, dict) else {}
            rs = p.get("resume_step")
            rows.append({"time UTC": _clock(e.time), "what happened": _safe_sentence(morph_sentence, p),
                         "cause": CAUSE_LABELS.get(str(p.get("cause")), str(p.get("cause", "?"))),
                         "VM": str(p.get("host") or "–"),
                         "old → new plan": f"{_plan_label(p.get('old'))} → {_plan_label(p.get('new'))}",
                         "downtime s": _round(p.get("downtime_s"), 1), "steps lost": p.get("steps_lost"),
                         "resumed at step": rs})
        self.morph_table.height = min(460, 40 + 110 * max(1, len(rows)))   # a wrapped sentence: ~5 lines
        self.morph_table.value = pd.DataFrame(rows or [{"time UTC": "", "what happened": "no morph yet", "cause": "",
                                                        "VM": "", "old → new plan": "", "downtime s": None,
                                                        "steps lost": None, "resumed at step": None}])
        ev = []
        for e in reversed(st.recent):
            p = {k: v for k, v in e.payload.items() if k not in ("rows", "timeline", "hosts", "boundaries",
                                                                  "fwd_s", "bwd_s", "mem_per_stage_bytes")}
            detail = ", ".join(f"{k}={_short(v)}" for k, v in p.items())
            ev.append({"time UTC": _clock(e.time), "what happened": _safe_sentence(event_sentence, e)[:600],
                       "kind": e.kind, "host": e.host or "", "rank": "" if e.rank is None else str(e.rank),
                       "payload": detail[:160]})
        self.event_table.value = pd.DataFrame(ev or [{"time UTC": "", "what happened": "no events yet", "kind": "",
                                                      "host": "", "rank": "", "payload": ""}])


def _safe_sentence(fn, arg) -> str:
    """``fn(arg)`` (a sentence of ``manager.runs``), or "" when a malformed payload breaks it."""
    try:
        return str(fn(arg))
    except Exception:  # noqa: BLE001 - the log is input: a view never fails on it
        return ""


def _short(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_short(x)}" for k, x in list(v.items())[:4]) + "}"
    return str(v)[:60]


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _round(v: Any, nd: int) -> float | None:
    return round(float(v), nd) if _finite(v) else None


def _served() -> bool:
    doc = pn.state.curdoc
    return bool(doc is not None and doc.session_context)


def ema(values: np.ndarray, span: int, start: float | None = None) -> np.ndarray:
    """Exponential moving average of ``values`` (``alpha = 2 / (span + 1)``), continuing from
    ``start`` (the average before the first value; None: begin at the first finite value). NaNs
    (skipped steps) carry the average on."""
    v = np.asarray(values, dtype=float)
    v = np.where(np.isfinite(v), v, np.nan)
    head = [] if start is None else [start]
    out = pd.Series(np.concatenate([head, v])).ewm(span=span, adjust=False, ignore_na=True).mean().to_numpy()
    return out[len(head):]


def _job_config(db: Path) -> dict:
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


def _duration(s: float | None) -> str:
    if s is None or not math.isfinite(s):
        return "–"
    return f"{s:.0f} s" if s < 90 else f"{s / 60:.0f} min" if s < 5400 else f"{s / 3600:.1f} h"


def _progress(done: int, total: int | None) -> str:
    """"159 / 300 (53 %)", or "159" when the total is not known."""
    if not total:
        return f"{done:,}" if done else "–"
    return f"{done:,} / {total:,} ({100 * done / total:.0f} %)"


def build_app(source: str | Path, *, job_id: str | None = None, refresh_s: float = 1.0,
              max_points: int = 2000, start: bool = True) -> pn.viewable.Viewable:
    """The dashboard of the job at ``source`` (a run folder holding ``events.db``, or that file)
    as a Panel object: display it in a notebook, or return it from a ``pn.serve`` app function.

    ``job_id``: only this job's rows (default every row of the log). ``refresh_s``: seconds
    between reads of the log. ``max_points``: points per line series drawn from history (100k
    steps are drawn as ``max_points`` min/max samples). ``start``: start the periodic refresh now.
    The ``Dashboard`` behind it is the returned object's ``dashboard`` attribute.

    Raises ``FileNotFoundError`` if there is no event log at ``source`` (the job has not started).
    """
    pn.extension("tabulator")
    store = TelemetryStore.shared(source, job_id)
    dash = Dashboard(store, refresh_s=refresh_s, max_points=max_points)
    if start:
        dash.start()
    layout = dash.layout
    layout.dashboard = dash  # type: ignore[attr-defined]
    return layout
