"""What a user brings besides text: a ``torch.utils.data.Dataset`` factory and a model for it
(import paths ``tests.thirdparty.user_data:...``)."""

import random

import torch
from torch import nn


def make_dataset(n: int = 400, features: int = 16, classes: int = 4, seed: int = 0):
    """(x, y) pairs: x a float vector, y its class (which of the first ``classes`` features is largest)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    return torch.utils.data.TensorDataset(x, x[:, :classes].argmax(dim=1))


def int32_labels(n: int = 400, features: int = 16, classes: int = 4, seed: int = 0):
    """``make_dataset`` with its class ids as int32 (as NumPy gives them)."""
    return [(x, y.int()) for x, y in make_dataset(n, features, classes, seed)]


def out_of_range_labels(n: int = 400, features: int = 16, classes: int = 4, seed: int = 0, valid=()):
    """``make_dataset`` with every 10th label set to ``classes + 3``: a class id the model has no output for
    (but the examples ``valid``: those the dry run reads, for a job that fails in its workers)."""
    x, y = make_dataset(n, features, classes, seed).tensors
    y = y.clone()
    keep = y[list(valid)].clone()
    y[::10] = classes + 3
    y[list(valid)] = keep
    return torch.utils.data.TensorDataset(x, y)


def float64_dataset(n: int = 400, features: int = 16, classes: int = 4, seed: int = 0):
    """``make_dataset`` as numpy hands it over: float64 features (pandas ``.values``, ``np.random``)."""
    x, y = make_dataset(n, features, classes, seed).tensors
    return torch.utils.data.TensorDataset(x.double(), y)


def house_prices(n: int = 400, features: int = 16, seed: int = 0):
    """(x, y) pairs for a regression whose targets are in the hundreds (prices in k$): a mean
    squared error far above 709 at the start, where ``exp(loss)`` overflows a float."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    return torch.utils.data.TensorDataset(x, (x @ torch.linspace(1.0, 8.0, features)).unsqueeze(1) * 10 + 300)


def mse(output, target):
    """The regression's loss: mean squared error."""
    return torch.nn.functional.mse_loss(output, target)


def plain_cross_entropy(output, target):
    """A loss of the user's own that is torch's cross-entropy, as it is."""
    return torch.nn.functional.cross_entropy(output, target)


#: class weights of ``weighted_cross_entropy`` (4 classes: rare ones weigh more)
CLASS_WEIGHTS = torch.tensor([1.0, 5.0, 0.2, 3.0])


def weighted_cross_entropy(output, target):
    """A class-weighted cross-entropy, as a user weighs rare classes up."""
    return torch.nn.functional.cross_entropy(output, target, weight=CLASS_WEIGHTS)


class Residual(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d), nn.ReLU())

    def forward(self, h):
        return h + self.net(h)


def out_of_range_label_dicts(n: int = 400, features: int = 16, classes: int = 4, seed: int = 0, valid=()):
    """``out_of_range_labels`` as ``{"x", "labels"}`` examples, for a model computing its own loss."""
    return [{"x": x, "labels": y} for x, y in out_of_range_labels(n, features, classes, seed, valid)]


class SelfLossClassifier(nn.Module):
    """``Classifier`` that computes its own cross-entropy from ``labels=`` (as a Hugging Face
    ``...ForSequenceClassification`` does), returning ``{"loss", "logits"}``."""

    def __init__(self, features=16, hidden=32, depth=3, classes=4):
        super().__init__()
        self.net = Classifier(features, hidden, depth, classes)

    def forward(self, x, labels=None):
        logits = self.net(x)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


class Classifier(nn.Module):
    def __init__(self, features=16, hidden=32, depth=3, classes=4):
        super().__init__()
        self.inp = nn.Linear(features, hidden)
        self.body = nn.ModuleList([Residual(hidden) for _ in range(depth)])
        self.out = nn.Linear(hidden, classes)

    def forward(self, x):
        h = self.inp(x)
        for block in self.body:
            h = block(h)
        return self.out(h)


