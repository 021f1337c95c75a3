"""Rank side: compact fingerprints of a value, and the exact comparison of the leaves that differ.

``%dist_diff EXPR`` (:mod:`nbdist.driver.diff`) evaluates EXPR on each rank
(it is held there by :mod:`nbdist.engine.rank_diff`, whose calls end up here), then
asks each rank for :func:`fingerprints`: one small record per
leaf of the value (tensors, numbers, strings, None, objects; dicts, lists and
tuples are walked), each under its path (``("['layer.weight']",)``). A tensor's
record is its shape, dtype, device type, a 64-bit hash of its values and a few
statistics, a few hundred bytes whatever its size, so comparing a whole
``state_dict`` moves almost nothing.

Why fingerprints, and why the kernel relays the differing leaves:

- The hash runs where the tensor lives (blake2b over its bytes on the CPU, an
  integer hash on the device for a GPU tensor), in chunks of :data:`CHUNK`
  elements, so neither a device-to-host copy nor a temporary the size of the
  tensor is needed. NaNs are hashed as one canonical
  NaN and -0.0 as 0.0: equal hashes mean equal values, NaN matching NaN.
- Only a leaf whose hash differs from the reference rank's needs more: the
  reference rank sends that leaf's bytes (:func:`reference_data`) and each rank
  that differs compares its own tensor with them on its device
  (:func:`compare_with`), returning the max abs diff and the first differing
  index. The bytes go through the kernel, not through ``torch.distributed``:
  a broadcast would need every rank of the group to take part (``--ranks``
  selects some), would hang on a rank whose leaf is missing or shaped
  differently, and would advance the collective sequence numbers that
  ``%dist_where`` reports. The kernel holds one batch of reference leaves at a
  time and never unpickles a tensor (it does not even import torch).

Everything returned here is built from Python's own types, so the kernel can
read it without torch.
"""

from __future__ import annotations

import ctypes
import hashlib
import re
import sys
from collections.abc import Mapping

import torch

__all__ = ["CHUNK", "compare_with", "fingerprints", "reference_data"]

# Elements hashed or compared per pass: bounds each temporary (int64) to 32 MiB.
CHUNK = 1 << 22
# splitmix64's constants as signed int64 (torch has no uint64 arithmetic); int64
# products wrap around on CPU and CUDA alike, so every rank computes the same hash.
_K1, _K2, _K3 = -7046029254386353131, -4658895280553007687, -7723592293110705685
_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_ADDRESS = re.compile(r"0x[0-9a-fA-F]{4,}")
_TEXT_LIMIT = 2048
_MAX_DEPTH = 64


def _walk(value, path=(), depth=0, seen=()):
    """(path, leaf or container) pairs, depth first; containers come before their items."""
    if isinstance(value, torch.Size) or depth > _MAX_DEPTH or id(value) in seen:
        yield path, value
        return
    if isinstance(value, Mapping):
        items = [(f"[{k!r}]", v) for k, v in value.items()]
    elif isinstance(value, (list, tuple)):
        items = [(f"[{i}]", v) for i, v in enumerate(value)]
    else:
        yield path, value
        return
    yield path, value
    for key, item in items:
        yield from _walk(item, (*path, key), depth + 1, (*seen, id(value)))


def _as_tensor(value):
    """The tensor to fingerprint for ``value`` and a note on it, or (None, None)."""
    if isinstance(value, torch.Tensor):
        if type(value).__name__ == "DTensor" and hasattr(value, "to_local"):
            return value.to_local(), "local shard"
        if value.layout != torch.strided:
            return value.to_dense(), f"{value.layout} as dense"
        return value, None
    numpy = sys.modules.get("numpy")  # never imported here: a numpy value means it is loaded
    if numpy is not None and isinstance(value, numpy.ndarray) and value.dtype.kind in "biufc":
        return torch.from_numpy(numpy.ascontiguousarray(value)), "numpy array"
    return None, None


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().reshape(-1)
    return torch.view_as_real(flat).reshape(-1) if flat.is_complex() else flat


def _canonical(chunk: torch.Tensor) -> torch.Tensor:
    """``chunk`` with every NaN the same NaN and -0.0 as 0.0 (floats that support it)."""
    if not chunk.is_floating_point():
        return chunk
    try:
        return torch.where(torch.isnan(chunk), torch.nan, chunk) + 0.0
    except (RuntimeError, TypeError):  # float8 and the like: their raw bits
        return chunk


