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

The package's other modules: ``views`` (the header, VM pool and drift warning as HTML of the
store), ``theme`` (CSS, colours, cards and figures), ``format`` (values in words, the EMA),
``store`` (the event log read incrementally), ``server`` (login, serving), ``jobs`` (the jobs table).

Read-only by construction: no widget here changes anything outside the browser, and the store
opens the event log read-only. Imports panel, bokeh, pandas, ``dashboard.store`` and
``varuna_sdk.manager.runs`` (sentences for morphs and events; read-only) and ``varuna_sdk.palette``
(the colours and plan words shared with the notebook); must never import torch or any part of
``varuna_sdk`` that drives a job.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
import pandas as pd
import panel as pn
from bokeh.models import ColumnDataSource, FactorRange, HoverTool, LabelSet, NumeralTickFormatter

from varuna_sdk.manager.runs import event_sentence, log_label, log_tail, morph_sentence, worker_logs
from varuna_sdk.palette import ACTION_COLORS, plan_label

from .format import (clock, ema, esc, finite, fmt_bytes, job_config, num, rounded, safe_sentence, segments_text,
                     short)
from .store import TelemetryStore, minmax_indices
from .theme import (CAUSE_LABELS, CSS, FLEX_HALF, PART_COLORS, PART_NAMES, STAGE_COLORS, STATUS_COLORS, STEP_PARTS,
                    section, themed_figure, wrap)
from .views import drift_banner, header_html, pool_html

log = logging.getLogger(__name__)


