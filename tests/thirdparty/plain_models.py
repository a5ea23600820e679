"""Plain ``nn.Module`` models as users write them, with the two shapes automatic cut-points
must get right (import-path factories for the tests):

- ``shared_depth``: one block object listed at every depth of the ``ModuleList`` (its weights
  shared across depth, as in ALBERT), so the same module runs before a stage and within it;
- ``wide_mlp``: distinct blocks whose MLP is an ``nn.Sequential`` with more modules than the
  model has blocks, which must not be taken for the model's body.
"""

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int, mlp_modules: int = 3):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        extra = [nn.Dropout(0.0), nn.Identity()][:max(0, mlp_modules - 3)]
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d), *extra)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(self.norm(x))


class TinyLM(nn.Module):
    """Embedding, ``layers`` (a ``ModuleList`` of blocks), LayerNorm and a linear head: logits."""

    def __init__(self, layers: list[nn.Module], vocab_size: int, d: int):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, d)
        self.layers = nn.ModuleList(layers)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def shared_depth(n_layer: int = 4, d: int = 32, vocab_size: int = 256) -> nn.Module:
    block = Block(d)
    return TinyLM([block] * n_layer, vocab_size, d)


def wide_mlp(n_layer: int = 3, d: int = 32, vocab_size: int = 256) -> nn.Module:
    return TinyLM([Block(d, mlp_modules=5) for _ in range(n_layer)], vocab_size, d)


class Mixer(nn.Module):
    """A block without its residual: the model adds it around the call."""

    def __init__(self, d: int):
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class OuterResidualLM(nn.Module):
    """Residuals added *outside* the blocks, as many models write them: ``x = x + layer(x)``
    (``paired=False``), or per layer a ``ModuleList`` of two sub-blocks, ``for attn, ff in
    self.layers: x = attn(x) + x; x = ff(x) + x`` (``paired=True``). Either way the tensor a block
    receives at a cut-point is used again, by its object from before the cut, after the call."""

    def __init__(self, n_layer: int = 4, d: int = 32, vocab_size: int = 256, paired: bool = False):
        super().__init__()
        self.paired = paired
        self.emb = nn.Embedding(vocab_size, d)
        self.layers = nn.ModuleList(nn.ModuleList([Mixer(d), Mixer(d)]) if paired else Mixer(d)
                                    for _ in range(n_layer))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        if self.paired:
            for attn, ff in self.layers:
                x = attn(x) + x
                x = ff(x) + x
        else:
            for layer in self.layers:
                x = x + layer(x)
        return self.head(self.norm(x))


def outer_residual(n_layer: int = 4, d: int = 32, vocab_size: int = 256, paired: bool = False) -> nn.Module:
    return OuterResidualLM(n_layer, d, vocab_size, paired)


class AuxOutputLM(TinyLM):
    """Returns ``(logits, aux)``: ``aux`` is a penalty made inside the pipeline, from the output of
    block ``aux_from`` (-1: from the logits, in the last segment), and the loss (``aux_loss``)
    adds it, as mixture-of-experts load-balancing losses do."""

    def __init__(self, n_layer: int = 4, d: int = 32, vocab_size: int = 256, aux_from: int = 0):
        super().__init__([Block(d) for _ in range(n_layer)], vocab_size, d)
        self.aux_from = aux_from

    def forward(self, idx: torch.Tensor):
        x = self.emb(idx)
        aux = None
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i == self.aux_from:
                aux = x.pow(2).mean()
        logits = self.head(self.norm(x))
        return logits, (logits.pow(2).mean() if aux is None else aux)


def aux_output(n_layer: int = 4, d: int = 32, vocab_size: int = 256, aux_from: int = 0) -> nn.Module:
    return AuxOutputLM(n_layer, d, vocab_size, aux_from)


def aux_loss(out, targets: torch.Tensor) -> torch.Tensor:
    logits, aux = out
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)) + 0.1 * aux


