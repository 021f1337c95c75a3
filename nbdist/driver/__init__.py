"""Kernel side: the driver of a session, what runs in the notebook's kernel.

The session and its process group, cells and their output, faults, where,
status, export, and the registry of running clusters. Imported only in the
kernel (never on a rank); the public names are re-exported by :mod:`nbdist`.
"""
