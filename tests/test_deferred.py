"""Deferred initialisation (``model.deferred``): a model built with its tensors on meta, its
constructor's operations recorded and replayed per stage — checked against building the model
for real."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.thirdparty import hf_models
from tests.thirdparty.singlefile_gpt import make_gpt
from varuna_sdk.model.deferred import UninitializedError, build_recorded, construction_log
from varuna_sdk.model.materialize import build_on_meta, materialize

class _Swapped(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.bias = nn.Parameter(torch.zeros(3))
        nn.init.normal_(self.bias)
        self.bias.data = nn.functional.pad(self.bias, (0, 2), value=0.5)
        self.lin.weight.data = self.lin.weight.data * 2


class _DataSwap(nn.Module):
    """Constructors that move a parameter to new storage after initialising it (``p.data = ...``,
    as Hugging Face pads a tied head bias): the replay must use the storage each operation used."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_Swapped(), _Swapped()])


class _SkippedBlock(nn.Module):
    """Initialisers torch skips for a meta tensor (``trunc_normal_``, ``orthogonal_``, ``dirac_``,
    ``sparse_``), on tensors made by ``randn``, ``zeros`` and ``empty`` (a ViT's class token and
    positions, an RNN's orthogonal weights): they must be recorded and replayed (they were lost:
    a randn table kept std 1, an empty one was "never filled")."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(1, 8, 16))
        nn.init.trunc_normal_(self.pos, std=0.02)
        self.cls = nn.Parameter(torch.zeros(1, 1, 16))
        nn.init.trunc_normal_(self.cls, mean=0.1, std=0.02, a=-1.0, b=1.0)
        self.rec_weight = nn.Parameter(torch.empty(16, 8))
        nn.init.orthogonal_(self.rec_weight, gain=2.0)
        self.conv = nn.Conv1d(4, 4, 3)
        nn.init.dirac_(self.conv.weight)
        self.sparse = nn.Parameter(torch.empty(6, 5))
        nn.init.sparse_(self.sparse, sparsity=0.5)


class _SkippedOnMeta(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_SkippedBlock(), _SkippedBlock()])


class _FromData(nn.Module):
    """Tensors made from Python lists on a parameter's (meta) device, ``torch.tensor(values,
    device=p.device)`` and ``p.new_tensor(values)``, then copied in: the values must survive (they
    were dropped below every mode, and the replay said the tensor "was not made while recorded")."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.decay = nn.Parameter(torch.empty(4))
        self.mix = nn.Parameter(torch.empty(1, 4))
        with torch.no_grad():
            self.decay.copy_(torch.tensor([-5 + i / 3 for i in range(4)], device=self.decay.device) * 2)
            self.mix.copy_(self.lin.weight.new_tensor([[0.1, 0.2, 0.3, 0.4]]).pow(0.5))
            self.lin.bias.copy_(torch.as_tensor([1, 2, 3, 4], dtype=torch.float32, device=self.lin.bias.device))


FACTORIES = {
    "from_data": lambda: nn.ModuleDict({"blocks": nn.ModuleList([_FromData(), _FromData()])}),
    "hf_rwkv": lambda: hf_models.rwkv(n_layer=2),
    "skipped_on_meta": _SkippedOnMeta,
    "hf_vit": lambda: hf_models.vit_classifier(),
    "hf_gpt2": lambda: hf_models.gpt2(n_layer=2),
    "hf_llama": lambda: hf_models.llama(n_layer=2),
    "hf_bert_mlm": lambda: hf_models.bert_mlm(n_layer=2),
    "hf_t5": lambda: hf_models.t5(n_layer=2),
    "singlefile_gpt": lambda: make_gpt(n_layer=2, block_size=32),
    "data_swap": _DataSwap,
    "hf_convnext": lambda: hf_models.convnext_classifier(drop_path_rate=0.2),
}


def _state(m: nn.Module) -> dict[str, torch.Tensor]:
    out = dict(m.named_parameters())
    out.update(dict(m.named_buffers()))
    return out


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_exact_replay_equals_building_the_model_for_real(name):
    """Replaying every recorded operation in order under the same seed gives bit for bit what
    ``torch.manual_seed(s); factory()`` gives on CPU: Hugging Face's ``_init_weights`` (which HF
    skips under ``torch.device('meta')``, and which the recorder lets run), Conv1D's init in
    ``__init__``, rotary ``inv_freq`` buffers, ``torch.tril`` mask buffers, custom LayerNorm ones."""
    meta = build_recorded(FACTORIES[name])
    assert all(t.device.type == "meta" for t in _state(meta).values())
    torch.manual_seed(1234)
    replayed = construction_log(meta).replay(_state(meta), "cpu", exact=True)
    torch.manual_seed(1234)
    real = _state(FACTORIES[name]())
    assert set(replayed) == set(real)
    for n, t in real.items():
        assert torch.equal(replayed[n], t), n
    assert any(t.std() > 0 for n, t in real.items() if n.endswith("weight") and t.dim() == 2)  # random init ran


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_a_stage_gets_the_same_tensors_as_the_whole_model(name):
    """Materialising a subset (one stage's tensors) gives exactly those tensors' values of
    materialising everything: initial weights do not depend on P."""
    full = build_on_meta(FACTORIES[name])
    materialize(full, list(_state(full)), seed=5, device="cpu")
    part = build_on_meta(FACTORIES[name])
    names = [n for n in _state(part) if ".1." in n]  # the second block's tensors
    assert names
    materialize(part, names, seed=5, device="cpu")
    fs, ps = _state(full), _state(part)
    for n in names:
        assert torch.equal(ps[n], fs[n]), n
    assert all(ps[n].device.type == "meta" for n in ps if n not in names and not _tied(part, n, names))