class RandomSkipLM(TinyLM):
    """A hand-written LayerDrop: in training each block is skipped with probability ``p``."""

    def __init__(self, n_layer: int = 6, d: int = 32, vocab_size: int = 256, p: float = 0.9):
        super().__init__([Block(d) for _ in range(n_layer)], vocab_size, d)
        self.p = p

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for layer in self.layers:
            if not (self.training and torch.rand(()) < self.p):
                x = layer(x)
        return self.head(self.norm(x))


class NoisyLM(TinyLM):
    """Gaussian noise added to the embeddings in training (``torch.randn_like``), no dropout module."""

    def __init__(self, n_layer: int = 2, d: int = 32, vocab_size: int = 256):
        super().__init__([Block(d) for _ in range(n_layer)], vocab_size, d)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        if self.training:
            x = x + 0.01 * torch.randn_like(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


class LazyHead(nn.Module):
    """Blocks of ``nn.Linear`` and a head made by ``nn.LazyLinear`` (its input size found at the
    first forward)."""

    def __init__(self, d: int = 16, classes: int = 4):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(d, d) for _ in range(3)])
        self.head = nn.LazyLinear(classes)

    def forward(self, x):
        for b in self.blocks:
            x = torch.relu(b(x))
        return self.head(x)


class CheckpointedBlocks(nn.Module):
    """Residual MLP blocks each run under ``torch.utils.checkpoint`` (non-reentrant), the user's own
    activation recomputation."""

    def __init__(self, d: int = 16, classes: int = 4, n_layer: int = 4):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(d, d), nn.Tanh()) for _ in range(n_layer)])
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        from torch.utils import checkpoint

        for b in self.blocks:
            x = x + checkpoint.checkpoint(b, x, use_reentrant=False)
        return self.head(x)


class NumpyMasked(nn.Module):
    """Blocks that mask their features with NumPy's global generator in the forward (as Hugging
    Face's SpecAugment does): a recompute must draw the forward's mask again."""

    def __init__(self, d: int = 16, classes: int = 4, n_layer: int = 4):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(d, d) for _ in range(n_layer)])
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        import numpy as np

        for b in self.blocks:
            keep = torch.from_numpy(np.random.rand(x.shape[-1]) > 0.3).to(x.dtype)
            x = torch.tanh(b(x)) * keep
        return self.head(x)


class Routed(nn.Module):
    """Blocks whose rows are routed by ``torch.nonzero`` of a value (as mixture-of-experts routing
    is): an output shape that depends on values, which the meta device cannot compute."""

    def __init__(self, d: int = 16, classes: int = 4, n_layer: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(d, d) for _ in range(n_layer)])
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        for b in self.blocks:
            chosen = torch.nonzero(x[:, 0] > 0).squeeze(-1)
            x = torch.tanh(b(x))
            x = x.index_add(0, chosen, x[chosen])
        return self.head(x)


class DictBlocks(nn.Module):
    """Blocks held in an ``nn.ModuleDict`` (named stages of a user's network), called in its order."""

    def __init__(self, d: int = 16, classes: int = 4):
        super().__init__()
        self.stages = nn.ModuleDict({name: nn.Linear(d, d) for name in ("stem", "middle", "late", "final")})
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        for block in self.stages.values():
            x = torch.tanh(block(x))
        return self.head(x)


class MaskedFrames(nn.Module):
    """SpecAugment as Wav2Vec2/HuBERT do it before their first block: the input projected over a
    sequence, then some frames overwritten in place with a learned vector (``h[mask] = emb``)."""

    def __init__(self, d: int = 16, hidden: int = 24, classes: int = 4, depth: int = 4):
        super().__init__()
        self.inp = nn.Linear(d, hidden)
        self.mask_emb = nn.Parameter(torch.randn(hidden))
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(hidden, hidden), nn.GELU()) for _ in range(depth))
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):
        h = self.inp(x.view(x.shape[0], 2, -1).repeat(1, 1, 2))   # (batch, 2 frames, d)
        if self.training:
            mask = torch.zeros(h.shape[:2], dtype=torch.bool)
            mask[:, 1] = True
            h[mask] = self.mask_emb.to(h.dtype)
        for block in self.layers:
            h = h + block(h)
        return self.head(h.mean(1))
