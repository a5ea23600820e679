"""The job manager's side of a run (paper §4.6): the job's event log (``events``: SQLite, what
the dashboard reads), heartbeats from workers (``heartbeat``), one launch of a job's workers
(``generation``), the morph rules as pure functions (``decisions``) and the state machine that
morphs a job as VMs come and go (``manager``).

Owns nothing itself and imports nothing here: workers import ``manager.heartbeat`` before torch,
so this package must stay light. Sits above ``cluster``, ``planner`` and ``checkpoint``; must
never be imported by them (DESIGN.md: ``notebook/cli → manager → cluster, planner, checkpoint``).
"""
