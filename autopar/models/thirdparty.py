"""Third-party-style models, written the way public model hubs (Hugging Face transformers) write them,
to exercise capture: plain ``torch.fx.symbolic_trace`` fails on them, ``torch.export`` succeeds.

What makes them hard for fx, on purpose (each is common in hub code):
- ``forward(input_ids=None, attention_mask=None, labels=None, ..., return_dict=None)``: keyword
  arguments with defaults, argument checks (``if input_ids is not None and inputs_embeds is not None``),
  config-driven control flow (``return_dict``, ``output_hidden_states``, ``pretraining_tp``).
- shape-dependent control flow on cached buffers: ``if seq_len > self.cached_len:`` regrows a causal
  mask (``HFGPTForCausalLM``) or a rotary cos/sin cache (``HFLlamaRotaryEmbedding``), then slices it.
- layers take extra inputs (the attention mask, position ids) and return tuples.
- the output is a dict ``{"loss", "logits", ...}`` (pytree-friendly, like ``ModelOutput``); the loss
  is computed inside from ``labels`` (shifted by one position), so ``ModelCase.loss_fn`` is ``None``
  and the example inputs are ``(input_ids, attention_mask, labels)``.

The blocks still live in one ``nn.ModuleList`` named ``layers``; heads are counted in ``num_heads``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from autopar.models import gpt, llama
from autopar.models.case import ModelCase, ModelZooError, check_positive, example_inputs_from, instantiate
from autopar.models.data import hf_lm_batch

__all__ = ["HFGPTConfig", "HFGPTForCausalLM", "HFLlamaConfig", "HFLlamaForCausalLM", "PRESETS", "make_case"]

ACT2FN = {"gelu": nn.GELU, "gelu_new": partial(nn.GELU, approximate="tanh"), "relu": nn.ReLU, "silu": nn.SiLU}


@dataclass(frozen=True, kw_only=True, slots=True)
class HFGPTConfig:
    vocab_size: int = 256
    n_positions: int = 32
    n_embd: int = 64
    n_layer: int = 4
    n_head: int = 4
    activation_function: str = "gelu_new"
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02
    scale_attn_weights: bool = True
    tie_word_embeddings: bool = True
    use_return_dict: bool = True
    output_hidden_states: bool = False

    def __post_init__(self):
        check_positive(self, "vocab_size", "n_positions", "n_embd", "n_layer", "n_head")
        if self.n_embd % self.n_head:
            raise ModelZooError(f"HFGPTConfig.n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if self.activation_function not in ACT2FN:
            raise ModelZooError(f"HFGPTConfig.activation_function={self.activation_function!r}: one of {sorted(ACT2FN)}")


@dataclass(frozen=True, kw_only=True, slots=True)
class HFLlamaConfig:
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 172
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int | None = None     # grouped-query attention (None: num_attention_heads)
    max_position_embeddings: int = 32
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    initializer_range: float = 0.02
    pretraining_tp: int = 1
    tie_word_embeddings: bool = False
    use_return_dict: bool = True
    output_hidden_states: bool = False

    def __post_init__(self):
        check_positive(self, "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                       "num_attention_heads", "max_position_embeddings", "pretraining_tp")
        if self.hidden_size % self.num_attention_heads:
            raise ModelZooError(f"HFLlamaConfig.hidden_size={self.hidden_size} must be divisible by "
                             f"num_attention_heads={self.num_attention_heads}")
        if self.num_key_value_heads is not None:
            check_positive(self, "num_key_value_heads")
            if self.num_attention_heads % self.num_key_value_heads:
                raise ModelZooError(f"HFLlamaConfig.num_key_value_heads={self.num_key_value_heads} must divide "
                                    f"num_attention_heads={self.num_attention_heads}")
        if self.hidden_act not in ACT2FN:
            raise ModelZooError(f"HFLlamaConfig.hidden_act={self.hidden_act!r}: one of {sorted(ACT2FN)}")


PRESETS = {"hf-gpt-tiny": HFGPTConfig(), "hf-llama-tiny": HFLlamaConfig(),
           "hf-llama-gqa-tiny": HFLlamaConfig(num_key_value_heads=2)}


def _causal_lm_output(config, logits, labels, hidden_states, return_dict):
    loss = None
    if labels is not None:
        shift_logits = logits[..., :-1, :].contiguous()
        shift_labels = labels[..., 1:].contiguous()
        loss = F.cross_entropy(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1))
    if not return_dict:
        output = (logits,) + ((hidden_states,) if hidden_states is not None else ())
        return ((loss,) + output) if loss is not None else output
    output = {"loss": loss, "logits": logits, "hidden_states": hidden_states}
    return {k: v for k, v in output.items() if v is not None}


def _padding_bias(attention_mask, batch_size, dtype):
    """(B, T) of 1 (keep) / 0 (pad) -> additive (B, 1, 1, T) bias."""
    mask = attention_mask.view(batch_size, -1)[:, None, None, :].to(dtype)
    return (1.0 - mask) * torch.finfo(dtype).min


# ---------------------------------------------------------------------------------------------- GPT-2


class HFGPTAttention(nn.Module):
    def __init__(self, config: HFGPTConfig, layer_idx: int | None = None):
        super().__init__()
        self.config = config
        self.embed_dim = config.n_embd
        self.num_heads = config.n_head
        self.head_dim = self.embed_dim // self.num_heads
        self.layer_idx = layer_idx
        self.c_attn = nn.Linear(self.embed_dim, 3 * self.embed_dim)
        self.c_proj = nn.Linear(self.embed_dim, self.embed_dim)

    def _split_heads(self, tensor, num_heads, head_dim):
        new_shape = tensor.size()[:-1] + (num_heads, head_dim)
        return tensor.view(new_shape).permute(0, 2, 1, 3)

    def _merge_heads(self, tensor, num_heads, head_dim):
        tensor = tensor.permute(0, 2, 1, 3).contiguous()
        return tensor.view(tensor.size()[:-2] + (num_heads * head_dim,))

    def _attn(self, query, key, value, attention_mask=None):
        attn_weights = torch.matmul(query, key.transpose(-1, -2))
        if self.config.scale_attn_weights:
            attn_weights = attn_weights / math.sqrt(value.size(-1))
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1)
        return torch.matmul(attn_weights, value), attn_weights

    def forward(self, hidden_states, attention_mask=None, output_attentions=False):
        query, key, value = self.c_attn(hidden_states).split(self.embed_dim, dim=2)
        query = self._split_heads(query, self.num_heads, self.head_dim)
        key = self._split_heads(key, self.num_heads, self.head_dim)
        value = self._split_heads(value, self.num_heads, self.head_dim)
        attn_output, attn_weights = self._attn(query, key, value, attention_mask)
        attn_output = self.c_proj(self._merge_heads(attn_output, self.num_heads, self.head_dim))
        return (attn_output, attn_weights) if output_attentions else (attn_output,)


class HFGPTMLP(nn.Module):
    def __init__(self, intermediate_size: int, config: HFGPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, intermediate_size)
        self.c_proj = nn.Linear(intermediate_size, config.n_embd)
        self.act = ACT2FN[config.activation_function]()

    def forward(self, hidden_states):
        return self.c_proj(self.act(self.c_fc(hidden_states)))


class HFGPTBlock(nn.Module):
    def __init__(self, config: HFGPTConfig, layer_idx: int | None = None):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = HFGPTAttention(config, layer_idx=layer_idx)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = HFGPTMLP(4 * config.n_embd, config)

    def forward(self, hidden_states, attention_mask=None, output_attentions=False):
        attn_outputs = self.attn(self.ln_1(hidden_states), attention_mask=attention_mask,
                                 output_attentions=output_attentions)
        hidden_states = attn_outputs[0] + hidden_states
        hidden_states = hidden_states + self.mlp(self.ln_2(hidden_states))
        return (hidden_states,) + attn_outputs[1:]


class HFGPTForCausalLM(nn.Module):
    def __init__(self, config: HFGPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.layers = nn.ModuleList(HFGPTBlock(config, layer_idx=i) for i in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.wte.weight
        self.cached_len = 0
        self._update_causal_mask(config.n_positions, self.wte.weight.device)
        self.post_init()

    def post_init(self):
        if self.wte.weight.is_meta:
            return
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.data.normal_(mean=0.0, std=self.config.initializer_range)
            if isinstance(module, nn.Linear) and module.bias is not None:
                module.bias.data.zero_()

    def reset_parameters(self) -> None:
        """What this module holds itself, as ``__init__`` sets it: the causal mask of ``n_positions``
        (its submodules have their own ``reset_parameters``)."""
        self._update_causal_mask(self.config.n_positions, self.causal_mask.device)

    def _update_causal_mask(self, length, device):
        mask = torch.tril(torch.ones(length, length, dtype=torch.bool, device=device))
        self.register_buffer("causal_mask", mask.view(1, 1, length, length), persistent=False)
        self.cached_len = length

    def forward(self, input_ids=None, attention_mask=None, labels=None, position_ids=None, inputs_embeds=None,
                output_attentions=None, output_hidden_states=None, return_dict=None):
        output_hidden_states = (output_hidden_states if output_hidden_states is not None
                                else self.config.output_hidden_states)
        return_dict = return_dict if return_dict is not None else self.config.use_return_dict
        if input_ids is None and inputs_embeds is None:
            raise ValueError("You have to specify either input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.wte(input_ids)
        batch_size, seq_len = inputs_embeds.shape[:2]
        if position_ids is None:
            position_ids = torch.arange(seq_len, dtype=torch.long, device=inputs_embeds.device).unsqueeze(0)
        hidden_states = inputs_embeds + self.wpe(position_ids)

        if seq_len > self.cached_len:  # a longer sequence than seen so far: regrow the cached mask
            self._update_causal_mask(seq_len, hidden_states.device)
        dtype = hidden_states.dtype
        causal = self.causal_mask[:, :, :seq_len, :seq_len]
        bias = torch.zeros(causal.shape, dtype=dtype, device=hidden_states.device).masked_fill(
            ~causal, torch.finfo(dtype).min)
        if attention_mask is not None:
            bias = torch.clamp(bias + _padding_bias(attention_mask, batch_size, dtype), min=torch.finfo(dtype).min)

        all_hidden_states = () if output_hidden_states else None
        for block in self.layers:
            if output_hidden_states:
                all_hidden_states = all_hidden_states + (hidden_states,)
            outputs = block(hidden_states, attention_mask=bias, output_attentions=bool(output_attentions))
            hidden_states = outputs[0]
        hidden_states = self.ln_f(hidden_states)
        if output_hidden_states:
            all_hidden_states = all_hidden_states + (hidden_states,)
        logits = self.lm_head(hidden_states)
        return _causal_lm_output(self.config, logits, labels, all_hidden_states, return_dict)


# ---------------------------------------------------------------------------------------------- Llama


class HFLlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class HFLlamaRotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings=2048, base=10000.0, device=None):
        super().__init__()
        self.dim = dim
        self.base = base
        self.max_position_embeddings = max_position_embeddings
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, device=device).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._set_cos_sin_cache(max_position_embeddings, device=device, dtype=torch.get_default_dtype())

    def reset_parameters(self) -> None:
        """The tables as ``__init__`` computes them (``max_position_embeddings`` long), on the buffers'
        device and in the tables' dtype."""
        device = self.inv_freq.device
        self.inv_freq.copy_(1.0 / (self.base ** (torch.arange(0, self.dim, 2, device=device).float() / self.dim)))
        self._set_cos_sin_cache(self.max_position_embeddings, device=device, dtype=self.cos_cached.dtype)

    def _set_cos_sin_cache(self, seq_len, device, dtype):
        self.max_seq_len_cached = seq_len
        t = torch.arange(seq_len, device=device, dtype=self.inv_freq.dtype)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin_cached", emb.sin().to(dtype), persistent=False)

    def forward(self, x, seq_len=None):
        if seq_len > self.max_seq_len_cached:
            self._set_cos_sin_cache(seq_len=seq_len, device=x.device, dtype=x.dtype)
        return self.cos_cached[:seq_len].to(dtype=x.dtype), self.sin_cached[:seq_len].to(dtype=x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids):
    cos = cos[position_ids].unsqueeze(1)  # (B, 1, T, head_dim)
    sin = sin[position_ids].unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def repeat_kv(hidden_states, n_rep: int):
    """(B, kv heads, T, head_dim) -> (B, kv heads * n_rep, T, head_dim), each key/value head repeated
    for the query heads of its group."""
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class HFLlamaAttention(nn.Module):
    def __init__(self, config: HFLlamaConfig, layer_idx: int | None = None):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads or config.num_attention_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)
        self.rotary_emb = HFLlamaRotaryEmbedding(self.head_dim, config.max_position_embeddings,
                                                 base=config.rope_theta)

    def forward(self, hidden_states, attention_mask=None, position_ids=None):
        bsz, q_len, _ = hidden_states.size()
        query = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key = self.k_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        value = self.v_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary_emb(value, seq_len=q_len)
        query, key = apply_rotary_pos_emb(query, key, cos, sin, position_ids)
        key = repeat_kv(key, self.num_key_value_groups)
        value = repeat_kv(value, self.num_key_value_groups)
        attn_output = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask)
        attn_output = attn_output.transpose(1, 2).contiguous().reshape(bsz, q_len, self.hidden_size)
        return self.o_proj(attn_output)


