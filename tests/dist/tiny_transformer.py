"""The tiny transformer block (and token + position embedding) the 2D/3D, sequence/context-parallel
and auto-parallel tests train.

Source text, not a module of classes: each test runs it on the ranks (``session.run``)
and ``exec``s it in the test process, so both build the same model. Imported by its
plain name: pytest puts this directory (which has no ``__init__.py``) on ``sys.path``.
"""

TRANSFORMER_BLOCKS = """
import torch
import torch.nn.functional as F
from torch import nn

class Attention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.hd = d // heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
    def forward(self, x):
        B, T, _ = x.shape
        # -1 heads: under tensor parallel each rank holds heads / tp of them.
        q, k, v = (l(x).view(B, T, -1, self.hd).transpose(1, 2) for l in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))

class MLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
    def forward(self, x):
        return self.down(F.gelu(self.up(x)))

class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(d), Attention(d, heads)
        self.norm2, self.mlp = nn.LayerNorm(d), MLP(d)
    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))

class Embed(nn.Module):
    def __init__(self, vocab, d, t):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(t, d)
    def forward(self, idx):
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
"""
