"""Rank side: FLOPs per training step, and the peak TFLOP/s of a rank's device, for MFU.

``nbdist.log(step=i, loss=loss, flops=F)`` with ``F`` the FLOPs of this step on
this rank gives ``tflops`` (``F / step_time / 1e12``, with ``step_time`` the
seconds since the rank's previous ``log`` call in the cell, as for ``samples_per_s``) and
``mfu`` (``tflops / peak``, a fraction). Two ways to get ``F``, once, before
the loop:

- :func:`flops_per_step` runs one forward and backward of the model on a batch
  under ``torch.utils.flop_counter.FlopCounterMode`` and counts what ran:
  matrix products, convolutions and attention (elementwise ops, norms and the
  optimizer are not counted; they are a few percent of a step). Any model, any
  shape; what each rank computes on its own batch.
- :func:`transformer_flops`, the rule for decoder transformers (Kaplan et al.
  2020, PaLM appendix B): ``6 * params * tokens`` (2 forward, 4 backward per
  parameter and token), plus ``12 * layers * seq_len * width * tokens`` for
  attention when those are given. Needs no forward pass; the usual figure
  when comparing with papers.

The peak (:func:`device_peak`) comes from a table of NVIDIA GPUs by
``torch.cuda.get_device_name()`` and dtype (dense Tensor Core figures, no
sparsity, from the vendor's datasheets), or, on CPU and on GPUs not in the
table, is measured: a few timed square matmuls in that dtype on the rank's
device and threads, the best of them, once per process (the first ``log``
call with ``flops=`` does it, and that time is left out of the next
``step_time``). ``peak_tflops=`` on a ``log`` call, or :func:`set_peak` once,
replace it.

Example (on a rank)::

    flops = nbdist.metrics.flops_per_step(model, x)        # once
    nbdist.metrics.set_peak(dtype=torch.bfloat16)          # training in bf16
    for step, x in enumerate(loader):
        ...
        nbdist.log(step=step, loss=loss, flops=flops)      # -> tflops, mfu
"""

from __future__ import annotations

import functools
import math
import numbers
import re
import threading
import time
from dataclasses import dataclass

__all__ = [
    "PEAKS",
    "Peak",
    "device_peak",
    "flops_per_step",
    "known_peak",
    "log_peak",
    "measure_peak",
    "set_peak",
    "table_peak",
    "transformer_flops",
]

_DTYPES = ("fp32", "tf32", "bf16", "fp16")