class HFLlamaMLP(nn.Module):
    def __init__(self, config: HFLlamaConfig):
        super().__init__()
        self.config = config
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]()

    def forward(self, x):
        if self.config.pretraining_tp > 1:  # reproduce a tensor-parallel pretraining's matmul split
            slice_size = self.config.intermediate_size // self.config.pretraining_tp
            gate_slices = self.gate_proj.weight.split(slice_size, dim=0)
            up_slices = self.up_proj.weight.split(slice_size, dim=0)
            down_slices = self.down_proj.weight.split(slice_size, dim=1)
            gate = torch.cat([F.linear(x, w) for w in gate_slices], dim=-1)
            up = torch.cat([F.linear(x, w) for w in up_slices], dim=-1)
            inter = (self.act_fn(gate) * up).split(slice_size, dim=-1)
            return sum(F.linear(inter[i], down_slices[i]) for i in range(self.config.pretraining_tp))
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class HFLlamaDecoderLayer(nn.Module):
    def __init__(self, config: HFLlamaConfig, layer_idx: int):
        super().__init__()
        self.self_attn = HFLlamaAttention(config, layer_idx)
        self.mlp = HFLlamaMLP(config)
        self.input_layernorm = HFLlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = HFLlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, **kwargs):
        residual = hidden_states
        hidden_states = self.self_attn(self.input_layernorm(hidden_states), attention_mask=attention_mask,
                                       position_ids=position_ids)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = residual + self.mlp(self.post_attention_layernorm(hidden_states))
        return (hidden_states,)


