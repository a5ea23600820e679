"""The job manager's side of a run (paper §4.6). Where things are:

- ``events``: the job's event log (SQLite, what the dashboard reads) and ``Kind``, every event kind;
- ``wire``, ``heartbeat_server``, ``heartbeat_client``, ``loss_detection``: heartbeats from workers;
- ``generation`` (+ ``startup``, ``results``, ``orphans``): one launch of a job's workers, how it
  ended, and waiting for a dead manager's workers;
- ``options``: ``ManagerOptions`` and ``GenerationOptions``, every setting and its default;
- ``decisions``: the morph rules as pure functions — **add a morph rule there** (its docstring
  is the contract);
- ``manager`` (+ ``state``, ``supervision``, ``planning``, ``telemetry``): the state machine that
  morphs a job as VMs come and go;
- ``runs``, ``billing``: run folders and their cost, in sentences, for ``varuna status``/``logs``.

Owns nothing itself and imports nothing here: workers import ``manager.heartbeat_client`` before
torch, so this package must stay light. Sits above ``cluster``, ``planner`` and ``checkpoint``;
must never be imported by them (DESIGN.md: ``notebook/cli → manager → cluster, planner, checkpoint``).
"""