# (pattern matched against the upper-cased device name with "-"/"_" as spaces, product,
#  dense TFLOP/s for fp32 (CUDA cores), tf32, bf16, fp16 (Tensor Cores, fp32 accumulate).
#  None: the GPU has no such unit (then the peak is measured). First match wins.
PEAKS: tuple[tuple[str, str, tuple[float | None, ...]], ...] = (
    # NVIDIA H100 datasheet (nvidia.com/en-us/data-center/h100): sparse figures halved
    (r"\bH100\b.*\bNVL\b", "H100 NVL", (60.0, 417.5, 835.5, 835.5)),
    (r"\bH100\b.*\bPCIE\b", "H100 PCIe", (51.0, 378.0, 756.0, 756.0)),
    (r"\bH100\b", "H100 SXM", (67.0, 494.5, 989.5, 989.5)),
    # NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200): sparse figures halved
    (r"\bH200\b.*\bNVL\b", "H200 NVL", (60.0, 417.5, 835.5, 835.5)),
    (r"\bH200\b", "H200 SXM", (67.0, 494.5, 989.5, 989.5)),
    # NVIDIA GH200 Grace Hopper Superchip datasheet: the same Hopper GPU as H100 SXM
    (r"\bGH200\b", "GH200", (67.0, 494.5, 989.5, 989.5)),
    # NVIDIA A100 datasheet (40 GB and 80 GB, SXM4 and PCIe list the same peaks)
    (r"\bA100\b", "A100", (19.5, 156.0, 312.0, 312.0)),
    # NVIDIA L40S datasheet: TF32 183 | 366*, BF16/FP16 362.05 | 733* (* sparsity)
    (r"\bL40S\b", "L40S", (91.6, 183.0, 362.05, 362.05)),
    # NVIDIA L40 datasheet: TF32 90.5 | 181*, BF16/FP16 181.05 | 362.1*
    (r"\bL40\b", "L40", (90.5, 90.5, 181.05, 181.05)),
    # NVIDIA L4 datasheet: TF32 120*, BF16/FP16 242* (* sparsity)
    (r"\bL4\b", "L4", (30.3, 60.0, 121.0, 121.0)),
    # NVIDIA A40 datasheet: TF32 74.8 | 149.6*, BF16/FP16 149.7 | 299.4*
    (r"\bA40\b", "A40", (37.4, 74.8, 149.7, 149.7)),
    # NVIDIA A10 datasheet: TF32 62.5 | 125*, BF16/FP16 125 | 250*
    (r"\bA10\b", "A10", (31.2, 62.5, 125.0, 125.0)),
    # NVIDIA Ada Lovelace architecture whitepaper, appendix A (GeForce: fp32-accumulate rates)
    (r"\bRTX 4090\b(?! D\b)", "GeForce RTX 4090", (82.6, 82.6, 165.2, 165.2)),
    # NVIDIA Ampere GA102 whitepaper, appendix A (GeForce: fp32-accumulate rates)
    (r"\bRTX 3090\b(?! TI\b)", "GeForce RTX 3090", (35.6, 35.6, 71.0, 71.0)),
    # NVIDIA V100 datasheet: no TF32 or BF16 units (tf32 runs as fp32); fp16 "Tensor Performance"
    (r"\bV100S\b", "V100S PCIe", (16.4, 16.4, None, 130.0)),
    (r"\bV100\b.*\bPCIE\b", "V100 PCIe", (14.0, 14.0, None, 112.0)),
    (r"\bV100\b", "V100 SXM2", (15.7, 15.7, None, 125.0)),
    # NVIDIA T4 datasheet: fp32 8.1, "Mixed Precision (FP16/FP32)" 65; no TF32 or BF16 units
    (r"\bT4\b", "T4", (8.1, 8.1, None, 65.0)),
)


@dataclass(frozen=True)
class Peak:
    """A device's peak: ``tflops`` (dense TFLOP/s), and where the figure came from."""

    tflops: float
    dtype: str  # "fp32", "tf32", "bf16" or "fp16"
    device: str  # the device's name, e.g. "NVIDIA H100 80GB HBM3" or "cpu"
    source: str  # "table: H100 SXM", "measured: ...", or "set by set_peak"


_lock = threading.Lock()
_override: dict = {"tflops": None, "dtype": None}
_for_log: dict[int | None, float] = {}  # CUDA index (None: CPU) -> the peak log uses


def _dtype_name(dtype) -> str:
    """``torch.bfloat16`` / ``"bfloat16"`` / ``"bf16"`` -> ``"bf16"`` (and so on)."""
    text = str(dtype).replace("torch.", "").lower()
    names = {"float32": "fp32", "float": "fp32", "float16": "fp16", "half": "fp16"}
    text = names.get(text, {"bfloat16": "bf16"}.get(text, text))
    if text not in _DTYPES:
        raise ValueError(f"dtype {dtype!r}: use one of {', '.join(_DTYPES)} (or a torch dtype)")
    return text


def _default_dtype(cuda: bool) -> str:
    import torch

    if _override["dtype"] is not None:
        return _override["dtype"]
    default = torch.get_default_dtype()
    name = _dtype_name(default) if default in (torch.bfloat16, torch.float16) else "fp32"
    if name == "fp32" and cuda and torch.get_float32_matmul_precision() != "highest":
        return "tf32"  # fp32 matmuls run on TF32 Tensor Cores (allow_tf32 / "high")
    return name