def _device_hash(bits: torch.Tensor, start: int) -> torch.Tensor:
    """An int64 hash of one chunk's words and their positions, computed where they live."""
    x = bits.to(torch.int64)
    index = torch.arange(start, start + x.numel(), device=x.device, dtype=torch.int64)
    x = (x ^ (index * _K1)) * _K2
    x = (x ^ (x >> 31)) * _K3
    return (x ^ (x >> 29)).sum()


def _host_bytes(chunk: torch.Tensor):
    """The bytes of a contiguous CPU tensor, without a copy (valid while ``chunk`` lives)."""
    return (ctypes.c_char * (chunk.numel() * chunk.element_size())).from_address(chunk.data_ptr())


def _tensor_record(tensor: torch.Tensor, note: str | None) -> dict:
    flat = _flat(tensor)
    on_host = flat.device.type == "cpu"
    # On the CPU, blake2b over the bytes (about 1 GB/s); elsewhere an integer hash
    # on the device, so a GPU tensor is never copied to the host.
    digest = hashlib.blake2b(digest_size=8) if on_host else None
    words = _INTS.get(flat.element_size(), torch.uint8)
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    nan = count = 0
    lo = hi = acc = None
    for start in range(0, flat.numel(), CHUNK):
        chunk = flat[start : start + CHUNK]
        canon = _canonical(chunk)
        if on_host:
            digest.update(_host_bytes(canon))
        else:
            total += _device_hash(canon.view(words), start)
        if chunk.dtype == torch.bool:
            chunk = chunk.to(torch.uint8)
        if chunk.is_floating_point():
            try:
                here = int(torch.isnan(chunk).sum().item())  # one sync per chunk
            except (RuntimeError, TypeError):  # float8 and the like: no statistics
                continue
            if here:
                nan += here
                chunk = chunk[~torch.isnan(chunk)]
        if chunk.numel():
            low, high = torch.aminmax(chunk)
            lo = low if lo is None else torch.minimum(lo, low)
            hi = high if hi is None else torch.maximum(hi, high)
            part = chunk.sum(dtype=torch.float64 if chunk.device.type != "mps" else None)
            acc = part if acc is None else acc + part
            count += chunk.numel()
    if on_host:
        value = int.from_bytes(digest.digest(), "little", signed=True)
    else:
        value = int(total.item())
    return {
        "kind": "tensor",
        "shape": tuple(tensor.shape),
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "device": tensor.device.type,
        "hash": value,
        "nbytes": tensor.numel() * tensor.element_size(),
        "nan": nan,
        "min": float(lo.item()) if lo is not None else None,
        "max": float(hi.item()) if hi is not None else None,
        "mean": float(acc.item()) / count if acc is not None else None,
        "note": note,
    }


def _record(value) -> dict:
    """The fingerprint of one node of the walk."""
    tensor, note = _as_tensor(value)
    if tensor is not None:
        if tensor.is_meta:
            return {"kind": "object", "type": "meta tensor", "repr": repr(value), "hash": ""}
        return _tensor_record(tensor, note)
    if value is None:
        return {"kind": "none"}
    item = getattr(value, "item", None)  # numpy scalars, as Python numbers
    if callable(item) and type(value).__module__ == "numpy" and getattr(value, "ndim", 1) == 0:
        value = item()
    if isinstance(value, (bool, int, float, complex)):
        return {"kind": "number", "type": type(value).__name__, "value": value}
    if isinstance(value, (str, bytes)):
        data = value.encode("utf-8", "surrogatepass") if isinstance(value, str) else value
        return {
            "kind": "text",
            "type": type(value).__name__,
            "length": len(value),
            "hash": hashlib.blake2b(data, digest_size=8).hexdigest(),
            "text": value if len(value) <= _TEXT_LIMIT else None,
        }
    if isinstance(value, Mapping) or (
        isinstance(value, (list, tuple)) and not isinstance(value, torch.Size)
    ):
        kind = "dict" if isinstance(value, Mapping) else type(value).__name__
        return {"kind": "container", "type": kind, "length": len(value)}
    text = _ADDRESS.sub("0x#", repr(value))  # addresses differ per process, not the object
    return {
        "kind": "object",
        "type": f"{type(value).__module__}.{type(value).__qualname__}",
        "repr": text if len(text) <= 200 else text[:197] + "...",
        "hash": hashlib.blake2b(text.encode("utf-8", "replace"), digest_size=8).hexdigest(),
    }


