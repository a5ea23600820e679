"""The dashboard's look: its CSS, the colours of pipeline actions, VM states and job states,
and the card, row and figure every view is drawn in.

Owns the constants and ``section``, ``wrap``, ``themed_figure``. The pipeline actions' colours
come from ``varuna_sdk.palette`` (the notebook draws with the same). Imports panel and bokeh;
must never import the store, the event log or anything of ``varuna_sdk`` that drives a job.
"""

from __future__ import annotations

import panel as pn
from bokeh.plotting import figure

from varuna_sdk.palette import ACTION_COLORS

from .format import esc

#: Colours (colour-blind safe Tableau 10) of the VM states and job states; the pipeline actions'
#: (``ACTION_COLORS``) are ``varuna_sdk.palette``'s, shared with the notebook.
# per-stage compute per step: measured waiting (blocked on a neighbour stage) is its own segment
STEP_PARTS = ("F", "R", "B", "wait", "other")
PART_COLORS = {**ACTION_COLORS, "wait": "#E8E0C8"}
PART_NAMES = {"F": "forward", "R": "recompute", "B": "backward", "wait": "waiting for a neighbour stage (measured)",
              "other": "rest: comm, all-reduce, optimizer, idle"}
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



def section(title: str, *objs, half: bool = False, **kw) -> pn.Column:
    """A titled white card; ``half``: one of two side by side on a wide screen (``wrap``)."""
    styles = {**SECTION_STYLE, **(FLEX_HALF if half else {})}
    return pn.Column(pn.pane.HTML(f"<h3>{esc(title)}</h3>", stylesheets=[CSS], margin=(0, 0)), *objs,
                     styles=styles, sizing_mode="stretch_width", margin=(6, 6), **kw)


def wrap(*objs) -> pn.FlexBox:
    """Side by side while each gets at least its flex basis (``FLEX_HALF``: 460 px), else one under
    the other: two columns on a laptop, one below ~1000 px."""
    return pn.FlexBox(*objs, flex_wrap="wrap", sizing_mode="stretch_width", margin=0)


def themed_figure(**kw) -> figure:
    """A Bokeh ``figure`` in the dashboard's look: white background, light grid, grey axes, no Bokeh logo,
    pan/zoom/reset/save tools on the right, stretched to the page width. ``kw`` go to ``figure`` and override the
    toolbar location, tools and sizing mode."""
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