def table_peak(name: str, dtype="bf16") -> Peak | None:
    """The datasheet peak of the GPU called ``name`` (as ``torch.cuda.get_device_name()``
    says) in ``dtype``; None when the GPU is not in :data:`PEAKS` or lacks that unit.

    >>> table_peak("NVIDIA H100 80GB HBM3", "bf16").tflops
    989.5
    """
    dtype = _dtype_name(dtype)
    key = re.sub(r"[-_\s]+", " ", name.upper())
    for pattern, product, figures in PEAKS:
        if re.search(pattern, key):
            value = figures[_DTYPES.index(dtype)]
            return None if value is None else Peak(value, dtype, name, f"table: {product}")
    return None


def measure_peak(device="cpu", dtype="fp32") -> Peak:
    """The best TFLOP/s of a few timed ``n x n`` matmuls on ``device``; once per process.

    ``n`` is 1024 on CPU (with this process's torch threads) and 8192 on a GPU
    (4096 in fp32; three such matrices, 400 MB in bf16, are allocated meanwhile);
    after one untimed warm-up, matmuls are timed in groups of at least 20 ms
    between synchronisations for about 0.3 s, and the fastest group counts, at
    ``2 * n**3`` FLOPs per matmul. tf32 on a GPU is measured with TF32 matmuls
    allowed. Cached by (device, dtype): later calls cost nothing.
    """
    import torch

    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return _measure(str(dev), _dtype_name(dtype))


@functools.cache
def _measure(device: str, dtype: str) -> Peak:
    import torch

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    tensor_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, torch.float32)
    n = (4096 if tensor_dtype == torch.float32 else 8192) if cuda else 1024
    a = torch.randn(n, n, device=dev).to(tensor_dtype)
    b = torch.randn(n, n, device=dev).to(tensor_dtype)
    out = torch.empty(n, n, device=dev, dtype=tensor_dtype)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
    sync = torch.cuda.synchronize if cuda else (lambda *_: None)
    try:
        torch.mm(a, b, out=out)  # warm-up: kernel selection, thread pool start
        sync(dev)
        t0 = time.perf_counter()
        torch.mm(a, b, out=out)
        sync(dev)
        # Groups of matmuls that take >= 20 ms each, so a GPU's launch and sync cost vanish.
        best = time.perf_counter() - t0
        group, start = max(1, min(50, int(0.02 / best))), time.perf_counter()
        while time.perf_counter() - start < 0.3 or best == float("inf"):
            t0 = time.perf_counter()
            for _ in range(group):
                torch.mm(a, b, out=out)
            sync(dev)
            best = min(best, (time.perf_counter() - t0) / group)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    name = torch.cuda.get_device_name(dev) if cuda else "cpu"
    count = torch.get_num_threads()
    threads = "" if cuda else f", {count} thread{'s' if count != 1 else ''}"
    how = f"measured: best of timed {n}x{n} {dtype} matmuls{threads}"
    return Peak(2 * n**3 / best / 1e12, dtype, name, how)


def device_peak(device=None, dtype=None) -> Peak:
    """The peak ``nbdist.log`` divides by for MFU on this rank (see the module docstring).

    ``device``: a torch device or its text (None: the rank's CUDA device when
    CUDA is in use, else the CPU); ``dtype``: fp32, tf32, bf16 or fp16, or a
    torch dtype (None: :func:`set_peak`'s, else torch's default dtype, as tf32
    on a GPU that allows TF32 matmuls). A value given to :func:`set_peak` wins.
    """
    import torch

    dev = torch.device(device) if device is not None else None
    if dev is None:
        cuda_ok = torch.cuda.is_available() and torch.cuda.is_initialized()
        dev = torch.device("cuda", torch.cuda.current_device()) if cuda_ok else torch.device("cpu")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    cuda = dev.type == "cuda"
    dtype = _dtype_name(dtype) if dtype is not None else _default_dtype(cuda)
    name = torch.cuda.get_device_name(dev) if cuda else "cpu"
    if _override["tflops"] is not None:
        return Peak(float(_override["tflops"]), dtype, name, "set by set_peak")
    found = table_peak(name, dtype) if cuda else None
    return found or measure_peak(str(dev), dtype)


