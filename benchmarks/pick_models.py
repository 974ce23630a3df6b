"""Models the planner has no table or test for, as ``autopar train --model pick_models:NAME`` takes them
(``benchmarks/bench_pick.py``): a Hugging Face GPT-2 of 3.3M parameters and a Hugging Face Llama of
11.5M, built from configs, and a 50.7M-parameter residual GLU MLP written as a user would."""

import torch
import torch.nn.functional as F
from torch import nn
import transformers as tf

from _blocks import GluBlock   # pre-norm residual SwiGLU block (this folder is on the path)


def gpt2s():
    """Hugging Face GPT-2, 4 layers, hidden 224, 8 heads, vocabulary 4,096: 3.3M parameters."""
    torch.manual_seed(0)
    m = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=4096, n_embd=224, n_layer=4, n_head=8, n_positions=64,
                                         bos_token_id=0, eos_token_id=0, use_cache=False))
    m.config._attn_implementation = "sdpa"
    return m


def llama11():
    """Hugging Face Llama, 4 layers, hidden 256, 8 query / 4 key-value heads, intermediate 2,816: 11.5M."""
    torch.manual_seed(0)
    m = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=4096, hidden_size=256, num_hidden_layers=4,
                                           num_attention_heads=8, num_key_value_heads=4, intermediate_size=2816,
                                           max_position_embeddings=64, use_cache=False))
    m.config._attn_implementation = "sdpa"
    return m


class GluNet(nn.Module):
    def __init__(self, d=1024, h=2730, n=6):
        super().__init__()
        self.inp = nn.Linear(256, d)
        self.layers = nn.ModuleList(GluBlock(d, h) for _ in range(n))
        self.out = nn.Linear(d, 64)

    def forward(self, x):
        x = self.inp(x)
        for b in self.layers:
            x = b(x)
        return self.out(x)


def glu50():
    """Six pre-norm residual GLU blocks of width 1,024 (hidden 2,730), MSE loss: 50.7M parameters."""
    torch.manual_seed(0)
    return GluNet(), (torch.randn(8, 256),), F.mse_loss


def num_params(name: str) -> int:
    made = globals()[name]()
    model = made[0] if isinstance(made, tuple) else made
    return sum(p.numel() for p in model.parameters())