class NormResidual(nn.Module):
    def __init__(self, d, momentum=0.1):
        super().__init__()
        # no bias before the BatchNorm: the loss does not depend on it, so Adam would move it by
        # rounding noise alone, and the running mean with it
        self.lin, self.bn = nn.Linear(d, d, bias=False), nn.BatchNorm1d(d, momentum=momentum)

    def forward(self, h):
        return h + torch.relu(self.bn(self.lin(h)))


class PythonRandomClassifier(Classifier):
    """``Classifier`` whose blocks scale their output by a draw of Python's ``random`` (a user's
    hand-written noise)."""

    def forward(self, x):
        h = self.inp(x)
        for block in self.body:
            h = block(h) * (0.9 + 0.2 * random.random())
        return self.out(h)


def dropout_cross_entropy(output, target):
    """A loss of the user's own that draws: dropout on the logits (torch's generator)."""
    return torch.nn.functional.cross_entropy(torch.nn.functional.dropout(output, 0.3), target)


class BatchNormClassifier(Classifier):
    """``Classifier`` whose blocks hold a BatchNorm: running statistics a forward updates in place
    (``momentum=None``: a cumulative average)."""

    def __init__(self, features=16, hidden=32, depth=3, classes=4, momentum=0.1):
        super().__init__(features, hidden, depth, classes)
        self.body = nn.ModuleList([NormResidual(hidden, momentum) for _ in range(depth)])


class MeanCentred(nn.Module):
    """A residual block that keeps its own EMA of its inputs' mean (a buffer updated in place in
    training) and subtracts it: a forward that reads state it updates."""

    def __init__(self, d):
        super().__init__()
        self.f = nn.Linear(d, d)
        self.register_buffer("run_mean", torch.zeros(d))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.run_mean.mul_(0.9).add_(0.1 * x.mean(0))
        return x + torch.tanh(self.f(x - self.run_mean))


class RunningMeanClassifier(Classifier):
    """``Classifier`` whose blocks are ``MeanCentred``."""

    def __init__(self, features=16, hidden=32, depth=3, classes=4):
        super().__init__(features, hidden, depth, classes)
        self.body = nn.ModuleList([MeanCentred(hidden) for _ in range(depth)])


class EarlyAuxiliary(Classifier):
    """``Classifier`` returning ``(logits, aux)`` with ``aux`` (a scalar) computed right after its first
    block and used only by the loss (``aux_loss``): no stage may start between them."""

    def __init__(self, features=16, hidden=32, depth=4, classes=4):
        super().__init__(features, hidden, depth, classes)

    def forward(self, x):
        h = self.body[0](self.inp(x))
        aux = h.pow(2).mean()
        for block in self.body[1:]:
            h = block(h)
        return self.out(h), aux


def aux_loss(output, y):
    """Cross-entropy of ``output[0]`` plus 0.01 x ``output[1]``."""
    logits, aux = output
    return nn.functional.cross_entropy(logits, y) + 0.01 * aux


class SlowExamples(torch.utils.data.Dataset):
    """``make_dataset(n)`` read slowly: ``delay_s`` seconds per example (a decoder, a network file
    system)."""

    def __init__(self, n: int = 400, delay_s: float = 0.01):
        self.ds, self.delay_s = make_dataset(n), delay_s

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        import time

        time.sleep(self.delay_s)
        return self.ds[i]


class SlowAugmented(SlowExamples):
    """``SlowExamples`` with a random augmentation drawn from torch's global generator (noise
    added to the features, as torchvision's random transforms draw): read on the main thread."""

    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        return x + 0.01 * torch.randn_like(x), y


class OneBadExample(torch.utils.data.Dataset):
    """``make_dataset(n)`` whose example ``bad`` cannot be read (a record missing from the file its
    ``__len__`` was counted from): ``__getitem__`` raises ``IndexError`` for it."""

    def __init__(self, n: int = 400, bad: int = 0):
        self.inner, self.bad = make_dataset(n), bad

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        if i == self.bad:
            raise IndexError(f"record {i} is missing from the file")
        return self.inner[i]


