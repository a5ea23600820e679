"""Hugging Face ``transformers`` models as a user builds them for a small experiment: from a
config, random weights, nothing downloaded. Import-path factories for the tests
(``tests.thirdparty.hf_models:gpt2``)."""

import torch
import transformers

transformers.logging.set_verbosity_error()


def gpt2(n_layer: int = 3, n_embd: int = 32, n_head: int = 2, vocab_size: int = 256, n_positions: int = 64,
         dropout: float = 0.0, frozen: tuple[str, ...] = (), unused_head: bool = False):
    """``GPT2LMHeadModel`` (``Conv1D`` layers, tied embeddings, learned positions); the parameters
    named in ``frozen`` get ``requires_grad=False``, as a user freezes layers for fine-tuning;
    ``unused_head`` adds a ``value_head`` (``nn.Linear``) the forward never calls, as a user keeps a
    head for a later task: plain PyTorch leaves its gradient ``None`` and AdamW skips it."""
    cfg = transformers.GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab_size,
                                  n_positions=n_positions, resid_pdrop=dropout, embd_pdrop=dropout,
                                  attn_pdrop=dropout)
    model = transformers.GPT2LMHeadModel(cfg)
    for name in frozen:
        model.get_parameter(name).requires_grad_(False)
    if unused_head:
        model.value_head = torch.nn.Linear(n_embd, 1)
    return model


def llama(n_layer: int = 3, hidden: int = 32, heads: int = 4, kv_heads: int = 2, vocab_size: int = 256,
          max_positions: int = 64):
    """``LlamaForCausalLM`` (rotary embeddings with an ``inv_freq`` buffer, RMSNorm, grouped-query
    attention, untied head)."""
    cfg = transformers.LlamaConfig(num_hidden_layers=n_layer, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab_size,
                                   max_position_embeddings=max_positions)
    return transformers.LlamaForCausalLM(cfg)


def rwkv(n_layer: int = 2, hidden: int = 32, vocab_size: int = 256, context: int = 64):
    """``RwkvForCausalLM`` (no attention: time-mixing recurrences whose ``time_decay``/``time_mix_*``
    weights its ``_init_weights`` makes from Python lists, ``torch.tensor([...], device=p.device)``,
    and orthogonal projections)."""
    cfg = transformers.RwkvConfig(vocab_size=vocab_size, context_length=context, hidden_size=hidden,
                                  num_hidden_layers=n_layer, attention_hidden_size=hidden, intermediate_size=2 * hidden)
    return transformers.RwkvForCausalLM(cfg)


def mixtral(n_layer: int = 2, hidden: int = 32, experts: int = 4, vocab_size: int = 256, max_positions: int = 64):
    """``MixtralForCausalLM``: a mixture of experts (top-2 of ``experts`` per token) whose experts run
    as one ``torch._grouped_mm`` over the tokens sorted by expert (transformers' default kernel)."""
    cfg = transformers.MixtralConfig(num_hidden_layers=n_layer, hidden_size=hidden, intermediate_size=2 * hidden,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=experts,
                                     num_experts_per_tok=2, vocab_size=vocab_size,
                                     max_position_embeddings=max_positions)
    return transformers.MixtralForCausalLM(cfg)


def t5(n_layer: int = 3, d_model: int = 32, vocab_size: int = 256):
    """``T5ForConditionalGeneration`` (encoder-decoder; relative position bias computed by the first
    layer from its own weights and handed, with the hidden state, to every later layer — across
    cut-points; ``labels=`` make the decoder inputs)."""
    cfg = transformers.T5Config(vocab_size=vocab_size, d_model=d_model, d_kv=8, d_ff=2 * d_model, num_layers=n_layer,
                                num_heads=4, dropout_rate=0.0, decoder_start_token_id=0)
    return transformers.T5ForConditionalGeneration(cfg)


def bart(n_layer: int = 2, d_model: int = 32, vocab_size: int = 256):
    """``BartForConditionalGeneration`` (encoder-decoder, both stacks cut: the decoder's blocks get the
    encoder's output as an argument; learned positions with an offset of 2; ``labels=`` shifted into
    the decoder inputs)."""
    cfg = transformers.BartConfig(vocab_size=vocab_size, d_model=d_model, encoder_layers=n_layer, decoder_layers=n_layer,
                                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=2 * d_model,
                                  decoder_ffn_dim=2 * d_model, max_position_embeddings=64, dropout=0.0,
                                  attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1, bos_token_id=0,
                                  eos_token_id=2, decoder_start_token_id=2)
    return transformers.BartForConditionalGeneration(cfg)


