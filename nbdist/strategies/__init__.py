"""Rank side: one small module per parallel strategy, each importable with torch alone.

Each module holds a short ``apply_*`` function, context manager or ``nn.Module``
that the matching notebook in ``examples/`` uses, e.g.
``from nbdist.strategies.syncbn import SyncBatchNorm``. Nothing here imports
IPython, ipyparallel or the dashboard: the code runs on the ranks.
"""