class TokenWindows(torch.utils.data.Dataset):
    """``(x, y)`` token windows (``y``: the next tokens) with ids below ``max_id``; ``ragged``: the
    window length varies with the example (16 + i % 7 tokens), as a user forgets to pad."""

    def __init__(self, n: int = 200, max_id: int = 100, ragged: bool = False):
        self.n, self.max_id, self.ragged = n, max_id, ragged

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        length = 16 + i % 7 if self.ragged else 16
        x = torch.randint(0, self.max_id, (length + 1,), generator=g)
        x[0] = self.max_id - 1  # every example holds the largest id
        return x[:-1], x[1:]


def padded_windows(n: int = 200, pad: int = 4):
    """``TokenWindows`` whose last ``pad`` targets are -1: padding a nanoGPT-style model's own loss
    ignores (``cross_entropy(..., ignore_index=-1)``), and a plain cross-entropy cannot take."""
    ds = TokenWindows(n)
    return [(x, torch.cat([y[:-pad], torch.full((pad,), -1)])) for x, y in (ds[i] for i in range(n))]


def padded_chats(n: int = 200, length: int = 16, vocab: int = 64, seed: int = 0):
    """Right-padded causal-LM examples as a chat dataset gives them: ``input_ids`` of 2..``length``
    real tokens then id 0 (every 3rd example unpadded), ``attention_mask`` 1 on the real ones,
    ``labels`` the ids with -100 on the padding (and on the first two, a prompt): each example has its
    own count of predicted tokens; every 7th (the first too) predicts none (a prompt cut off before
    its answer)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        real = int(torch.randint(2, length + 1, (1,), generator=g)) if i % 3 else length
        ids = torch.zeros(length, dtype=torch.long)
        ids[:real] = torch.randint(1, vocab, (real,), generator=g)
        mask = (torch.arange(length) < real).long()
        labels = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
        labels[:2] = -100
        if i % 7 == 0:
            labels[:] = -100
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def long_windows(n: int = 200, length: int = 40):
    """``TokenWindows`` of ``length`` tokens each (longer than a 32-position model can take)."""
    ds = TokenWindows(n)
    return [(x.repeat(3)[:length], y.repeat(3)[:length]) for x, y in (ds[i] for i in range(n))]


def wordlevel_tokenizer(text: str, path) -> str:
    """A word-level ``tokenizer.json`` made from ``text`` with the ``tokenizers`` library, with
    ``[PAD]``, ``[UNK]``, ``[MASK]`` special tokens (what a masked LM's saved tokenizer has);
    returns its path."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([text], trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]", "[MASK]"]))
    tok.save(str(path))
    return str(path)


def scored_sentences(n: int = 200, length: int = 16, seed: int = 0):
    """Dict examples as a tokenized dataset gives them — ``input_ids``, ``attention_mask`` and a
    float ``labels`` score (a regression: the share of ids above 128)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (n, length), generator=g)
    score = (ids > 128).float().mean(dim=1)
    return [{"input_ids": ids[i], "attention_mask": torch.ones(length, dtype=torch.long), "labels": score[i]}
            for i in range(n)]


def masked_regression(n: int = 200, features: int = 12, seed: int = 0):
    """Dict examples ``x`` (float), ``mask`` (bool: which features count) and ``target``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    mask = torch.rand(n, features, generator=g) > 0.2
    y = (x * mask).sum(dim=1, keepdim=True)
    return [{"x": x[i], "mask": mask[i], "target": y[i]} for i in range(n)]


class MaskedMLP(nn.Module):
    """``forward(x, mask)``: the features the mask keeps, through a residual MLP, to one output."""

    def __init__(self, features: int = 12, hidden: int = 32, depth: int = 2):
        super().__init__()
        self.inp = nn.Linear(features, hidden)
        self.body = nn.ModuleList([Residual(hidden) for _ in range(depth)])
        self.out = nn.Linear(hidden, 1)

    def forward(self, x, mask):
        h = self.inp(x * mask)
        for block in self.body:
            h = block(h)
        return self.out(h)


