"""Rank side: choose, build and compare parallel layouts for one model.

- ``autoplan``: enumerate every layout for the world size, estimate each, measure the best
  few, apply the fastest (``autoplan``);
- ``estimate``: which layouts a model admits and the memory and traffic each should cost;
- ``build``: one layout (``Plan``) made on the ranks (``build_plan``), through
  :func:`~nbdist.strategies.parallel.parallelize.parallelize`;
- ``compare``: train one model under DDP, ZeRO, FSDP2, tensor, pipeline, 2D/3D and
  compressed strategies, and measure each (``compare``, ``measure_steps``).

``autoplan`` and ``compare`` are also reachable as ``nbdist.strategies.autoplan`` and
``nbdist.strategies.compare``.
"""

__all__: list[str] = []
