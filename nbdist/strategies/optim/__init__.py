"""Rank side: optimizers, large-batch schedules and compressed gradient communication.

- ``optimizers``: LARS and LAMB, parameter groups without weight decay, optimizer-state bytes;
- ``large_batch``: the learning rate scaled with the global batch, and its warm-up;
- ``onebit_adam``, ``onebit_lamb``: Adam's and LAMB's momentum all-reduced at one bit
  per number, with error feedback;
- ``compression``: DDP communication hooks (fp16, bf16, PowerSGD) with the bytes counted.

Each is imported on its own (``from nbdist.strategies.optim.optimizers import LAMB``).
"""

__all__: list[str] = []