def small_images(n: int = 200, size: int = 16, classes: int = 4, seed: int = 0):
    """Dict examples as an image dataset gives them: ``pixel_values`` ``[3, size, size]`` float and
    an int ``labels`` class (which colour channel is brightest)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 3, size, size, generator=g)
    x[torch.arange(n), torch.arange(n) % 3] += 0.5
    y = torch.arange(n) % 3 % classes
    return [{"pixel_values": x[i], "labels": y[i]} for i in range(n)]


class ChangesMidway(torch.utils.data.Dataset):
    """``make_dataset(n)`` whose examples change after ``after`` reads in a process (a file
    rewritten under a running job): ``features`` features instead of 16, or float64 with
    ``dtype_only``."""

    def __init__(self, n: int = 400, after: int = 200, features: int = 20, dtype_only: bool = False):
        self.inner, self.after, self.features, self.dtype_only, self.reads = make_dataset(n), after, features, dtype_only, 0

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        self.reads += 1
        x, y = self.inner[i]
        if self.reads > self.after:
            x = x.double() if self.dtype_only else torch.nn.functional.pad(x, (0, self.features - x.shape[0]))
        return x, y


class HiddenAndLogits(Classifier):
    """``Classifier`` whose forward returns ``(hidden, logits)``: the logits second."""

    def forward(self, x):
        h = self.inp(x)
        for block in self.body:
            h = block(h)
        return h, self.out(h)


class HangsOnFlag(torch.utils.data.Dataset):
    """``make_dataset(n)`` whose ``__getitem__`` hangs (a stuck network mount) once the file
    ``flag`` exists."""

    def __init__(self, flag: str, n: int = 400):
        self.ds, self.flag = make_dataset(n), flag

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        import os
        import time

        while os.path.exists(self.flag):
            time.sleep(0.05)
        return self.ds[i]


class NpyExamples(torch.utils.data.Dataset):
    """(x, y) rows of a ``.npy`` file of floats (y: the class of the largest of the first 4
    features), read from disk on every ``[i]`` — a file the user may edit between runs.
    ``own_noise``: add noise from a generator of its own (no stable fingerprint)."""

    def __init__(self, path: str, own_noise: bool = False):
        import numpy as np

        self.x = np.load(path, mmap_mode="r")
        self.rng = np.random.default_rng() if own_noise else None

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        x = torch.from_numpy(self.x[i].copy())
        if self.rng is not None:
            x = x + torch.from_numpy(self.rng.normal(0, 0.01, x.shape).astype(x.numpy().dtype))
        return x, x[:4].argmax()


def padded_sentences(n: int = 64, length: int = 12, vocab: int = 20, classes: int = 3, seed: int = 1) -> list:
    """Dict examples of a sentence classifier: ``tokens`` (3..``length`` real ids, then 0),
    ``pad_mask`` True on the padding (``nn.TransformerEncoder``'s ``src_key_padding_mask``) and a
    class id ``labels``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        real = int(torch.randint(3, length + 1, (1,), generator=g))
        mask = torch.arange(length) >= real
        ids = torch.randint(1, vocab, (length,), generator=g).masked_fill(mask, 0)
        out.append({"tokens": ids, "pad_mask": mask, "labels": torch.randint(0, classes, (), generator=g)})
    return out


class EncoderClassifier(nn.Module):
    """PyTorch's stock ``nn.TransformerEncoder`` over embeddings, mean-pooled over the real tokens:
    in eval mode (the held-out loss) with a padding mask its nested-tensor fast path would hand the
    layers a nested tensor."""

    def __init__(self, vocab: int = 20, d: int = 16, layers: int = 3, classes: int = 3):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, nhead=2, dim_feedforward=32, dropout=0.0,
                                                                    batch_first=True), layers)
        self.head = nn.Linear(d, classes)

    def forward(self, tokens, pad_mask):
        x = self.enc(self.emb(tokens), src_key_padding_mask=pad_mask)
        keep = (~pad_mask).unsqueeze(-1).float()
        return self.head((x * keep).sum(1) / keep.sum(1))


def class_probabilities(n: int = 400, features: int = 16, classes: int = 4, seed: int = 0, soft: bool = False):
    """``make_dataset`` with its labels as float class probabilities ``[classes]``: one-hot, or
    (``soft``) label-smoothed towards a seeded random distribution (each row sums to 1)."""
    x, y = make_dataset(n, features, classes, seed).tensors
    p = torch.nn.functional.one_hot(y, classes).float()
    if soft:
        noise = torch.rand(n, classes, generator=torch.Generator().manual_seed(seed + 1))
        p = 0.7 * p + 0.3 * noise / noise.sum(-1, keepdim=True)
    return torch.utils.data.TensorDataset(x, p)


