"""The unpartitioned model trained by plain PyTorch on a job's own micro-batches: what the
pipeline's losses must equal, computed another way.

Owns: the micro-batches a job trains on at a step (``micro_batches``), and one plain PyTorch
training loop over them (``plain_losses``) with what the workers use — the initial weights every
stage starts from (the model's own constructor seeded by name), the job's optimizer
(``optimizer.make_optimizer``: AdamW with betas (0.9, 0.95) by default) with decay on matrices
only, the job's warm-up + cosine learning rate, each micro-batch's
``loss / n`` summed into the gradients, global-norm clipping (``grad_clip``) and a step skipped
when its gradients are not finite. A user checks the pipeline against it
(``Job.plain_pytorch_losses``); nothing else uses it.

Sits above ``trainer`` (``lr_at``), ``optimizer``, ``jobspec`` and ``model``; never imports ``pipeline``,
``manager`` or ``cluster``.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import Any

import torch
from torch import nn

from .config import JobConfig
from .jobspec import ResolvedJob
from .model.inputs import call_model, rows
from .model.rng import loss_rng, segment_rng
from .model.spec import positive_settings

__all__ = ["micro_batches", "plain_losses", "initial_model"]


def _check_step(job: JobConfig, step: object) -> int:
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"step must be an int (0 .. {job.train.steps - 1}), got {type(step).__name__} {step!r}")
    if not 0 <= step < job.train.steps:
        raise ValueError(f"step {step} is outside the job's steps 0 .. {job.train.steps - 1} (train.steps = "
                         f"{job.train.steps}); pass a step in that range")
    return step


def micro_batch_size_of(job: JobConfig, micro_batch_size: object = None) -> int:
    """``micro_batch_size``, else the job's (``parallel.micro_batch_size``, set by the config or
    by planning), else the whole mini-batch. Raises ``TypeError``/``ValueError`` unless it is a
    positive int dividing the global batch."""
    B = job.parallel.global_batch
    b = micro_batch_size if micro_batch_size is not None else (job.parallel.micro_batch_size or B)
    if isinstance(b, bool) or not isinstance(b, int):
        raise TypeError(f"micro_batch_size must be an int, got {type(b).__name__} {b!r}")
    if b < 1 or B % b:
        divisors = [d for d in range(1, B + 1) if B % d == 0]
        raise ValueError(f"micro_batch_size {b} does not divide the global batch {B} into equal micro-batches; "
                         f"pass one of {divisors}")
    return b


def micro_batches(job: JobConfig, resolved: ResolvedJob, step: int, micro_batch_size: int | None = None
                  ) -> list[tuple[Any, Any]]:
    """The micro-batches of mini-batch ``step``, in order, as ``(inputs, targets)`` the model
    and the loss take them (``inputs`` a tuple for ``model(*inputs)`` or a dict for
    ``model(**inputs)``; ``targets`` ``None`` when the model computes its own loss). Together
    they are the job's ``global_batch`` examples of that step (the same at every P × D: replica
    ``r`` of ``D`` trains rows ``r·B/D .. (r+1)·B/D`` of it); each holds ``micro_batch_size``
    examples (tensors batch-first: ``[micro_batch_size, ...]``, e.g. ``[b, seq_len]`` token ids).

    Raises ``TypeError``/``ValueError`` for a step outside ``0 .. train.steps - 1`` or a
    micro-batch size that does not divide the global batch; ``DataError`` as the job's data does."""
    step = _check_step(job, step)
    b = micro_batch_size_of(job, micro_batch_size)
    d = job.data
    loader, _ = resolved.data.loaders(d.seq_len, job.parallel.global_batch, d.seed, d.val_fraction, 1)
    inputs, targets = resolved.split(loader.batch(step))
    return [(rows(inputs, a, a + b), rows(targets, a, a + b) if targets is not None else None)
            for a in range(0, job.parallel.global_batch, b)]


def initial_model(job: JobConfig, resolved: ResolvedJob) -> nn.Module:
    """The whole model on CPU with the weights and buffers every stage starts from (the model's own
    constructor, seeded from ``train.seed`` and each module's name; ``Job.initial_weights``)."""
    from .model.materialize import build_on_meta, materialize

    spec = resolved.spec
    model = build_on_meta(spec.factory)
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    materialize(model, names, seed=job.train.seed, device="cpu", init_fn=spec.init_fn)
    return model


def _autocast(precision: str):
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    raise ValueError(f"the plain PyTorch reference runs fp32 or bf16, not {precision}: fp16's loss scaler skips "
                     "steps the reference would not; compare with train.precision: fp32 (or bf16)")


#: attributes (of a module or its ``config``) through which models ask for functional dropout
#: (``F.dropout(x, self.hidden_dropout)``, as Hugging Face's Bloom does) or drop paths
_RANDOM_ATTRS = ("dropout", "hidden_dropout", "attention_dropout", "attn_dropout", "resid_dropout",
                 "hidden_dropout_prob", "attention_probs_dropout_prob", "drop_path_rate", "drop_path_prob")


