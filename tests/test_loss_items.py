"""Which micro-batch items a loss averages over (``model.loss_items``), read off the dry run: the
rule the pipeline weighs micro-batches by, so that a mini-batch's loss is the mean over all its
items. Each case is a real dry run (``trace_model``, weights on meta) of a small model with the
loss a user writes; the rule's counts are compared with the loss's own denominator."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from varuna_sdk.model.loss_items import LossItems
from varuna_sdk.model.materialize import build_on_meta
from varuna_sdk.model.spec import model_loss
from varuna_sdk.model.tracer import loss_after, trace_model


class _LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(32, 8), nn.Linear(8, 32)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, input_ids):
        x = self.emb(input_ids)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


class _OwnLoss(_LM):
    """A forward computing its own loss as Hugging Face's causal LMs do: labels padded with -100 at
    the end, then shifted by one position; ``aux`` adds a term in place (a router's balance loss)."""

    def __init__(self, aux: bool = False):
        super().__init__()
        self.aux = aux

    def forward(self, input_ids, labels=None):
        logits = super().forward(input_ids)
        shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
        loss = F.cross_entropy(logits.reshape(-1, 32), shifted.reshape(-1), ignore_index=-100)
        if self.aux:
            loss += 0.01 * logits.pow(2).mean()
        return {"loss": loss, "logits": logits}


def _labels(first_ignored: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 32, (2, 8), generator=g)
    labels = ids.clone()
    labels[0, 5:] = -100          # padding
    labels[:, :1] = -100          # a prompt token
    if first_ignored:
        labels[:] = -100
    return ids, labels


def _rule(model_fn, inputs, loss_fn, targets) -> LossItems | None:
    return trace_model(build_on_meta(model_fn), inputs, after=loss_after(loss_fn, targets), targets=targets).loss_items


def _ce(out, y):
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _ce_minus_one(out, y):
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), ignore_index=-1)


def _ce_plus(out, y):
    return _ce(out, y) + 0.01 * out.pow(2).mean()


_CLASS_WEIGHTS = torch.linspace(0.5, 2.0, 32)


def _weighted(out, y):
    return F.cross_entropy(out.reshape(-1, 32), y.reshape(-1), weight=_CLASS_WEIGHTS)


class _WeightsOnTheModel(_LM):
    """Class weights held by the model (a buffer: on meta in the dry run, so unreadable)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("class_weights", torch.linspace(0.5, 2.0, 32))

    def forward(self, input_ids, labels=None):
        logits = super().forward(input_ids)
        return F.cross_entropy(logits.reshape(-1, 32), labels.reshape(-1), weight=self.class_weights)


def _summed(out, y):
    return F.cross_entropy(out.reshape(-1, 32), y.reshape(-1), reduction="sum") / (y != -100).sum()


@pytest.mark.parametrize("loss_fn,ignore", [(_ce, -100), (_ce_minus_one, -1)])
def test_a_mean_cross_entropy_on_the_targets_counts_their_valid_ids(loss_fn, ignore):
    ids, labels = _labels()
    labels = torch.where(labels == -100, torch.full_like(labels, ignore), labels)
    rule = _rule(_LM, (ids,), loss_fn, labels)
    assert rule == LossItems(None, False, ignore)
    assert rule.count((ids,), labels) == (int((labels != ignore).sum()), labels.numel())


def test_a_models_own_shifted_loss_counts_its_labels_from_the_second_position():
    ids, labels = _labels()
    rule = _rule(_OwnLoss, {"input_ids": ids, "labels": labels}, model_loss, None)
    assert rule == LossItems("labels", True, -100)
    # the loss's own denominator: the valid ids among the shifted labels
    assert rule.count({"input_ids": ids, "labels": labels}, None)[0] == int((labels[:, 1:] != -100).sum())


def test_a_sample_that_predicts_nothing_reads_a_models_labels_shifted():
    """Every label of the traced sample ignored: both readings match; a model's own labels are read
    shifted (the causal LM's convention), external targets as they are."""
    ids, labels = _labels(first_ignored=True)
    assert _rule(_OwnLoss, {"input_ids": ids, "labels": labels}, model_loss, None) == LossItems("labels", True, -100)
    assert _rule(_LM, (ids,), _ce, labels) == LossItems(None, False, -100)


@pytest.mark.parametrize("loss_fn", [_ce_plus, _summed])
def test_a_loss_that_is_not_one_plain_mean_gets_no_rule(loss_fn):
    """A second term, or the loss's own normalisation: the micro-batch means are averaged (no
    rule), since weighting them by items would change what the loss means."""
    ids, labels = _labels()
    assert _rule(_LM, (ids,), loss_fn, labels) is None


def test_class_weights_count_each_micro_batchs_weight_sum_and_weights_on_meta_get_no_rule():
    """``cross_entropy(weight=w)``'s mean is Σ w[y]·l / Σ w[y]: a micro-batch's items are the weight
    sum of its valid targets, so that micro-batch means weighted by them give the whole batch's mean
    (they were averaged: at a micro-batch of one example the weights cancelled out, helper-59).
    Weights held by the model are on meta in the dry run: no rule (the means are averaged)."""
    ids, labels = _labels()
    rule = _rule(_LM, (ids,), _weighted, labels)
    assert rule == LossItems(None, False, -100, weight=tuple(float(w) for w in _CLASS_WEIGHTS.double()))
    logits = torch.randn(2, 8, 32)
    whole = _weighted(logits, labels)
    parts = [(_weighted(logits[i:i + 1], labels[i:i + 1]), rule.count((ids[i:i + 1],), labels[i:i + 1])[0])
             for i in range(2)]
    assert parts[0][1] == pytest.approx(float(_CLASS_WEIGHTS[labels[0][labels[0] != -100]].sum()))
    assert sum(float(m) * n for m, n in parts) / sum(n for _, n in parts) == pytest.approx(float(whole), rel=1e-6)
    assert _rule(_WeightsOnTheModel, {"input_ids": ids, "labels": labels}, model_loss, None) is None


def test_a_loss_call_whose_target_could_not_be_read_gets_no_rule():
    """Soft targets (class probabilities, floating point) are no ids to count: no rule, no error."""
    from varuna_sdk.model.loss_items import infer_loss_items

    ids, _ = _labels()
    soft = torch.softmax(torch.randn(2, 8, 32), -1)
    assert _rule(_LM, (ids,), lambda out, y: F.cross_entropy(out.transpose(1, 2), y.transpose(1, 2)), soft) is None
    assert infer_loss_items([None], torch.zeros(()), (ids,), None) is None


def test_an_in_place_added_term_gets_no_rule():
    """``loss += aux`` keeps the cross-entropy's tensor object but not its meaning (Mixtral's router
    balance loss): no rule (it was read as the plain mean)."""
    ids, labels = _labels()
    assert _rule(lambda: _OwnLoss(aux=True), {"input_ids": ids, "labels": labels}, model_loss, None) is None
    assert _rule(lambda: _OwnLoss(aux=False), {"input_ids": ids, "labels": labels}, model_loss, None) is not None


def _padded_pairs():
    ids, labels = _labels()
    return [(ids[i % 2], labels[i % 2]) for i in range(200)]


def test_ignored_labels_without_a_rule_are_warned_about_before_anything_starts():
    """A dataset whose labels hold -100 and a loss the SDK cannot weigh (here: a second term): the
    loss will depend on the micro-batch size, and ``Job()`` says so; with a plain mean it does not."""
    import warnings

    from varuna_sdk.notebook import Job

    kw = dict(tokenizer=None, global_batch=8, micro_batch_size=2, P=1, D=1)
    with pytest.warns(UserWarning, match=r"hold -100 \(ignored labels\), but _LM's loss is not one mean cross_entropy"):
        Job(model=_LM, data=_padded_pairs, loss=_ce_plus, **kw)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*ignored labels.*")
        Job(model=_LM, data=_padded_pairs, loss=_ce, **kw)


def _shifting_loss(out, y):
    """A user's loss written as Hugging Face's: the targets padded with -100, then shifted."""
    shifted = F.pad(y, (0, 1), value=-100)[..., 1:]
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), shifted.reshape(-1))


