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