def fingerprints(value) -> list[tuple[tuple[str, ...], dict]]:
    """(path, record) for every node of ``value`` (itself, then its items), in walk order."""
    return [(path, _record(node)) for path, node in _walk(value)]


def _leaves(value, paths) -> dict:
    wanted = set(paths)
    return {path: node for path, node in _walk(value) if path in wanted}


def reference_data(value, paths) -> dict:
    """The leaves of ``value`` at ``paths``: a tensor as (shape, raw bytes), a string as itself."""
    out = {}
    for path, node in _leaves(value, paths).items():
        tensor, _ = _as_tensor(node)
        if tensor is None:
            out[path] = node if isinstance(node, (str, bytes)) else None
            continue
        # A copy of its own on the CPU, so its storage holds exactly these elements.
        copy = tensor.detach().to("cpu").clone(memory_format=torch.contiguous_format)
        out[path] = (tuple(copy.shape), bytes(_host_bytes(copy)))
    return out


def _unravel(flat_index: int, shape) -> tuple[int, ...]:
    index = []
    for size in reversed(shape):
        flat_index, rest = divmod(flat_index, size)
        index.append(rest)
    return tuple(reversed(index))


def _compare_text(own, ref) -> dict:
    first = next((i for i, (a, b) in enumerate(zip(own, ref)) if a != b), min(len(own), len(ref)))
    return {"first_index": (first,)}


def _compare_tensor(own: torch.Tensor, shape, raw: bytes) -> dict:
    ref = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0)
    ref = ref.view(own.dtype).reshape(shape).to(own.device)
    a, b = own.detach().reshape(-1), ref.reshape(-1)
    wide = torch.float64 if a.device.type != "mps" else torch.float32
    first = worst_at = None
    n_diff = nan_mismatch = 0
    worst = 0.0
    for start in range(0, a.numel(), CHUNK):
        x, y = a[start : start + CHUNK], b[start : start + CHUNK]
        if x.is_floating_point() or x.is_complex():
            nan_x, nan_y = torch.isnan(x), torch.isnan(y)
            same = (x == y) | (nan_x & nan_y)
            numbers = ~(nan_x | nan_y)
            nan_mismatch += int((nan_x ^ nan_y).sum().item())
            as_wide = torch.complex128 if x.is_complex() else wide
            gap = (x.to(as_wide) - y.to(as_wide)).abs()
            zero = torch.zeros((), dtype=gap.dtype, device=gap.device)
            gap = torch.where(same | ~numbers, zero, gap)
        else:
            same = x == y
            if x.dtype == torch.bool:
                gap = (~same).to(wide)
            else:
                gap = (x.to(torch.int64) - y.to(torch.int64)).abs().to(wide)
        differs = ~same
        count = int(differs.sum().item())
        if not count:
            continue
        n_diff += count
        if first is None:
            first = start + int(differs.to(torch.uint8).argmax().item())
        top = float(gap.max().item())
        if top > worst:
            worst, worst_at = top, start + int(gap.argmax().item())
    return {
        "max_abs_diff": worst,
        "max_index": _unravel(worst_at, shape) if worst_at is not None else None,
        "first_index": _unravel(first, shape) if first is not None else None,
        "n_diff": n_diff,
        "numel": a.numel(),
        "nan_mismatch": nan_mismatch,
    }


def compare_with(value, reference: dict, paths) -> dict:
    """The leaves of ``value`` at ``paths`` compared with :func:`reference_data`'s ``reference``.

    Returns {path: {max_abs_diff, max_index, first_index, n_diff, numel, nan_mismatch}}
    for a tensor (max_abs_diff over the elements that are numbers on both ranks;
    NaN matches NaN), {path: {first_index}} for a string.
    """
    out = {}
    for path, node in _leaves(value, paths).items():
        ref = reference.get(path)
        tensor, _ = _as_tensor(node)
        if tensor is not None and isinstance(ref, tuple):
            out[path] = _compare_tensor(tensor, ref[0], ref[1])
        elif isinstance(node, (str, bytes)) and isinstance(ref, (str, bytes)):
            out[path] = _compare_text(node, ref)
    return out