def column_labels(n: int = 400, features: int = 16, classes: int = 4, seed: int = 0):
    """``make_dataset`` with its class ids as a column, ``[n, 1]`` (``y.unsqueeze(1)``): a batch of
    them is ``[B, 1]``, which cross-entropy with ``[B, C]`` logits does not take."""
    x, y = make_dataset(n, features, classes, seed).tensors
    return torch.utils.data.TensorDataset(x, y.unsqueeze(1))


def tagged_sequences(n: int = 200, length: int = 12, channels: int = 3, classes: int = 4, seed: int = 0,
                     probabilities: bool = True):
    """Per-position tagging in PyTorch's ``[C, L]`` layout: ``x`` ``[channels, length]`` and, per
    position, the class of its largest channel (ids mod ``classes``) as one-hot probabilities
    ``[classes, length]`` (classes in dimension 0 of an example: a batch's dimension 1), or as ids
    ``[length]``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, channels, length, generator=g)
    y = (x.argmax(1) + (x[:, 0] > 0).long()) % classes
    t = torch.nn.functional.one_hot(y, classes).movedim(-1, 1).float() if probabilities else y
    return torch.utils.data.TensorDataset(x, t)


class ConvBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.conv = nn.Conv1d(d, d, 3, padding=1)

    def forward(self, h):
        return h + torch.relu(self.conv(h))


class ConvTagger(nn.Module):
    """1-D convolutions whose logits are ``[B, classes, length]`` (PyTorch's ``[B, C, d1]`` layout,
    as a segmentation model's)."""

    def __init__(self, channels: int = 3, hidden: int = 8, depth: int = 3, classes: int = 4):
        super().__init__()
        self.inp = nn.Conv1d(channels, hidden, 1)
        self.body = nn.ModuleList([ConvBlock(hidden) for _ in range(depth)])
        self.out = nn.Conv1d(hidden, classes, 1)

    def forward(self, x):
        h = self.inp(x)
        for block in self.body:
            h = block(h)
        return self.out(h)


def multi_task(n: int = 200, features: int = 16, classes: int = 4, seed: int = 0) -> list:
    """Dict examples for a multi-task loss: ``x`` ``[features]``, a class ``label`` (int64) and a
    regression ``score`` (float), e.g. a review's sentiment and its rating."""
    x, y = make_dataset(n, features, classes, seed).tensors
    score = x[:, :4].sum(-1) / 4
    return [{"x": x[i], "label": y[i], "score": score[i]} for i in range(n)]


class TwoHeads(Classifier):
    """``Classifier`` with a second head: returns ``(class logits [B, C], score [B])``."""

    def __init__(self, features: int = 16, hidden: int = 32, depth: int = 3, classes: int = 4):
        super().__init__(features, hidden, depth, classes)
        self.score = nn.Linear(hidden, 1)

    def forward(self, x):
        h = self.inp(x)
        for block in self.body:
            h = block(h)
        return self.out(h), self.score(h).squeeze(-1)


def multi_task_loss(output, targets):
    """Cross-entropy of the class plus half the MSE of the score: ``targets`` is the dict
    ``{"label": [B], "score": [B]}`` (``model.targets: [label, score]``)."""
    logits, score = output
    return (torch.nn.functional.cross_entropy(logits, targets["label"])
            + 0.5 * torch.nn.functional.mse_loss(score, targets["score"]))


def variable_length_sentences(n: int = 64, length: int = 10, vocab: int = 50, classes: int = 3, seed: int = 5) -> list:
    """Dict examples of sentences of different lengths, padded to ``length``: ``tokens`` [length]
    (0 after the end), ``lengths`` (int64, 2..length: how many tokens are real) and a class ``label``."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, length + 1, (n,), generator=g)
    tokens = torch.randint(1, vocab, (n, length), generator=g) * (torch.arange(length) < lengths[:, None])
    labels = torch.randint(0, classes, (n,), generator=g)
    return [{"tokens": tokens[i], "lengths": lengths[i], "label": labels[i]} for i in range(n)]


class PackedBlock(nn.Module):
    """An LSTM over the real tokens only: ``pack_padded_sequence`` with the data's ``lengths``
    (a CPU int64 tensor, as torch requires), unpacked to the padded length again."""

    def __init__(self, d: int):
        super().__init__()
        self.rnn = nn.LSTM(d, d, batch_first=True)

    def forward(self, x, lengths):
        from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

        packed = pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
        y, _ = self.rnn(packed)
        return pad_packed_sequence(y, batch_first=True, total_length=x.shape[1])[0]


class PackedLSTM(nn.Module):
    """Embedding, LSTM blocks on packed sequences (each given the data field ``lengths``), and a
    classifier on each sentence's last real position."""

    def __init__(self, vocab: int = 50, d: int = 16, depth: int = 3, classes: int = 3):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(PackedBlock(d) for _ in range(depth))
        self.head = nn.Linear(d, classes)

    def forward(self, tokens, lengths):
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x, lengths)
        return self.head(x[torch.arange(x.shape[0]), lengths - 1])


