"""The team dashboard: a Panel + Bokeh app over one job's event log (issue 6, item 2).

- ``build_app(source)`` (``dashboard.app``): the Panel object for a run folder or ``events.db``;
  display it in a notebook or serve it.
- ``serve(source, ...)`` (``dashboard.server``): serve it to a team behind a login.
- ``TelemetryStore`` (``dashboard.store``): the read-only, incremental reader behind the views.

``varuna dashboard RUN_DIR`` serves it from the command line. The dashboard reads the job's
telemetry store only (``varuna_sdk.manager.events.EventLog``, read-only); it never drives
training. Depends on ``varuna_sdk`` (the event log), never the other way round; must never
import torch.
"""

from .store import TelemetryStore, resolve_event_log

__all__ = ["TelemetryStore", "resolve_event_log", "build_app", "serve", "Credentials"]


def __getattr__(name):  # panel/bokeh load only when a view is wanted (they take ~1 s to import)
    if name == "build_app":
        from .app import build_app
        return build_app
    if name in ("serve", "Credentials"):
        from . import server
        return getattr(server, name)
    raise AttributeError(f"module 'dashboard' has no attribute {name!r}")
