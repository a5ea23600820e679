"""The pipeline runtime: one rank's stage of a P × D job, and what it needs to run it.

Owns, one module per concern (import each from its module; this package re-exports nothing, so
that ``pipeline.schedule`` stays importable without torch):

* ``engine`` — ``Varuna`` (``Varuna(...).step(batch, optimizer)``), ``StepResult``,
  ``split_batch``: building a stage, running its schedule one method per action kind, the
  end-of-step gradient sync, consensus and optimizer step.
* ``stage_prefix`` — ``StagePrefix``, ``StageRun``, ``StageExit``: running the segments before a
  stage on the meta device (and why that is done).
* ``schedule`` — ``Action``, ``stage_schedule``, ``pipeline_schedule``, ``format_schedule``,
  ``parse_schedule``, ``default_recompute``, ``StageScheduler``: schedules as data (the C++
  policies' Python face).
* ``split_backward`` — ``backward_input``, ``WeightWork``: the B / W split of the backward.
* ``comm`` — ``Channel``, ``Receiver``, ``PeerLost``, ``set_delivery_gate``: p2p between stages.
* ``groups`` — ``Topology``, ``Groups``, ``build_groups``: rank layout and process groups.
* ``grad_sync`` — ``GradSync``, ``DEFAULT_BUCKET_BYTES``: bucketed, overlapped all-reduce.
* ``scaler`` — ``LossScaler``: fp16 loss scaling agreed by every stage.
* ``spawn`` — ``spawn_workers``, ``free_port``, ``WorkerFailure``, ``retained_memory``: local
  worker processes.

Sits on ``config``, ``model`` and ``_native``; must never import ``checkpoint``, ``profiling``,
``planner``, ``trainer``, ``cluster``, ``manager`` or anything above them.
"""