def set_peak(tflops: float | None = None, *, dtype=None) -> None:
    """Fix what MFU is measured against on this rank, from now on.

    ``tflops``: the peak itself (None: the table's or the measured one again);
    ``dtype``: the precision the model trains in, for the table (``torch.bfloat16``,
    ``"fp16"``, ``"tf32"``...; None: torch's default dtype). ``peak_tflops=`` on
    one ``nbdist.log`` call overrides both for that point.
    """
    if tflops is not None:
        number = isinstance(tflops, numbers.Real) and not isinstance(tflops, bool)
        if not number or not 0 < tflops < math.inf:
            raise (ValueError if number else TypeError)(
                f"peak tflops must be a positive number, got {tflops!r}: give TFLOP/s as a "
                "number, e.g. set_peak(312.0), or set_peak() to go back to the table or a "
                "measurement"
            )
    dtype = None if dtype is None else _dtype_name(dtype)  # refused before anything changes
    with _lock:
        _override["tflops"] = None if tflops is None else float(tflops)
        _override["dtype"] = dtype
        _for_log.clear()


def known_peak(cuda_index: int | None) -> float | None:
    """The peak :func:`log_peak` found for this device already (0.0: none to be had), or None."""
    return _for_log.get(cuda_index)


def log_peak(cuda_index: int | None) -> float | None:
    """The peak ``nbdist.log`` uses on CUDA device ``cuda_index`` (None: CPU), or None.

    Looked up once per device (the first call may measure, see :func:`measure_peak`),
    then kept for :func:`known_peak`; None when no peak can be had (MFU is left out).
    """
    try:
        device = "cpu" if cuda_index is None else f"cuda:{cuda_index}"
        peak = device_peak(device).tflops
    except Exception:
        peak = 0.0
    with _lock:
        _for_log[cuda_index] = peak
    return peak or None


def _unwrap(model):
    import torch

    ddp = torch.nn.parallel.DistributedDataParallel
    return model.module if isinstance(model, ddp) else model


def flops_per_step(model, inputs, *, loss_fn=None, backward: bool = True) -> int:
    """FLOPs of one training step of ``model`` on ``inputs``, counted by running it once.

    ``inputs``: a tensor, a tuple of positional arguments, or a dict of keyword
    arguments. ``loss_fn(output)`` makes the loss (default: the output's sum, or
    its ``.loss`` when it has one; the loss itself is not a matrix product and
    costs next to nothing). With ``backward`` the gradients are computed too
    (``torch.autograd.grad``, for what ``.backward()`` would fill: the parameters,
    and inputs that require grad; their ``.grad`` stay as they were).
    The model's buffers (batch-norm statistics) and the RNG states are restored
    afterwards, so training continues as if this had not run.

    What is counted: per ``nn.Linear`` of ``in -> out`` on ``B`` rows, ``2*B*in*out``
    forward, the same for the weight's gradient, and the same again for the
    input's gradient, which autograd skips for the first layer when the batch
    does not require grad. With activation checkpointing the recomputed forward
    counts too (hardware FLOPs rather than model FLOPs). A
    ``DistributedDataParallel`` model is counted through its ``.module``; an
    FSDP model gathers its weights in forward, so every rank must call this.
    """
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"flops_per_step: model must be a torch.nn.Module (plain or DDP), got "
            f"{type(model).__name__}{' (a class: pass the model you built)' if isinstance(model, type) else ''}"
        )
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(
            f"flops_per_step: loss_fn={loss_fn!r} is not callable: give a function of the "
            "model's output, e.g. loss_fn=lambda out: out.logits.sum()"
        )
    model = _unwrap(model)
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    # What .backward() would fill: trainable parameters and inputs that require grad. Those
    # inputs go in as views (not leaves), which FlopCounterMode's module hooks need.
    if isinstance(inputs, dict):
        inputs = {k: _as_view(v) for k, v in inputs.items()}
        given = list(inputs.values())
    elif isinstance(inputs, (tuple, list)):
        inputs = given = [_as_view(v) for v in inputs]
    else:
        inputs = _as_view(inputs)
        given = [inputs]
    params = [p for p in model.parameters() if p.requires_grad]
    params += [t for t in given if isinstance(t, torch.Tensor) and t.requires_grad]
    devices = [d for d in {p.device for p in params} if d.type == "cuda"]
    with torch.random.fork_rng(devices=devices), FlopCounterMode(display=False) as counter:
        if isinstance(inputs, dict):
            output = model(**inputs)
        elif isinstance(inputs, (tuple, list)):
            output = model(*inputs)
        else:
            output = model(inputs)
        if backward and params:
            loss = loss_fn(output) if loss_fn is not None else _as_loss(output)
            torch.autograd.grad(loss, params, allow_unused=True)
    with torch.no_grad():
        for buffer, saved in buffers:
            buffer.copy_(saved)
    return int(counter.get_total_flops())