class HFLlamaForCausalLM(nn.Module):
    def __init__(self, config: HFLlamaConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(HFLlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = HFLlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        if not self.embed_tokens.weight.is_meta:
            for module in self.modules():
                if isinstance(module, (nn.Linear, nn.Embedding)):
                    module.weight.data.normal_(mean=0.0, std=config.initializer_range)

    def _prepare_decoder_attention_mask(self, attention_mask, input_shape, dtype, device):
        bsz, tgt_len = input_shape
        mask = torch.full((tgt_len, tgt_len), torch.finfo(dtype).min, device=device)
        mask_cond = torch.arange(mask.size(-1), device=device)
        mask.masked_fill_(mask_cond < (mask_cond + 1).view(mask.size(-1), 1), 0)
        causal = mask.to(dtype)[None, None, :, :].expand(bsz, 1, tgt_len, tgt_len)
        if attention_mask is None:
            return causal
        return torch.clamp(causal + _padding_bias(attention_mask, bsz, dtype), min=torch.finfo(dtype).min)

    def forward(self, input_ids=None, attention_mask=None, labels=None, position_ids=None, inputs_embeds=None,
                output_hidden_states=None, return_dict=None, **kwargs):
        output_hidden_states = (output_hidden_states if output_hidden_states is not None
                                else self.config.output_hidden_states)
        return_dict = return_dict if return_dict is not None else self.config.use_return_dict
        if input_ids is None and inputs_embeds is None:
            raise ValueError("You have to specify either input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        batch_size, seq_length = inputs_embeds.shape[:2]
        if position_ids is None:
            position_ids = torch.arange(seq_length, dtype=torch.long, device=inputs_embeds.device)
            position_ids = position_ids.unsqueeze(0).expand(batch_size, seq_length)
        hidden_states = inputs_embeds
        mask = self._prepare_decoder_attention_mask(attention_mask, (batch_size, seq_length),
                                                    hidden_states.dtype, hidden_states.device)
        all_hidden_states = () if output_hidden_states else None
        for decoder_layer in self.layers:
            if output_hidden_states:
                all_hidden_states += (hidden_states,)
            hidden_states = decoder_layer(hidden_states, attention_mask=mask, position_ids=position_ids)[0]
        hidden_states = self.norm(hidden_states)
        if output_hidden_states:
            all_hidden_states += (hidden_states,)
        logits = self.lm_head(hidden_states).float()
        return _causal_lm_output(self.config, logits, labels, all_hidden_states, return_dict)


# ---------------------------------------------------------------------------------------------- zoo


def _as_zoo_config(config):
    """The equivalent zoo config, whose closed-form parameter and FLOP counts apply unchanged."""
    if isinstance(config, HFGPTConfig):
        return gpt, gpt.GPTConfig(num_layers=config.n_layer, hidden_size=config.n_embd, num_heads=config.n_head,
                                  vocab_size=config.vocab_size, seq_len=config.n_positions,
                                  tie_embeddings=config.tie_word_embeddings)
    cfg = llama.LlamaConfig(num_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
                            num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
                            ffn_hidden_size=config.intermediate_size,
                            vocab_size=config.vocab_size, seq_len=config.max_position_embeddings)
    return llama, cfg


def make_case(name: str, config, *, device: str | torch.device = "cpu", seed: int = 0) -> ModelCase:
    family, zoo_cfg = _as_zoo_config(config)
    params = family.num_params(zoo_cfg)
    if isinstance(config, HFLlamaConfig) and config.tie_word_embeddings:
        params -= config.vocab_size * config.hidden_size
    model_cls = HFGPTForCausalLM if isinstance(config, HFGPTConfig) else HFLlamaForCausalLM
    make_batch = partial(hf_lm_batch, seq_len=zoo_cfg.seq_len, vocab_size=zoo_cfg.vocab_size)
    return ModelCase(name=name, model=instantiate(partial(model_cls, config), device=device, seed=seed),
                     example_inputs=example_inputs_from(make_batch, device=device, seed=seed), loss_fn=None,
                     config=config, num_params_expected=params,
                     fwd_flops_per_sample_expected=family.fwd_flops_per_sample(zoo_cfg), make_batch=make_batch)
