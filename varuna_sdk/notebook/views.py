"""What a notebook cell shows of a job: ``JobStatus`` (a snapshot, as text and HTML),
``PlanView`` (the ranked plan table, the partition map and the simulated Gantt chart), the
loss/throughput figure of ``Job.plot`` and the colour of a finished progress bar.

Draws with pandas and Bokeh (imported where used) in the shared look of ``varuna_sdk.palette``
(the dashboard's colours, without importing the dashboard). Reads plans and metrics it is
given; must never import the manager, the cluster or the dashboard.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import JobConfig
from ..palette import ACTION_COLORS, TIMELINE_COLORS, plan_label


@dataclass
class JobStatus:
    """A snapshot of a job.

    ``state``: ``NOT LAUNCHED``, then the manager's ``JobState`` (PENDING, PROVISIONING, RUNNING,
    MORPHING, RECOVERING; terminal SUCCEEDED, FAILED, STOPPED). ``step``: optimizer steps
    finished (the last metrics row's step + 1; it can step back after a sudden loss, when the
    job resumes from an earlier checkpoint); ``steps``: the total. ``loss``: last training loss;
    ``tokens_per_s``, ``examples_per_s``: last step's throughput. ``P``/``D``: the plan of the
    last step trained (or of the configuration before the first step). ``generation``: worker
    launches so far - 1; ``morphs``: morphs recorded (both counted over every ``launch()``).
    ``error``: why the job failed. ``run_dir``: its folder."""

    name: str
    state: str
    step: int
    steps: int
    loss: float | None
    tokens_per_s: float | None
    examples_per_s: float | None
    P: int | None
    D: int | None
    generation: int
    morphs: int
    error: str | None
    run_dir: str | None

    @property
    def done(self) -> bool:
        """True in a terminal state (SUCCEEDED, FAILED, STOPPED)."""
        return self.state in ("SUCCEEDED", "FAILED", "STOPPED")

    def __str__(self) -> str:
        plan = f"P={self.P} x D={self.D}" if self.P else "not planned yet"
        loss = f"{self.loss:.4f}" if self.loss is not None else "-"
        tps = f"{self.tokens_per_s:,.0f} tok/s" if self.tokens_per_s else "-"
        s = (f"{self.name}: {self.state} | step {self.step}/{self.steps} | loss {loss} | {tps} | {plan} | "
             f"generation {self.generation}, {self.morphs} morph(s)")
        return s + (f"\n  error: {self.error}" if self.error else "")

    def _repr_html_(self) -> str:
        import html

        return f"<pre>{html.escape(str(self))}</pre>"



def colour_finished_bar(bar, state: str | None) -> None:
    """A notebook bar closed short of its total turns red (tqdm reads it as an error): a job
    stopped on request (checkpointed, continuable) is shown amber, a finished one green; only a
    FAILED job stays red. Text bars have no colour: nothing to do."""
    style = {"STOPPED": "warning", "SUCCEEDED": "success"}.get(state or "")
    if style is None or not hasattr(bar, "container"):
        return
    try:   # (tqdm's own disp() never turns a red bar green: set the widget's style)
        bar.container.children[1].bar_style = style
    except Exception:  # noqa: BLE001 - cosmetic
        pass



class PlanView:
    """A ``planner.rows.Plan`` with the job it was made for: renders the ranked table and the
    partition map (which cut-point segments each stage holds, memory per stage, the rank of
    every stage × replica cell) as HTML in Jupyter and as text elsewhere. ``.plan`` is the
    ``Plan``, ``.best`` its best row."""

    def __init__(self, plan, job: JobConfig):
        self.plan = plan
        self.job = job

    @property
    def best(self):
        """The fastest feasible ``PlanRow`` (``ValueError`` with every reason when none fits)."""
        return self.plan.best

    def to_frame(self, feasible_only: bool = False):
        """The ranked configurations as a pandas DataFrame, fastest first: P, D, micro-batch size,
        m, idle GPUs, seconds per step, examples/s, bubble fraction, max memory per GPU (MiB),
        $ per 1,000 examples (spot, on demand), time and $ to ``target_examples`` when given,
        feasible and the reason when not."""
        import pandas as pd

        rows = []
        for r in self.plan.rows:
            if feasible_only and not r.feasible:
                continue
            rows.append({"P": r.P, "D": r.D, "micro_batch": r.micro_batch_size, "m": r.m, "idle_gpus": r.idle_gpus,
                         "step_s": r.time_s, "examples_per_s": r.examples_per_s, "bubble": r.bubble_fraction,
                         "max_mem_MiB": max(r.stage_memory_bytes) / 2**20 if r.stage_memory_bytes else math.nan,
                         "usd_per_1k_spot": r.cost_per_1k_spot, "usd_per_1k_on_demand": r.cost_per_1k_on_demand,
                         "time_to_target_s": r.time_to_target_s, "usd_to_target_spot": r.cost_to_target_spot,
                         "feasible": r.feasible, "reason": r.reason})
        df = pd.DataFrame(rows)
        if not self.plan.target_examples and not df.empty:
            df = df.drop(columns=["time_to_target_s", "usd_to_target_spot"])
        return df

    def timeline(self, row=None):
        """The simulated mini-batch of ``row`` (default the best) as a pandas DataFrame, one row
        per action: rank (= replica·P + stage), stage, replica, kind (F, R, B, WAIT, AR, TIED,
        SYNC, OPT), micro_batch, start_s, end_s (seconds from the mini-batch start) — the
        simulator's own event-by-event run (``Plan.simulate(row).timeline``)."""
        import pandas as pd

        row = row or self.plan.best
        sim = self.plan.simulate(row, record_timeline=True)
        out = []
        for rank, segs in enumerate(sim.timeline or []):
            for s in segs:
                out.append({"rank": rank, "stage": rank % row.P, "replica": rank // row.P, "kind": s.kind,
                            "micro_batch": s.mb, "start_s": s.start, "end_s": s.end})
        return pd.DataFrame(out, columns=["rank", "stage", "replica", "kind", "micro_batch", "start_s", "end_s"])

    def gantt(self, row=None, replica: int = 0, height: int | None = None):
        """A Bokeh Gantt chart of the simulated mini-batch of ``row`` (default the best) for one
        ``replica``: one lane per stage, forward / recompute / backward bars numbered by
        micro-batch, then the all-reduce, consensus and optimizer step (same colours as the
        dashboard). Show it with ``bokeh.io.show``."""
        from bokeh.models import ColumnDataSource, FactorRange, HoverTool
        from bokeh.plotting import figure

        row = row or self.plan.best
        tl = self.timeline(row)
        tl = tl[tl["replica"] == replica]
        lanes = [f"stage {s}" for s in range(row.P)]
        f = figure(height=height or 110 + 45 * row.P, sizing_mode="stretch_width",
                   y_range=FactorRange(*reversed(lanes)), x_axis_label="seconds into the mini-batch",
                   title=f"simulated mini-batch: P={row.P} x D={row.D}, micro-batch {row.micro_batch_size}, "
                         f"m={row.m}, {row.time_s:.3f} s, bubble {row.bubble_fraction:.0%}",
                   tools="pan,wheel_zoom,box_zoom,reset,save")
        names = {"F": "forward", "R": "recompute", "B": "backward", "W": "weight gradients (split backward)",
                 "AR": "all-reduce", "WAIT": "waiting for a core",
                 "TIED": "tied-weight all-reduce", "SYNC": "consensus", "OPT": "optimizer step"}
        for kind, g in tl.groupby("kind", sort=False):
            src = ColumnDataSource(dict(y=[lanes[s] for s in g["stage"]], left=g["start_s"], right=g["end_s"],
                                        mb=[str(m) if m >= 0 and kind in ("F", "R", "B", "W") else "" for m in g["micro_batch"]],
                                        mid=(g["start_s"] + g["end_s"]) / 2, kind=[names.get(kind, kind)] * len(g)))
            color = ACTION_COLORS.get(kind) if kind in ("F", "R", "B") else TIMELINE_COLORS.get(kind, ACTION_COLORS["other"])
            f.hbar(y="y", left="left", right="right", height=0.7, source=src, color=color, line_color="white",
                   legend_label=names.get(kind, kind))
            if kind in ("F", "R", "B", "W"):
                f.text(x="mid", y="y", text="mb", source=src, text_align="center", text_baseline="middle",
                       text_font_size="9px", text_color="white")
        f.add_tools(HoverTool(tooltips=[("", "@kind @mb"), ("stage", "@y"), ("start", "@left{0.0000} s"),
                                        ("end", "@right{0.0000} s")]))
        f.legend.orientation = "horizontal"
        f.legend.label_text_font_size = "10px"
        f.add_layout(f.legend[0], "below")
        f.x_range.start = 0
        return f

    def partition_map(self) -> str:
        """The best row's stages as text: segments, memory per GPU, one cell per replica."""
        r = self.plan.best
        lines = [f"best: P={r.P} stages x D={r.D} replicas, micro-batch {r.micro_batch_size}, m={r.m}, "
                 f"{r.time_s:.3f} s/step predicted, bubble {r.bubble_fraction:.1%}"]
        for s, segs in enumerate(r.stages):
            mem = r.stage_memory_bytes[s] if s < len(r.stage_memory_bytes) else 0.0
            lines.append(f"  stage {s}: segments {segs[0]}..{segs[-1]} ({len(segs)}) | {mem / 2**20:8.1f} MiB | "
                         + " ".join(f"[r{d}]" for d in range(r.D)))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.plan.table() + "\n\n" + self.partition_map()

    def _repr_html_(self) -> str:

        r = self.plan.best
        cells = "".join(
            "<tr><th style='text-align:left'>stage {s}<br><small>segments {a}..{b}<br>{mem:.1f} MiB</small></th>{row}</tr>".format(
                s=s, a=segs[0], b=segs[-1], mem=(r.stage_memory_bytes[s] if s < len(r.stage_memory_bytes) else 0) / 2**20,
                row="".join(f"<td style='border:1px solid #888;padding:4px 10px;background:hsl({(s * 67) % 360},60%,85%)'>"
                            f"replica {d}<br><small>rank {d * r.P + s}</small></td>" for d in range(r.D)))
            for s, segs in enumerate(r.stages))
        return (f"{self.plan._repr_html_()}<b>Partition map</b> (P={r.P} x D={r.D}, "
                f"{r.time_s:.3f} s/step predicted)<table style='border-collapse:collapse'>{cells}</table>")

    def __repr__(self) -> str:
        return str(self)