def _as_view(value):
    import torch

    if isinstance(value, torch.Tensor) and value.requires_grad and value.is_leaf:
        return value.view_as(value)
    return value


def _as_loss(output):
    loss = getattr(output, "loss", None)
    if loss is not None:
        return loss
    if isinstance(output, dict):
        output = next(v for v in output.values() if hasattr(v, "sum"))
    elif isinstance(output, (tuple, list)):
        output = next(v for v in output if hasattr(v, "sum"))
    return output.float().sum()


def transformer_flops(
    params,
    tokens: int,
    *,
    layers: int = 0,
    seq_len: int = 0,
    width: int = 0,
    backward: bool = True,
) -> int:
    """FLOPs of a decoder transformer step on ``tokens`` tokens: ``6 * params * tokens``.

    ``params``: the parameter count, or the model (its parameters, tied ones
    once; subtract position embeddings, which are lookups, for nanoGPT's
    number). 2 FLOPs per parameter and token forward, 4 backward. With
    ``layers``, ``seq_len`` and ``width`` (d_model), attention's score and value
    products add ``12 * layers * seq_len * width`` per token (PaLM, appendix B).
    ``backward=False``: a forward pass only (a third of each).

    >>> transformer_flops(124_000_000, 8 * 1024)
    6094848000000
    """
    if callable(getattr(params, "parameters", None)):
        params = sum(p.numel() for p in params.parameters())
    else:
        params = _count(params, "params", "the parameter count, e.g. 124_000_000, or the model")
    tokens = _count(tokens, "tokens", "the tokens of one step, e.g. batch * seq_len")
    shape = {"layers": layers, "seq_len": seq_len, "width": width}
    layers, seq_len, width = (
        _count(v, k, "0 to leave attention out", minimum=0) for k, v in shape.items()
    )
    if 0 in (layers, seq_len, width) and any((layers, seq_len, width)):
        given = ", ".join(f"{k}={v}" for k, v in shape.items())
        raise ValueError(
            f"transformer_flops: {given}: give layers, seq_len and width together for the "
            "attention term, or none of them"
        )
    per_token = 6 * params + 12 * layers * seq_len * width
    return per_token * tokens // (1 if backward else 3)


def _count(value, name: str, what: str, *, minimum: int = 1) -> int:
    """``value`` as a whole number >= ``minimum`` (``124e6`` counts), or refused naming ``name``."""
    message = f"transformer_flops: {name}={value!r}: give a whole number >= {minimum} ({what})"
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(message)
    if not math.isfinite(value) or value != int(value) or int(value) < minimum:
        raise ValueError(message)
    return int(value)
