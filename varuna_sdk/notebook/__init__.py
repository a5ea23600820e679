"""Jupyter face of the SDK: a ``Job`` handle that calibrates, plans, launches a job in the
background, shows its progress, and opens the dashboard — all from notebook cells.

    job = Job(config)                          # a JobConfig, or the path of its YAML
    job.calibrate()                            # once per model shape; cached on disk
    job.plan(gpus=4)                           # ranked table + partition map, inline
    job.what_if(gpus=16, network_bandwidth_Bps=1.25e9)   # a hypothetical cluster; job unchanged
    job.launch()                               # returns at once; progress bar below the cell
    job.status                                 # state, step, loss, tokens/s, plan (a JobStatus)
    job.metrics, job.events, job.morphs        # pandas DataFrames from the job's event log
    job.plot()                                 # loss and throughput by step, morphs marked (Bokeh)
    job.dashboard()                            # the team dashboard (Panel), inline
    job.stop()                                 # checkpoint at the next mini-batch boundary, stop
    job.launch()                               # ... and continue from that checkpoint later

Re-running a cell never starts a second job by accident: ``launch()`` on a job that is already
running says so and returns it, and a new ``Job`` with the name of a running one refuses to
launch (``RuntimeError``) until that one is stopped — or made with ``replace=True``. A handle
lost by re-running ``job = Job(...)`` is found again with ``Job.get(name)``.

Your own model, loss and data, from a cell:

    job = Job(model=MyGPT, data="my_text.txt", steps=200)     # a class or function defined here
    job = Job(model=lambda: GPT2LMHeadModel(GPT2Config(n_layer=4)), data="tokens.bin",
              config=JobConfig(data=DataConfig(token_dtype="uint16")))
    job = Job(model="mypkg.models:build", data=make_dataset, loss=my_loss)

A callable defined in the notebook (model factory or class, loss, init, dataset factory) is
shipped by value with cloudpickle inside the job spec — to local workers through the run folder,
to your VMs over the SSH bootstrap — and every worker checks the Python/torch/cloudpickle
versions before unpickling (``varuna_sdk.shipping``); an import path is shipped by reference
(your code folder is synced to the VMs). The model, data and loss are resolved and checked
together when the ``Job`` is made — a model that cannot be cut, token ids beyond its vocabulary,
a missing column fail in that cell, before anything starts.

At interpreter exit (kernel shutdown or restart) every job this kernel launched is asked to
stop and the providers it ran on are closed, so no worker or test host outlives the kernel.

The package's modules: ``job`` (the ``Job`` handle: launching, reading the event log, progress),
``views`` (what a cell displays: ``JobStatus``, ``PlanView``, the loss/throughput figure),
``arguments`` (``Job(model=, loss=, data=, init=)`` turned into a config and the objects shipped
by value). Sits at the top (with ``cli``): imports the manager, planner, cluster providers and
(for ``Job.dashboard()`` only) the top-level ``dashboard`` package; nothing in ``varuna_sdk``
imports it (the root package's lazy ``varuna_sdk.Job`` aside).
"""

from ..config import ConfigError
from .job import Job
from .views import JobStatus, PlanView

__all__ = ["Job", "JobStatus", "PlanView", "ConfigError"]
