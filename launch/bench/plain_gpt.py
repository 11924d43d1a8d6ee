"""A GPT written as a newcomer writes one in plain torch (nanoGPT's shape), for benchmarks that must not
measure on the project's own model: learned positions, pre-norm blocks, explicit attention (matmul,
causal mask, softmax), GELU MLP, the head tied to the token embedding. Nothing here knows about
parallelism; the systems under test wrap it from outside."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int, length: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.register_buffer("mask", torch.ones(length, length, dtype=torch.bool).tril(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2)
                   for t in self.qkv(x).split(width, dim=2))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(k.shape[-1])
        scores = scores.masked_fill(~self.mask[:length, :length], float("-inf"))
        y = F.softmax(scores, dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(batch, length, width))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, length: int):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(width), CausalSelfAttention(width, heads, length)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class PlainGPT(nn.Module):
    """``model(tokens, targets)`` returns the mean next-token cross entropy (tokens: batch x length)."""

    def __init__(self, vocab: int, width: int, layers: int, heads: int, length: int, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(length, width)
        self.blocks = nn.ModuleList(Block(width, heads, length) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.wte.weight
        for name, param in self.named_parameters():
            if name.endswith("weight") and param.dim() == 2:
                nn.init.normal_(param, std=0.02)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))