LOG_TAIL_BYTES = 32 * 1024   # of a worker log shown on the page
LOSS_SPAN = 20   # steps of the smoothed loss line (EMA span)


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
        config = job_config(store.path)
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
        """Make every figure, source and widget once (empty), then the page's layout."""
        self._build_partition_map()
        self._build_lines()
        self._build_estimates()
        self._build_timeline()
        self._build_tables()
        self._build_layout()

    def _build_partition_map(self) -> None:
        """The header and pool panes; the partition map (stages x replicas) and memory per stage."""
        self.header = pn.pane.HTML("", stylesheets=[CSS], sizing_mode="stretch_width", margin=(4, 8))
        self.pool = pn.pane.HTML("", stylesheets=[CSS], sizing_mode="stretch_width", min_height=120)

        # partition map: stages (rows) x replicas (columns), memory per stage beside it
        self.cells = ColumnDataSource(dict(x=[], y=[], color=[], line=[], label=[], host=[], rank=[],
                                           stage=[], replica=[], segs=[], mem=[], status=[]),
                                      name="partition_cells")
        self.pmap = themed_figure(height=300, x_range=FactorRange(), y_range=FactorRange(), tools="hover,save",
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
        self.mem = themed_figure(height=150, y_range=self.pmap.y_range, tools="hover", title="memory per GPU (GiB)")
        self.mem.hbar(y="y", right="gib", height=0.6, source=self.mem_src, color="#8DA0CB")
        self.mem.text(x=0, y="y", text="text", source=self.mem_src, text_baseline="middle", text_font_size="11px",
                      x_offset=4, text_color="#1d2330")
        self.mem.yaxis.major_label_text_font_size = "11px"
        self.mem.x_range.start = 0
        self.mem.select_one(HoverTool).tooltips = [("stage", "@y"), ("memory", "@text")]

    def _build_lines(self) -> None:
        """Throughput (measured vs predicted) and loss (per step, smoothed), morphs marked."""
        # throughput and loss
        self.tput = ColumnDataSource(dict(step=[], value=[]), name="throughput")
        self.loss = ColumnDataSource(dict(step=[], value=[]), name="loss")
        self.loss_smooth = ColumnDataSource(dict(step=[], value=[]), name="loss_smoothed")
        self._ema: float | None = None   # the smoothed loss at the last streamed point
        self.pred = ColumnDataSource(dict(x0=[], x1=[], y=[], gen=[]), name="predicted")
        self.morph_marks = ColumnDataSource(dict(x=[], label=[]), name="morph_marks")
        self.tput_fig = themed_figure(height=260, title="examples/s: measured (line) vs simulator (dashed)",
                             x_axis_label="step", y_axis_label="examples / s")
        self.tput_fig.line("step", "value", source=self.tput, line_width=1.6, color="#4C78A8",
                           legend_label="measured")
        self.tput_fig.segment("x0", "y", "x1", "y", source=self.pred, line_dash="dashed", line_width=2,
                              color="#E45756", legend_label="predicted")
        self.loss_fig = themed_figure(height=260, title="training loss", x_axis_label="step", y_axis_label="loss",
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

    def _build_estimates(self) -> None:
        """The predicted-vs-measured comparison and the ranked configurations table."""
        # simulator estimates
        self.compare = pn.pane.HTML("", stylesheets=[CSS], sizing_mode="stretch_width")
        self.ranked = pn.widgets.Tabulator(pd.DataFrame(), disabled=True, show_index=False, height=230,
                                           sizing_mode="stretch_width", layout="fit_data_stretch",
                                           selectable=False)

    def _build_timeline(self) -> None:
        """The simulated Gantt of the running plan and the per-stage compute per step."""
        # pipeline timeline: simulated Gantt, then per-stage compute per step, simulated vs measured
        self.gantt_src = {k: ColumnDataSource(dict(y=[], left=[], right=[], mb=[], action=[]), name=f"timeline_{k}")
                          for k in ACTION_COLORS}
        self.gantt = themed_figure(height=240, y_range=FactorRange(), x_axis_label="seconds into the mini-batch",
                          title="simulated mini-batch (plan)", tools="pan,wheel_zoom,box_zoom,reset,hover,save")
        for k, src in self.gantt_src.items():
            self.gantt.hbar(y="y", left="left", right="right", height=0.72, source=src, color=ACTION_COLORS[k],
                            line_color="white", line_width=0.5)
        self.gantt.select_one(HoverTool).tooltips = [("", "@action micro-batch @mb"), ("stage", "@y"),
                                                     ("start", "@left{0.000} s"), ("end", "@right{0.000} s")]
        self.stage_src = ColumnDataSource({"y": [], **{k: [] for k in STEP_PARTS}}, name="stage_compute")
        self.stage_fig = themed_figure(height=240, y_range=FactorRange(), x_axis_label="seconds per step",
                              title="compute per step by stage: simulated vs measured (heartbeats)",
                              tools="hover,save")
        self.stage_fig.hbar_stack(list(STEP_PARTS), y="y", height=0.7, source=self.stage_src,
                                  color=[PART_COLORS[k] for k in STEP_PARTS], line_color="white")
        self.stage_fig.select_one(HoverTool).tooltips = [("", "@y"), ("forward", "@F{0.000} s"),
                                                         ("recompute", "@R{0.000} s"), ("backward", "@B{0.000} s"),
                                                         ("waiting for a neighbour stage", "@wait{0.000} s"),
                                                         ("rest of step", "@other{0.000} s")]
        self.stage_fig.x_range.start = 0

    def _build_tables(self) -> None:
        """The morph history, recent events and worker-log views."""
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

    def _build_layout(self) -> None:
        """The page: header, then cards two by two on a wide screen (``wrap``), one under the other
        on a narrow one."""
        legend = "".join(f'<span><i style="background:{c}"></i>{esc(k)}</span>' for k, c in STATUS_COLORS.items())
        actions = ('<div class="legend">' + "".join(f'<span><i style="background:{PART_COLORS[k]}"></i>{esc(n)}</span>'
                                                    for k, n in PART_NAMES.items()) + "</div>")
        self.layout = pn.Column(
            self.header,
            wrap(section("VM pool", pn.pane.HTML(f'<div class="legend">{legend}'
                                                   '<span><i style="background:#6A3D9A"></i>straggler</span></div>',
                                                   stylesheets=[CSS], margin=(0, 0, 4, 0)), self.pool, half=True),
                  section("Partition map (stages × replicas)",
                           pn.pane.Bokeh(self.pmap, sizing_mode="stretch_width"),
                           pn.pane.Bokeh(self.mem, sizing_mode="stretch_width"), half=True)),
            wrap(section("Throughput", pn.pane.Bokeh(self.tput_fig, sizing_mode="stretch_width"), half=True),
                  section("Loss", pn.pane.Bokeh(self.loss_fig, sizing_mode="stretch_width"), half=True)),
            section("Simulator estimates", self.compare, self.ranked),
            section("Pipeline timeline", pn.pane.HTML(actions, stylesheets=[CSS], margin=(0, 0, 4, 0)),
                     wrap(pn.pane.Bokeh(self.gantt, sizing_mode="stretch_width", styles=FLEX_HALF),
                           pn.pane.Bokeh(self.stage_fig, sizing_mode="stretch_width", styles=FLEX_HALF))),
            section("Morph history", self.morph_table),
            section("Recent events", self.event_table),
            section("Worker logs", self.log_pick, self.log_view),
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
        """Stop the periodic refresh begun by ``start`` (idempotent); ``start`` can begin it again."""
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
        self.log_view.object = (f'<div class="muted">{esc(log_label(f))}, last {len(text.splitlines())} '
                                f'lines (varuna logs RUN prints all)</div><pre class="logs">{esc(text) or "(empty)"}</pre>')

    def _update_morph_marks(self) -> None:
        marks = [e.payload for e in self.store.morphs if finite(e.payload.get("from_step"))]
        self.morph_marks.data = dict(x=[float(p["from_step"]) for p in marks],
                                     label=[CAUSE_LABELS.get(str(p.get("cause")), str(p.get("cause"))) for p in marks])

    def _update_header(self) -> None:
        html_ = header_html(self.store, self.title, self.steps_total)
        if html_ != self.header.object:
            self.header.object = html_

    def _update_pool(self) -> None:
        obj = pool_html(self.store)
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
        ylab = [f"stage {s} · seg {segments_text(bounds[s]) if s < len(bounds) else '?'}" for s in range(P)]
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
                data["segs"].append(segments_text(bounds[s]) if s < len(bounds) else "?")
                data["mem"].append(fmt_bytes(mem[s]) if s < len(mem) else "–")
                data["status"].append(status)
        self.cells.data = data
        self.pmap_text.glyph.text_font_size = "10px" if small or D > 6 else "12px"
        self.pmap.title.text = (f"generation {plan.get('generation', '?')}: P={P} × D={D} = {P * D} GPUs "
                                "(cell: rank, host)")
        raw = [float(mem[s]) if s < len(mem) and isinstance(mem[s], (int, float)) else 0.0 for s in range(P)]
        unit, scale = ("GiB", 2**30) if max(raw + [0.0]) >= 2**30 else ("MiB", 2**20)   # the labels' unit
        vals = [b / scale for b in raw]
        self.mem_src.data = dict(y=ylab, gib=vals, text=[fmt_bytes(mem[s]) if s < len(mem) else "–" for s in range(P)])
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
                "step (s)": rounded(r.get("time_s"), 4), "examples/s": rounded(r.get("examples_per_s"), 2),
                "bubble": f"{r['bubble_fraction']:.1%}" if finite(r.get("bubble_fraction")) else "",
                "max mem/GPU": fmt_bytes(max(mem)) if isinstance(mem, list) and mem else "",
                cost_col: rounded(r.get("cost_per_1k_spot"), 4),
                "stages (segments)": " | ".join(segments_text(s) for s in r.get("stages") or []),
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
            err = (meas - pred) / pred if finite(pred) and pred and meas is not None else None
            meas_eps = (st.metric_median("examples_per_s", gen if isinstance(gen, int) else None)
                        if isinstance(gen, int) or p is cur else None)
            rows.append(f"<tr><td>{'▶ ' if p is cur else ''}gen {esc(gen)} · {esc(plan_label(p) or '–')}</td>"
                        f"<td>{num(pred, '{:.3f} s')}</td><td>{num(meas, '{:.3f} s')}</td>"
                        f"<td>{num(err, '{:+.1%}')}</td>"
                        f"<td>{num(p.get('examples_per_s'), '{:,.1f}')}</td>"
                        f"<td>{num(meas_eps, '{:,.1f}')}</td></tr>")
        self.compare.object = drift_banner(st, cur) + (
            '<table class="cmp"><tr><th>plan</th><th>predicted step</th><th>measured step (median, last 20)</th>'
            '<th>error</th><th>predicted ex/s</th><th>measured ex/s</th></tr>' + "".join(rows) + "</table>"
            '<div class="muted" style="margin-top:4px">Ranked configurations of the running plan '
            '(simulator; fastest first, excluded ones last):</div>')

    def _update_predicted(self) -> None:
        st = self.store
        spans = st.generation_spans()
        x0, x1, y, gen = [], [], [], []
        for e in st.plans:
            g = e.payload.get("generation")
            eps = e.payload.get("examples_per_s")
            if isinstance(g, int) and g in spans and finite(eps):
                a, b = spans[g]
                x0.append(a)
                x1.append(max(b, a + 0.5))
                y.append(float(eps))
                gen.append(g)
        if not gen and st.plan and finite(st.plan.get("examples_per_s")) and len(st.metrics):
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
            if not isinstance(s, int) or not 0 <= s < P or not (finite(t.get("start_s")) and finite(t.get("end_s"))):
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
                                 f"({num(plan.get('predicted_step_s'), '{:.3f} s')}, "
                                 f"bubble {num(plan.get('bubble'), '{:.0%}')})" if tl else
                                 "no simulated timeline in the plan")

    def _update_stage_compute(self) -> None:
        st = self.store
        plan = st.plan or {}
        P = plan.get("P") if isinstance(plan.get("P"), int) else 0
        sim: dict[int, dict[str, float]] = {}
        for t in plan.get("timeline") or []:
            if isinstance(t, dict) and isinstance(t.get("stage"), int) and finite(t.get("start_s")) \
                    and finite(t.get("end_s")):
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
                vals = {k: (src.get(k) if finite(src.get(k)) else 0.0) for k in ("F", "R", "B", "wait")}
                total = step if finite(step) else src.get("step")
                busy = sum(vals.values())
                ys.append(f"stage {s} · {label}")
                for k in ("F", "R", "B", "wait"):
                    cols[k].append(vals[k])
                cols["other"].append(max(0.0, total - busy) if finite(total) else 0.0)
        self.stage_fig.y_range.factors = list(reversed(ys))
        self.stage_src.data = dict(y=ys, **cols)

    def _update_tables(self) -> None:
        st = self.store
        rows = []
        for e in reversed(st.morphs):
            p = e.payload if isinstance(e.payload, dict) else {}
            rs = p.get("resume_step")
            rows.append({"time UTC": clock(e.time), "what happened": safe_sentence(morph_sentence, p),
                         "cause": CAUSE_LABELS.get(str(p.get("cause")), str(p.get("cause", "?"))),
                         "VM": str(p.get("host") or "–"),
                         "old → new plan": f"{plan_label(p.get('old')) or '–'} → {plan_label(p.get('new')) or '–'}",
                         "downtime s": rounded(p.get("downtime_s"), 1), "steps lost": p.get("steps_lost"),
                         "resumed at step": rs})
        self.morph_table.height = min(460, 40 + 110 * max(1, len(rows)))   # a wrapped sentence: ~5 lines
        self.morph_table.value = pd.DataFrame(rows or [{"time UTC": "", "what happened": "no morph yet", "cause": "",
                                                        "VM": "", "old → new plan": "", "downtime s": None,
                                                        "steps lost": None, "resumed at step": None}])
        ev = []
        for e in reversed(st.recent):
            p = {k: v for k, v in e.payload.items() if k not in ("rows", "timeline", "hosts", "boundaries",
                                                                  "fwd_s", "bwd_s", "mem_per_stage_bytes")}
            detail = ", ".join(f"{k}={short(v)}" for k, v in p.items())
            ev.append({"time UTC": clock(e.time), "what happened": safe_sentence(event_sentence, e)[:600],
                       "kind": e.kind, "host": e.host or "", "rank": "" if e.rank is None else str(e.rank),
                       "payload": detail[:160]})
        self.event_table.value = pd.DataFrame(ev or [{"time UTC": "", "what happened": "no events yet", "kind": "",
                                                      "host": "", "rank": "", "payload": ""}])


def _served() -> bool:
    doc = pn.state.curdoc
    return bool(doc is not None and doc.session_context)




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
