"""Rank side: what runs on each rank (an ipyparallel engine, or a ``torchrun`` process).

Joining and re-joining the group (``bootstrap``), answering control requests
while busy (``control``), the collectives wrapper, network interfaces, the
helpers user code calls (``helpers``: ``rank()``, ``device()``...), devices,
and ``standalone`` for exported scripts. Imports torch and the standard library
only: nothing from :mod:`nbdist.driver` or :mod:`nbdist.launch`, and never IPython.
"""
