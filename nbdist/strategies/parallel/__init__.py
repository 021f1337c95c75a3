"""Rank side: ways of spreading a model over ranks, one module each, composed by ``parallelize``.

- ``fsdp``: fully sharded data parallel (FSDP2, ``apply_fsdp``);
- ``zero``: ZeRO stage 1 (optimizer state sharded, ``zero_optimizer``);
- ``deepspeed_zero``: DeepSpeed ZeRO 1/2/3 (``apply_deepspeed``);
- ``horovod``: Horovod's API, real or emulated over ``torch.distributed``;
- ``accumulation``: gradient accumulation under DDP (``no_sync`` on all but the last micro-batch);
- ``syncbn``: synchronised BatchNorm;
- ``tensor_parallel``: Megatron-style tensor parallel with DTensor (``apply_tp``, ``device_mesh``);
- ``sequence_parallel``: tensor parallel that also splits the sequence;
- ``context_parallel``: attention over a sequence split across ranks (ring attention);
- ``pipeline``: pipeline parallel (``pipeline_schedule``, ``split_sequential``);
- ``checkpointing``: activation checkpointing (``apply_ac``);
- ``mesh``: ``ParallelDims``, the validated ``dp × tp × pp`` layout and its ``DeviceMesh``,
  and the 2D/3D helpers ``apply_fsdp_tp``, ``apply_fsdp_tp_pp``;
- ``parallelize``: ``parallelize(model, dims, ...)``, tensor parallel → activation
  checkpointing → FSDP2 → pipeline, in that one order.

Each is imported on its own (``from nbdist.strategies.parallel.fsdp import apply_fsdp``).
"""

__all__: list[str] = []
