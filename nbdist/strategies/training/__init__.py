"""Rank side: training pieces that are no distributed strategy themselves and combine with any.

- ``amp``: mixed precision (the autocast dtype and gradient scaler that suit a device);
- ``compile``: ``torch.compile`` on every rank, and a fair eager-vs-compiled timer;
- ``sparse_attention``: attention over a pattern of keys (sliding window, block masks);
- ``evaluation``: distributed evaluation that returns exactly the single-process numbers;
- ``practical``: everyday chores (one-time data preparation, rank-0-only work).

Each is imported on its own (``from nbdist.strategies.training.amp import autocast``).
"""

__all__: list[str] = []
