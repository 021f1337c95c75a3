"""Both sides: the GPU a rank uses, its utilisation, memory and temperature, read on the rank via NVML.

The kernel imports only the names of the figures (:data:`GPU_KEYS`); NVML is read on the rank.

Each rank reads its own GPU (ranks may run on other hosts than the kernel), at
most once a second: a reading is cached for :data:`MIN_INTERVAL_S` and every
caller in between (the metrics flush thread, a ``%dist_status`` request on the
control thread) gets the cached one. Nothing here initialises CUDA: a rank whose
CUDA is not initialised is taken to use no GPU and reads nothing. Without NVML
(no driver, no GPU, nvidia-ml-py missing) every reading is None, never zeros.

NVML numbers GPUs physically (PCI bus order) and ignores ``CUDA_VISIBLE_DEVICES``,
while a rank counts only the GPUs in its CUDA_VISIBLE_DEVICES (``cuda:<i>``). So the rank's
CUDA device is matched to its NVML device by UUID (``torch.cuda.get_device_properties``
has it), and by the rank's ``CUDA_VISIBLE_DEVICES`` entry only when the UUID is
not available (see :func:`nvml_target`). Several ranks may share one GPU: a
reading is of the whole GPU, and says which (``index``, ``uuid``, ``name``).

Example (on a rank)::

    >>> from nbdist.metrics import gpu
    >>> gpu.read_this_rank()                           # doctest: +SKIP
    {'index': 2, 'name': 'NVIDIA H100 80GB HBM3', 'uuid': 'GPU-5f0c…', 'util': 87.0,
     'mem_used_mib': 40211.0, 'mem_total_mib': 81559.0, 'temp_c': 61.0}
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Hashable

__all__ = [
    "GPU_KEYS",
    "MIN_INTERVAL_S",
    "GpuSampler",
    "as_point_values",
    "cuda_target",
    "nvml_target",
    "read_nvml",
    "read_this_rank",
    "sampler",
    "uuid_text",
]

MIN_INTERVAL_S = 1.0
# Reading -> metric key in the points a rank sends (floats, like every other metric).
_POINT_KEYS = {
    "index": "gpu_index",
    "util": "gpu_util",
    "mem_used_mib": "gpu_mem_mib",
    "mem_total_mib": "gpu_mem_total_mib",
    "temp_c": "gpu_temp_c",
}
GPU_KEYS = tuple(_POINT_KEYS.values())


def uuid_text(value) -> str | None:
    """A CUDA device UUID as NVML writes it (``GPU-8-4-4-4-12`` hex), or None.

    ``value``: what ``torch.cuda.get_device_properties(i).uuid`` holds (an object
    whose ``str`` is the dashed hex, with or without the ``GPU-`` prefix, or 16
    raw ``bytes``), or that text.
    """
    if value is None:
        return None
    raw = value if isinstance(value, (bytes, bytearray)) else getattr(value, "bytes", None)
    if isinstance(raw, (bytes, bytearray)) and len(raw) == 16:
        h = raw.hex()
        text = f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
    else:
        text = str(value).strip()
    if not text:
        return None
    return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"


def nvml_target(
    uuid: str | None, visible_devices: str | None, cuda_index: int
) -> tuple[str, str | int] | None:
    """How to find CUDA device ``cuda_index``'s NVML device: ``("uuid", text)`` or ``("index", n)``.

    ``uuid``: the device's UUID (:func:`uuid_text`), the sure answer when known.
    Without it, ``visible_devices`` (the rank's ``CUDA_VISIBLE_DEVICES``) maps the
    CUDA index to a physical one: entry ``cuda_index`` of the list, a number (an
    NVML index: right when CUDA's order is PCI order, as on servers of identical
    GPUs, or with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``) or a UUID (or its prefix).
    None when the index is not in the list.

    >>> nvml_target(None, "3", 0)
    ('index', 3)
    >>> nvml_target(None, None, 1)
    ('index', 1)
    >>> nvml_target("GPU-ab12", "3", 0)
    ('uuid', 'GPU-ab12')
    """
    if uuid:
        return ("uuid", uuid)
    if visible_devices is None:
        return ("index", cuda_index)
    entries = []
    for entry in visible_devices.split(","):
        entry = entry.strip()
        # Like CUDA, the list ends at the first entry it cannot use.
        if entry.isascii() and entry.isdigit():
            entries.append(int(entry))
        elif entry.startswith(("GPU-", "MIG-")):
            entries.append(entry)
        else:
            break
    if not 0 <= cuda_index < len(entries):
        return None
    found = entries[cuda_index]
    return ("index", found) if isinstance(found, int) else ("uuid", found)


def as_point_values(reading: dict | None) -> dict[str, float]:
    """The numbers of a reading as metric values (``gpu_util``, ``gpu_mem_mib``, ...).

    A field NVML could not give (a MIG slice has no utilisation) is left out, not zero.
    """
    if not reading:
        return {}
    return {
        key: float(reading[field])
        for field, key in _POINT_KEYS.items()
        if reading.get(field) is not None
    }


class GpuSampler:
    """Readings of GPUs, each read at most once per ``interval`` seconds, cached in between.

    ``read(key)``: reads one GPU (``key``: which; :func:`read_nvml` by default), None
    without one. ``clock``: seconds, monotonic; tests pass their own. Thread-safe.
    """

    def __init__(
        self,
        read: Callable[[Hashable], dict | None] | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        interval: float = MIN_INTERVAL_S,
    ) -> None:
        """See the class docstring; ``interval`` below one second is raised to one second."""
        self._read = read or read_nvml
        self._clock = clock
        self.interval = max(interval, MIN_INTERVAL_S)
        self._lock = threading.Lock()
        self._cache: dict[Hashable, tuple[float, dict | None]] = {}
        self._handed: dict[Hashable, float] = {}  # key -> time of the reading fresh() gave last
        self.reads = 0  # how many times a GPU was actually read

    def get(self, key: Hashable) -> dict | None:
        """The reading of GPU ``key``: the cached one if younger than ``interval``, else a new one."""
        with self._lock:
            return self._get(key)[1]

    def fresh(self, key: Hashable) -> dict | None:
        """A reading not handed out by ``fresh`` before, else None: at most one per ``interval``.

        What the metrics stream attaches to the points it sends, so a GPU's
        figures travel at most once a second however often the rank flushes.
        """
        with self._lock:
            when, reading = self._get(key)
            if reading is None or self._handed.get(key) == when:
                return None
            self._handed[key] = when
            return reading

    def _get(self, key: Hashable) -> tuple[float, dict | None]:
        now = self._clock()
        cached = self._cache.get(key)
        if cached is not None and now - cached[0] < self.interval:
            return cached
        try:
            reading = self._read(key)
        except Exception:  # a GPU that cannot be read now has no figures, the rank goes on
            reading = None
        self.reads += 1
        self._cache[key] = (now, reading)
        return self._cache[key]


class _Nvml:
    """NVML, initialised once per process on first use; ``ok`` False when it cannot be."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ok: bool | None = None
        self.module = None
        self.handles: dict = {}

    def start(self) -> bool:
        with self.lock:
            if self.ok is None:
                try:
                    import pynvml

                    pynvml.nvmlInit()
                    self.module, self.ok = pynvml, True
                except Exception:  # no library, no driver, no GPU: nothing to read, ever
                    self.ok = False
            return self.ok

    def handle(self, target: tuple[str, str | int]):
        handle = self.handles.get(target)
        if handle is None:
            handle = self.handles[target] = _find_handle(self.module, target)
        return handle


_NVML = _Nvml()


def _find_handle(nvml, target: tuple[str, str | int]):
    kind, value = target
    if kind == "index":
        return nvml.nvmlDeviceGetHandleByIndex(value)
    try:
        return nvml.nvmlDeviceGetHandleByUUID(value)
    except nvml.NVMLError:
        pass
    if value.startswith("GPU-") and len(value) == 40:  # CUDA's UUID of a MIG slice
        try:
            return nvml.nvmlDeviceGetHandleByUUID("MIG-" + value[4:])
        except nvml.NVMLError:
            pass
    # CUDA_VISIBLE_DEVICES may hold a unique prefix of a UUID; NVML wants it whole.
    matches = []
    for index in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        if _text(nvml.nvmlDeviceGetUUID(handle)).startswith(value):
            matches.append(handle)
    if len(matches) != 1:
        raise LookupError(f"no single GPU has the UUID {value!r}")
    return matches[0]


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def read_nvml(target: tuple[str, str | int]) -> dict | None:
    """One GPU's figures now (``target`` from :func:`nvml_target`); None without NVML or that GPU.

    ``util`` (%, the share of the last sample period a kernel ran), ``mem_used_mib`` /
    ``mem_total_mib`` (the whole GPU's, every process's), ``temp_c``; a figure the
    GPU does not report is None.
    """
    if target is None or not _NVML.start():
        return None
    nvml = _NVML.module
    try:
        handle = _NVML.handle(target)
    except Exception:
        return None

    def field(read):
        try:
            return read()
        except nvml.NVMLError:  # NotSupported (a MIG slice, some boards): left out
            return None

    memory = field(lambda: nvml.nvmlDeviceGetMemoryInfo(handle))
    util = field(lambda: nvml.nvmlDeviceGetUtilizationRates(handle))
    return {
        "index": field(lambda: nvml.nvmlDeviceGetIndex(handle)),
        "name": field(lambda: _text(nvml.nvmlDeviceGetName(handle))),
        "uuid": field(lambda: _text(nvml.nvmlDeviceGetUUID(handle))),
        "util": None if util is None else float(util.gpu),
        "mem_used_mib": None if memory is None else round(memory.used / 2**20, 1),
        "mem_total_mib": None if memory is None else round(memory.total / 2**20, 1),
        "temp_c": field(
            lambda: float(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))
        ),
    }


_SAMPLER = GpuSampler()


def sampler() -> GpuSampler:
    """This process's sampler: every reader on the rank shares its once-a-second cache."""
    return _SAMPLER


def cuda_target(cuda_index: int | None = None) -> tuple[str, str | int] | None:
    """The NVML target of this process's CUDA device ``cuda_index``; None when CUDA is not in use.

    ``cuda_index`` None: the current device, right only on the thread that chose it
    (CUDA's current device is per thread) or when the rank sees one GPU.
    Never initialises CUDA: without torch imported and CUDA initialised, None.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if not torch.cuda.is_initialized():
            return None
        index = torch.cuda.current_device() if cuda_index is None else cuda_index
        uuid = uuid_text(getattr(torch.cuda.get_device_properties(index), "uuid", None))
    except Exception:
        return None
    return nvml_target(uuid, os.environ.get("CUDA_VISIBLE_DEVICES"), index)


def read_this_rank(cuda_index: int | None = None) -> dict | None:
    """This rank's GPU figures (cached up to a second), or None when it uses no GPU."""
    target = cuda_target(cuda_index)
    return None if target is None else _SAMPLER.get(target)
