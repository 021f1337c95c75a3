"""Rank side: code written to be read: what DDP and its collectives do, by hand.

- ``data_parallel_by_hand``: split a batch, broadcast a model, all-reduce gradients via
  rank 0 and over a ring, with plain ``torch.distributed`` point-to-point calls.
"""

__all__: list[str] = []