def _warn_if_random(model: nn.Module, random_ops: list[str] = (), why: str = "") -> None:
    """Warn that ``model`` draws random numbers (dropout, drop paths, ``random_ops`` in its forward)
    the reference cannot draw as the pipeline does, for the reason ``why``."""
    drops = {type(m).__name__ for m in model.modules()
             if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0}
    drops |= {f"{'config.' if where.endswith('config') else ''}{a}={v:g}"
              for where, a, v in positive_settings(model, _RANDOM_ATTRS)}
    drops = sorted(drops) + [f"{op}() in its forward" for op in random_ops]
    if drops:
        warnings.warn(f"the model has {', '.join(drops[:6])} (dropout with p > 0, or random numbers): the pipeline "
                      "draws its own dropout masks and random numbers "
                      f"(the same at every P x D), and {why}, so losses differ by that noise; build the "
                      "model without it (dropout 0, no random numbers in training) to compare exactly", UserWarning,
                      stacklevel=3)


def plain_losses(job: JobConfig, resolved: ResolvedJob, steps: int = 3, micro_batch_size: int | None = None,
                 model: nn.Module | None = None) -> list[float]:
    """Train the unpartitioned model by plain PyTorch for the job's first ``steps`` steps on its
    micro-batches (``micro_batches``) and return each step's loss: the mean over the micro-batches
    of ``loss(model(inputs), targets)`` before that step's update, each weighted by its loss items
    (valid tokens) where the job counts them (a dataset whose loss is one mean cross-entropy:
    ``model.loss_items``) — what the pipeline reports as ``loss`` in ``metrics.jsonl`` at any
    P × D, to fp32 rounding. Any micro-batch size gives the same, and so does the whole mini-batch
    in one call.

    ``model``: your own copy to train (it is changed; default ``initial_model``, the weights every
    stage starts from). Runs on CPU in the job's precision (fp32 or bf16). Dropout masks and other
    random numbers the forward draws from torch's, NumPy's or Python's global generators are the
    pipeline's (each segment between cut-points seeded by (``train.seed``, step, micro-batch,
    segment), as the workers seed it) when the model is ``initial_model`` and the micro-batch size
    the job's, and a loss's draws at any size (``model.rng.loss_rng``); otherwise
    a model with dropout is warned about (its masks differ from the pipeline's). Raises ``ValueError`` for ``steps`` outside
    ``1 .. train.steps``, fp16, or a micro-batch size that does not divide the global batch."""
    t = job.train
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= t.steps:
        raise ValueError(f"steps must be an int in 1 .. {t.steps} (train.steps), got {steps!r}")
    from .optimizer import make_optimizer
    from .trainer import lr_at

    from .trainer import loss_items_of, model_structure

    amp = _autocast(t.precision)
    b = micro_batch_size_of(job, micro_batch_size)
    structure = model_structure(job, resolved)
    items = loss_items_of(job, resolved, structure)   # as the workers count
    # the pipeline's random draws, where the forward crosses the cut-points the pipeline's does (the
    # job's own model) at the pipeline's micro-batches (global micro-batch j of the step: the j-th)
    same_draws = model is None and job.parallel.micro_batch_size == b
    if model is None:
        model = initial_model(job, resolved)
        if not same_draws:
            _warn_if_random(model, structure.random_ops, f"at micro-batch size {b}, not the job's "
                            f"{job.parallel.micro_batch_size or '(planned at launch)'}, plain PyTorch draws others")
    else:
        _warn_if_random(model, why="in a model of your own plain PyTorch draws others (the job's own, the "
                                   "default, draws the pipeline's)")
    model.train()
    params = [q for q in model.parameters() if q.requires_grad]
    opt = make_optimizer(params, job)   # the workers' own (train.optimizer)
    loss_fn = resolved.spec.loss_fn
    out: list[float] = []
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, job)
        mbs = micro_batches(job, resolved, step, b)
        # each micro-batch's share of the mini-batch loss: 1/m, or its items over the mini-batch's
        counts = [items.count(i, tg)[0] for i, tg in mbs] if items is not None else [1] * len(mbs)
        n = sum(counts)
        total = 0.0
        for j, ((inputs, targets), k) in enumerate(zip(mbs, counts)):
            with amp:
                with segment_rng(t.seed, step, j) if same_draws else contextlib.nullcontext():
                    output = call_model(model, inputs)
                with loss_rng(t.seed, step, j):   # (the loss's own draws: the pipeline's at any micro-batch size)
                    loss = loss_fn(output, targets)
            # every label ignored: share 0 (a mean cross-entropy over no item backpropagates zeros)
            (loss.float() / n if items is None else loss.float() * (k / n if n else 0.0)).backward()
            if k:
                total += float(loss.detach()) * k / n
        if items is not None and not n:
            total = float("nan")   # no item in the mini-batch: plain PyTorch's mean is NaN too
        grads = [q.grad for q in params if q.grad is not None]
        norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))) \
            if grads else 0.0
        if math.isfinite(norm):
            if t.grad_clip is not None and t.grad_clip / (norm + 1e-6) < 1.0:
                for g in grads:
                    g.mul_(t.grad_clip / (norm + 1e-6))
            opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(total)
    return out