class NoisyLabels(torch.utils.data.Dataset):
    """Synthetic examples as users write them: made with *unseeded* ``torch.randn`` in the
    factory, and each read adds NumPy noise to the features (an augmentation) whose class is taken
    after the noise, so inputs and labels belong together only when every stage draws alike."""

    def __init__(self, n: int = 200, features: int = 16, classes: int = 4):
        import numpy as np

        self.x, self.classes, self.np = torch.randn(n, features), classes, np

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        x = self.x[i] + torch.from_numpy(self.np.random.normal(0.0, 1.0, self.x.shape[1]).astype("float32"))
        return x, x[:self.classes].argmax()


def loss_and_accuracy(output, y):
    """A Lightning-style loss: ``{"loss": ..., "acc": ...}``."""
    return {"loss": nn.functional.cross_entropy(output, y), "acc": (output.argmax(-1) == y).float().mean()}


def loss_and_logits(output, y):
    """A loss returning ``(loss, output)``."""
    return nn.functional.cross_entropy(output, y), output


def loss_of_shape_one(output, y):
    """A loss returning a one-element tensor of shape ``[1]`` (``.view(1)``), which plain PyTorch's
    ``backward`` takes as it takes a 0-dim one."""
    return nn.functional.cross_entropy(output, y).view(1)


class AttributeBlocks(nn.Module):
    """``Classifier`` with its blocks kept as attributes (``self.b1``, ``self.b2``, ``self.b3``), no list."""

    def __init__(self, features=16, hidden=32, classes=4):
        super().__init__()
        self.inp = nn.Linear(features, hidden)
        self.b1, self.b2, self.b3 = Residual(hidden), Residual(hidden), Residual(hidden)
        self.out = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.out(self.b3(self.b2(self.b1(self.inp(x)))))


def float_class_ids(n: int = 64):
    """``make_dataset`` with its class ids stored as floats."""
    return [(x, y.float()) for x, y in make_dataset(n)]


def scalar_scores(n: int = 64, features: int = 16):
    """``(x, score)``: one float score per example, shape ``[]`` (a regression the output ``[B, 1]`` must match)."""
    x = torch.randn(n, features, generator=torch.Generator().manual_seed(0))
    return torch.utils.data.TensorDataset(x, x[:, :3].sum(dim=1))


class OneOutput(nn.Module):
    def __init__(self, features=16):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(features, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, x):
        return self.body(x)


def ce(output, y):
    return nn.functional.cross_entropy(output, y)


class GatedBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, h, gate):
        return h + torch.relu(self.lin(h)) * gate


class SharedConstantBuffer(nn.Module):
    """Every block reads one constant buffer of the root module (as a causal mask is shared by all
    layers): ``self.gate``, persistent, never written."""

    def __init__(self, features=16, hidden=32, depth=3, classes=4):
        super().__init__()
        self.inp = nn.Linear(features, hidden)
        self.register_buffer("gate", torch.linspace(0.5, 1.5, hidden))
        self.body = nn.ModuleList([GatedBlock(hidden) for _ in range(depth)])
        self.out = nn.Linear(hidden, classes)

    def forward(self, x):
        h = self.inp(x)
        for block in self.body:
            h = block(h, self.gate)
        return self.out(h * self.gate)