def metrics_figure(df, resume_steps, height: int = 260):
    """``Job.plot``: training loss (per step, and smoothed: an EMA over 20 steps) and tokens/s (or
    examples/s, for examples that hold no tokens) by step as two Bokeh figures in a column, one
    colour per generation (and launch, when ``df`` holds several job ids), each morph's ``resume_steps`` marked by a dotted line. ``df``: the
    non-empty ``Job.metrics`` frame (step, loss, tokens_per_s, P, D, generation, job_id);
    ``height``: of each figure, pixels."""
    from bokeh.layouts import column
    from bokeh.models import Span
    from bokeh.palettes import Category10_10
    from bokeh.plotting import figure

    key = df["job_id"].astype(str) + "/" + df["generation"].astype(str) if "job_id" in df else df["generation"]
    launches = {j: k for k, j in enumerate(dict.fromkeys(df["job_id"].astype(str)))} if "job_id" in df else {}
    figs = []
    tokens = "tokens_per_s" in df and df["tokens_per_s"].notna().any()   # examples without token ids: examples/s
    rate = ("tokens_per_s", "throughput", "tokens / s") if tokens else ("examples_per_s", "throughput", "examples / s")
    for col, label, unit in (("loss", "training loss", "loss"), rate):
        f = figure(height=height, sizing_mode="stretch_width", title=label, x_axis_label="step",
                   y_axis_label=unit, tools="pan,box_zoom,wheel_zoom,reset,hover,save")
        for i, (_, g) in enumerate(df.groupby(key, sort=False)):
            gen = int(g["generation"].iloc[0])
            plan = plan_label({"P": int(g["P"].iloc[0]), "D": int(g["D"].iloc[0])})
            where = f"generation {gen}" if len(launches) < 2 else \
                f"launch {launches[str(g['job_id'].iloc[0])] + 1}, generation {gen}"
            color = Category10_10[i % 10]
            f.line(g["step"], g[col], color=color, line_width=2 if col != "loss" else 1,
                   alpha=1.0 if col != "loss" else 0.45, legend_label=f"{where}: {plan}" if len(set(key)) > 1 else plan)
            if col == "loss":   # the trend under the step-to-step noise
                f.line(g["step"], g[col].ewm(span=20, adjust=False, ignore_na=True).mean(), color=color,
                       line_width=2.5, legend_label="smoothed (EMA, 20 steps)")
        for step in resume_steps:
            f.add_layout(Span(location=float(step) - 0.5, dimension="height", line_dash="dotted",
                              line_color="#E08E00", line_width=2))
        f.legend.label_text_font_size = "10px"
        f.legend.click_policy = "hide"
        f.add_layout(f.legend[0], "right")
        figs.append(f)
    figs[1].x_range = figs[0].x_range
    return column(*figs, sizing_mode="stretch_width")