def _first_predict_nothing(k: int):
    ids, labels = _labels()
    out = [(ids[i % 2], labels[i % 2]) for i in range(200)]
    out[:k] = [(ids[0], torch.full_like(labels[0], -100))] * k
    return out


@pytest.mark.parametrize("k", [1, 20])
def test_a_sample_that_cannot_tell_the_shift_is_read_again_from_more_examples(k):
    """A micro-batch whose labels are all ignored cannot tell whether the loss shifts them (its rule
    is ``guessed``): ``trainer.loss_items_of`` reads the rule again off 8, then 64 examples — the
    first 20 predicting nothing too (a dataset sorted that way) — so a user's pad-then-shift loss is
    not weighted by unshifted counts (helper-39 D1)."""
    from varuna_sdk.notebook import Job
    from varuna_sdk.trainer import loss_items_of, model_structure

    job = Job(model=_LM, data=lambda: _first_predict_nothing(k), loss=_shifting_loss, tokenizer=None, global_batch=8,
              micro_batch_size=1, P=1, D=1)
    structure = model_structure(job.config, job.resolved)
    assert structure.loss_items.guessed and structure.loss_items.shift is False   # the convention, from one example
    assert loss_items_of(job.config, job.resolved, structure) == LossItems(None, True, -100)


class _NoLabels(_LM):
    def forward(self, input_ids, attention_mask=None):
        return super().forward(input_ids)


def _hf_format(shift: bool):
    ids, labels = _labels()
    if shift:   # y[t] = x[t + 1]: what the automatic cross-entropy compares with
        labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    return [{"input_ids": ids[i % 2], "labels": labels[i % 2]} for i in range(200)]


def test_labels_in_hugging_faces_format_for_the_automatic_loss_are_warned_about():
    """A forward without ``labels`` and dict data whose ``labels`` are the ``input_ids`` (-100 on
    padding): the automatic cross-entropy would teach the model to copy its input (helper-39 D2:
    the loss fell to 1.5 on random tokens, below ln 63). Targets shifted by one are not warned about."""
    import warnings

    from varuna_sdk.notebook import Job

    kw = dict(tokenizer=None, global_batch=8, micro_batch_size=2, P=1, D=1)
    with pytest.warns(UserWarning, match=r"targets equal _NoLabels's (positional input 0|input 'input_ids') wherever "
                                         r"they are not -100"):
        Job(model=_NoLabels, data=lambda: _hf_format(False), **kw)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*learn to copy.*")
        Job(model=_NoLabels, data=lambda: _hf_format(True), **kw)