def bert_mlm(n_layer: int = 3, hidden: int = 32, vocab_size: int = 256, max_positions: int = 64):
    """``BertForMaskedLM`` (its LM head's bias is tied to the decoder's and padded in place by
    ``post_init`` — ``bias.data = pad(bias)``; token-type ids and position ids are buffers)."""
    cfg = transformers.BertConfig(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=n_layer,
                                  num_attention_heads=4, intermediate_size=2 * hidden,
                                  max_position_embeddings=max_positions, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    return transformers.BertForMaskedLM(cfg)


def albert_mlm(n_layer: int = 4, hidden: int = 32, vocab_size: int = 256, max_positions: int = 64):
    """``AlbertForMaskedLM``: one layer group (a ``ModuleList`` of length 1) called at every depth,
    its weights shared by every stage; factorised embeddings (``embedding_size`` < hidden)."""
    cfg = transformers.AlbertConfig(vocab_size=vocab_size, embedding_size=16, hidden_size=hidden,
                                    num_hidden_layers=n_layer, num_attention_heads=4, intermediate_size=2 * hidden,
                                    max_position_embeddings=max_positions, hidden_dropout_prob=0.0,
                                    attention_probs_dropout_prob=0.0)
    return transformers.AlbertForMaskedLM(cfg)


def deberta_v2(n_layer: int = 3, hidden: int = 32, vocab_size: int = 256, max_positions: int = 64):
    """``DebertaV2ForMaskedLM`` (disentangled attention: the relative position embeddings are
    weights of the encoder, used by every layer — across cut-points — beside the hidden state)."""
    cfg = transformers.DebertaV2Config(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=n_layer,
                                       num_attention_heads=4, intermediate_size=2 * hidden,
                                       max_position_embeddings=max_positions, hidden_dropout_prob=0.0,
                                       attention_probs_dropout_prob=0.0, relative_attention=True,
                                       position_buckets=16, max_relative_positions=32, pos_att_type=["p2c", "c2p"])
    return transformers.DebertaV2ForMaskedLM(cfg)


def bert_classifier(n_layer: int = 2, hidden: int = 32, num_labels: int = 1, vocab_size: int = 256,
                    max_positions: int = 64):
    """``BertForSequenceClassification``: its forward takes ``labels=`` and computes its own loss —
    cross-entropy, or with ``num_labels=1`` a regression's mean squared error."""
    cfg = transformers.BertConfig(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=n_layer,
                                  num_attention_heads=4, intermediate_size=2 * hidden,
                                  max_position_embeddings=max_positions, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, num_labels=num_labels)
    return transformers.BertForSequenceClassification(cfg)


def convnext_classifier(depths: tuple = (1, 1, 2), hidden: tuple = (8, 16, 32), num_labels: int = 4,
                        drop_path_rate: float = 0.0):
    """``ConvNextForImageClassification``: its constructor reads the values of a tensor it made
    (``torch.linspace(0, drop_path_rate, sum(depths)).tolist()``), as Swin, PVT, Hiera... do."""
    cfg = transformers.ConvNextConfig(num_channels=3, depths=list(depths), hidden_sizes=list(hidden),
                                      num_stages=len(depths), patch_size=2, num_labels=num_labels,
                                      drop_path_rate=drop_path_rate, image_size=16)
    return transformers.ConvNextForImageClassification(cfg)


def vit_classifier(n_layer: int = 2, hidden: int = 32, num_labels: int = 4):
    """``ViTForImageClassification``: its class token and position embeddings are initialised by
    ``trunc_normal_``, which torch skips for a meta tensor (the initialisation must be recorded)."""
    cfg = transformers.ViTConfig(hidden_size=hidden, num_hidden_layers=n_layer, num_attention_heads=4,
                                 intermediate_size=2 * hidden, image_size=16, patch_size=4, num_labels=num_labels)
    return transformers.ViTForImageClassification(cfg)


class MyLlama(transformers.LlamaForCausalLM):
    """A user's subclass of a causal LM (its own name says nothing of it)."""


def my_llama(n_layer: int = 2):
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=n_layer,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return MyLlama(cfg)
