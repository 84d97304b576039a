"""A small GPT-style language model built from ``torch.nn`` only: the built-in "transformer".

Teaches: what a real model hands DDP. An MLP gives a few large weight matrices; a
transformer gives many tensors of very different sizes (token and position
embeddings, two LayerNorms per block, attention and MLP weights and their biases),
and, when the output layer shares the token embedding's weight ("tied weights"),
one parameter that is used twice in a step but all-reduced once. Bucket
boundaries then fall in the middle of blocks, which is what a user's own model
looks like in ``Reducer`` terms.

Each rank's batch is a random sequence of token ids with the next-token targets
(the sequence shifted by one), drawn from a seed that includes the rank.

Leaves out: dropout, a tokenizer, real text, flash attention, KV caches.
References: Radford et al., "Language Models are Unsupervised Multitask
Learners" (GPT-2), 2019; torch.nn.MultiheadAttention.
"""
from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    """Pre-norm block: x + attn(ln1(x)); x + mlp(ln2(x)), causal attention."""

    def __init__(self, d_model: int, n_head: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = nn.MultiheadAttention(d_model, n_head, batch_first=True)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                 nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        t = x.shape[1]
        # True above the diagonal: a token never attends to later tokens
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Token + position embeddings, ``n_layer`` blocks, a final LayerNorm, a vocabulary head."""

    def __init__(self, vocab: int = 512, seq_len: int = 64, d_model: int = 128,
                 n_layer: int = 4, n_head: int = 4, tied: bool = True):
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"d_model ({d_model}) must be a multiple of n_head ({n_head})")
        self.seq_len = seq_len
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        if tied:  # one Parameter in two places: DDP reduces it once
            self.head.weight = self.tok.weight

    def forward(self, ids):
        if ids.shape[1] > self.seq_len:
            raise ValueError(f"sequence of {ids.shape[1]} tokens is longer than seq_len={self.seq_len}")
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.tok(ids) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # (batch, tokens, vocab) logits


def batch(batch_size: int, rank: int, step: int, vocab: int = 512, seq_len: int = 64,
          seed: int = 1234):
    """(token ids, next-token targets), both (batch_size, seq_len) int64, this rank's own."""
    g = torch.Generator().manual_seed(seed + 100003 * step + rank)
    ids = torch.randint(0, vocab, (batch_size, seq_len + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]