def _tied(model, name, names):
    t = _state(model)[name]
    return any(_state(model)[m] is t for m in names)


def test_weights_follow_the_constructors_distributions():
    """Per-operation seeds change the draws, not what the constructor asked for: HF GPT-2's
    std 0.02 normal weights, zero biases, unit LayerNorm; the scaled ``c_proj`` init of the
    single-file GPT; Llama's exact rotary table."""
    g = build_on_meta(FACTORIES["hf_gpt2"])
    materialize(g, list(_state(g)), seed=0, device="cpu")
    s = {n: t.detach() for n, t in _state(g).items()}
    assert abs(float(s["transformer.wte.weight"].std()) - 0.02) < 0.002
    assert torch.equal(s["transformer.h.0.ln_1.weight"], torch.ones(32))
    assert torch.equal(s["transformer.h.0.attn.c_attn.bias"], torch.zeros(96))
    f = build_on_meta(FACTORIES["singlefile_gpt"])
    materialize(f, list(_state(f)), seed=0, device="cpu")
    proj = float(_state(f)["transformer.h.0.attn.c_proj.weight"].detach().std())
    assert abs(proj - 0.02 / (2 * 2) ** 0.5) < 0.003
    assert torch.equal(_state(f)["transformer.h.1.attn.bias"], torch.tril(torch.ones(32, 32)).view(1, 1, 32, 32))
    ll = build_on_meta(FACTORIES["hf_llama"])
    materialize(ll, ["model.rotary_emb.inv_freq"], seed=0, device="cpu")
    real = hf_models.llama(n_layer=2)
    assert torch.equal(_state(ll)["model.rotary_emb.inv_freq"], real.model.rotary_emb.inv_freq)


def test_a_parameter_nothing_fills_is_an_error_naming_it():
    class Careless(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.scale = nn.Parameter(torch.empty(4))          # never filled
            self.register_buffer("table", torch.empty(3, 3))   # never filled

        def forward(self, x):
            return self.fc(x) * self.scale

    m = build_on_meta(Careless)
    with pytest.raises(UninitializedError, match=r"'scale'.*'table'|'table'.*'scale'"):
        materialize(m, list(_state(m)), seed=0, device="cpu")
    m = build_on_meta(Careless)
    materialize(m, ["fc.weight", "fc.bias"], seed=0, device="cpu")  # a stage without them is fine
    assert m.fc.weight.device.type == "cpu" and m.scale.device.type == "meta"


def test_tied_weights_stay_one_tensor():
    m = build_on_meta(FACTORIES["singlefile_gpt"])
    materialize(m, list(_state(m)), seed=0, device="cpu")
    assert m.lm_head.weight is m.transformer.wte.weight


class _ReadsValues(nn.Module):
    """A constructor that reads values it computed from tensors: a drop-path schedule
    (``linspace(...).tolist()``), a depth from a sum, a scale from ``float``, a list via numpy."""

    def __init__(self):
        super().__init__()
        self.rates = torch.linspace(0, 0.3, 4).tolist()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(int(torch.tensor([2, 3]).sum())))
        self.scale = float(torch.ones(1) * 2.5)
        self.order = torch.arange(3).flip(0).numpy().tolist()
        self.first = torch.linspace(1, 2, 3)[0].item()


class _ReadsEmpty(nn.Module):
    def __init__(self):
        super().__init__()
        self.n = int(torch.empty(()))


def test_a_constructor_that_reads_values_builds_on_meta_as_for_real():
    """Values read during construction (tolist, item, float, int, numpy) are the real ones (the
    operations they depend on replayed on the CPU), so the meta model has the real model's
    structure; reading a tensor nothing filled is an error saying so."""
    meta, real = build_on_meta(_ReadsValues), _ReadsValues()
    for attr in ("rates", "scale", "order", "first"):
        assert getattr(meta, attr) == getattr(real, attr), attr
    assert len(meta.layers) == len(real.layers) == 5
    assert all(p.device.type == "meta" for p in meta.parameters())
    with pytest.raises(UninitializedError, match=r"reads the values of a \(\) torch.float32 tensor .* never filled"):
        build_on_meta(_ReadsEmpty)


def test_a_compiled_model_is_trained_as_the_module_it_wraps():
    """A factory returning ``torch.compile(model)``: the module itself is built (parameter names
    without ``_orig_mod.``), with a warning saying so, and its weights replay as the module's own."""
    with pytest.warns(UserWarning, match=r"returned torch.compile\(Sequential\); the pipeline trains the module"):
        meta = build_recorded(lambda: torch.compile(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))))
    assert isinstance(meta, nn.Sequential) and sorted(_state(meta)) == ["0.bias", "0.weight", "1.bias", "1.weight"]
    torch.manual_seed(7)
    replayed = construction_log(meta).replay(_state(meta), "cpu", exact=True)
    torch.manual_seed(7)
    real = _state(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)))
    assert all(torch.equal(replayed[n], t) for n, t in real.items())
