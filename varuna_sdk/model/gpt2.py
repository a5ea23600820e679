"""Reference GPT-2: one readable file (pre-LN, GELU, learned positions, tied embeddings), shaped
from a laptop-sized preset up to GPT-2 XL (1.5B). It knows nothing of parallelism: its body is
an ``nn.ModuleList`` of blocks, so ``auto_cutpoints`` splits it without edits.

Tensor shapes: ``idx`` ``[batch, seq]`` int64 → logits ``[batch, seq, vocab]`` float.
Must never import ``varuna_sdk.pipeline``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from .cutpoint import auto_cutpoints


@dataclass(frozen=True)
class GPT2Config:
    """Shape of a GPT-2. ``block_size`` is the longest sequence (positions); ``dropout`` applies
    to embeddings, attention probabilities and residual branches."""

    vocab_size: int = 50257
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True

    def __post_init__(self) -> None:
        for f in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, f) < 1:
                raise ValueError(f"GPT2Config.{f}={getattr(self, f)} must be >= 1")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPT2Config: n_embd={self.n_embd} must be divisible by n_head={self.n_head}; "
                f"try n_head in {[h for h in range(1, 33) if self.n_embd % h == 0]}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPT2Config.dropout={self.dropout} must be in [0, 1)")

    def num_parameters(self) -> int:
        """Parameter count (tied embedding counted once)."""
        d, L, V, T = self.n_embd, self.n_layer, self.vocab_size, self.block_size
        b = 1 if self.bias else 0
        ln = d + d * b
        per_block = 2 * ln + (3 * d * d + 3 * d * b) + (d * d + d * b) + (4 * d * d + 4 * d * b) + (4 * d * d + d * b)
        return V * d + T * d + L * per_block + ln

    def to_dict(self) -> dict:
        """Every field as a plain dict (the YAML / JSON form)."""
        return asdict(self)


PRESETS: dict[str, GPT2Config] = {
    "tiny": GPT2Config(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=32),
    "cpu-demo": GPT2Config(block_size=128, n_layer=4, n_head=4, n_embd=128),
    "gpt2": GPT2Config(),
    "gpt2-medium": GPT2Config(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": GPT2Config(n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": GPT2Config(n_layer=48, n_head=25, n_embd=1600),
}


def preset(name: str, **overrides) -> GPT2Config:
    """A named shape (``tiny``, ``cpu-demo``, ``gpt2`` … ``gpt2-xl``) with fields overridden.

    Raises ``ValueError`` listing the presets for an unknown name.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown GPT-2 preset {name!r}; choose one of {sorted(PRESETS)}")
    return replace(PRESETS[name], **overrides)


class CausalSelfAttention(nn.Module):
    """Causal multi-head self-attention (``scaled_dot_product_attention``). ``[B, T, C] → [B, T, C]``."""

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Causal self-attention over ``x`` of shape ``[B, T, C]`` (batch, tokens, ``n_embd``): ``n_head`` heads of
        size ``C // n_head``, each token attending to itself and earlier ones, attention dropout in training only.
        Returns ``[B, T, C]`` after the output projection and residual dropout."""
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.c_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward: ``C → 4C`` (tanh GELU) ``→ C``, then dropout. ``[B, T, C] → [B, T, C]``."""

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, C] → [B, T, C]``: ``c_fc`` to ``4C``, tanh-approximated GELU, ``c_proj`` back to ``C``, then
        dropout."""
        return self.drop(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x)). ``[B, T, C] → [B, T, C]``."""

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Pre-LN residual block: ``h = x + attn(ln_1(x))``, returns ``h + mlp(ln_2(h))``; ``[B, T, C] → [B, T, C]``.
        ``gpt2()`` puts a cut-point around every block (paper §5.1)."""
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    """GPT-2 language model; ``forward(idx [B, T] int64) → logits [B, T, vocab]``.

    ``lm_head.weight`` *is* ``wte.weight`` (tied): on a pipeline the first and last stage each
    hold it and their gradients are summed (paper §5.2). Raises ``ValueError`` in ``forward`` for a
    sequence longer than ``block_size``.
    """

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T, vocab]`` of token ids ``idx`` ``[B, T]``; raises ``ValueError`` if ``T > block_size``."""
        T = idx.shape[1]
        if T > self.cfg.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.cfg.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def init_gpt2(module: nn.Module, name: str, n_layer: int = 12) -> None:
    """GPT-2 initialisation for one module's own parameters: N(0, 0.02) for linear and embedding
    weights, N(0, 0.02/√(2·n_layer)) for residual projections (``c_proj``), zero biases, unit
    LayerNorm. Used by ``materialize`` so that weights depend only on the name and the seed."""
    if isinstance(module, nn.Linear):
        std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("c_proj") else 0.02
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    elif isinstance(module, nn.LayerNorm):
        module.reset_parameters()


def gpt2(cfg: GPT2Config | str = "cpu-demo", cutpoints: bool = True) -> GPT2:
    """Build a GPT-2 (on the current default device) with cut-points around every block."""
    if isinstance(cfg, str):
        cfg = preset(cfg)
    model = GPT2(cfg)
    return auto_cutpoints(model) if cutpoints else model


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy; ``logits [B, T, V]``, ``targets [B, T]`` int64 → scalar."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
