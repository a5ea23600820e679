"""The job manager's side of a run: the event log (``events``), heartbeats from workers
(``heartbeat``), and — later — pre-emption/straggler detection and morph decisions.

Owns nothing itself. Sits above ``cluster``, ``planner`` and ``checkpoint``; must never be
imported by them (DESIGN.md: ``notebook/cli → manager → cluster, planner, checkpoint``).
"""
