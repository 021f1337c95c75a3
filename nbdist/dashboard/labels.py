"""Kernel side: what the dashboard calls each logged key: a readable title, its unit, its axes.

Keys nbdist derives (throughput, TFLOP/s, MFU, memory, GPU readings) have fixed
names and units; a user's key is spelled out (``grad_norm`` -> "grad norm") and
gets its unit from a suffix (``_s``: seconds, ``_ms``, ``_mib``, ``_gib``,
``_pct``/``_percent``, ``_per_s``: per second). A key made of a known key and a
suffix, as :func:`nbdist.strategies.plan.compare.compare` logs them
(``loss_ddp``), reads "loss · ddp". Loss-like keys get a log scale by default.

Example::

    >>> describe_key("loss_ddp", by_time=False)["title"]
    'loss · ddp'
    >>> describe_key("samples_per_s", by_time=True)["ytitle"]
    'samples/s'
"""

from __future__ import annotations

__all__ = ["describe_key", "title"]

# key -> (title, unit, y axis title)
_KNOWN = {
    "loss": ("loss", "", "loss"),
    "lr": ("learning rate", "", "learning rate"),
    "learning_rate": ("learning rate", "", "learning rate"),
    "grad_norm": ("gradient norm", "", "gradient norm"),
    "acc": ("accuracy", "", "accuracy"),
    "accuracy": ("accuracy", "", "accuracy"),
    "ppl": ("perplexity", "", "perplexity"),
    "perplexity": ("perplexity", "", "perplexity"),
    "samples_per_s": ("throughput, per rank and total", "samples/s", "samples/s"),
    "tokens_per_s": ("throughput, per rank and total", "tokens/s", "tokens/s"),
    "tflops": ("TFLOP/s per rank", "TFLOP/s", "TFLOP/s"),
    "mfu": ("MFU (% of the device's peak)", "%", "MFU (%)"),
    "memory_mib": ("memory per rank (MiB; allocated on GPU, RSS on CPU)", "MiB", "memory (MiB)"),
    "gpu_util": ("GPU utilisation (%)", "%", "utilisation (%)"),
    "gpu_mem_mib": ("GPU memory in use (MiB)", "MiB", "memory (MiB)"),
}
_SUFFIX_UNITS = (
    ("_per_s", "/s"),
    ("_mib", "MiB"),
    ("_gib", "GiB"),
    ("_ms", "ms"),
    ("_s", "s"),
    ("_pct", "%"),
    ("_percent", "%"),
)
_LOG_BY_DEFAULT = ("loss", "ppl", "perplexity")


def title(key: str) -> str:
    """A readable title for ``key`` ("loss_ddp" -> "loss · ddp", "grad_norm" -> "gradient norm")."""
    return _split(key)[0]


def describe_key(key: str, *, by_time: bool) -> dict:
    """``{"title", "unit", "ytitle", "xtitle", "log"}`` of ``key``'s panel.

    ``by_time``: plotted against seconds since the run started (throughput, GPU
    readings) rather than against step. ``log``: start on a log scale (loss-like keys).
    """
    name, unit, axis = _split(key)
    return {
        "title": name,
        "unit": unit,
        "ytitle": axis,
        "xtitle": "time since the run started (s)" if by_time else "step",
        "log": any(word in _LOG_BY_DEFAULT for word in key.lower().split("_")),
    }


def _split(key: str) -> tuple[str, str, str]:
    if key in _KNOWN:
        return _KNOWN[key]
    head, _, rest = key.partition("_")
    if rest and head in _KNOWN and not _unit(key):  # a known key and a suffix: loss_ddp
        name, unit, axis = _KNOWN[head]
        return f"{name} · {rest.replace('_', ' ')}", unit, axis
    unit = _unit(key)
    stem = key
    for suffix, u in _SUFFIX_UNITS:
        if u == unit and key.endswith(suffix):
            stem = key[: -len(suffix)]
            break
    name = stem.replace("_", " ").strip() or key
    return name, unit, f"{name} ({unit})" if unit else name


def _unit(key: str) -> str:
    for suffix, unit in _SUFFIX_UNITS:
        if key.endswith(suffix) and len(key) > len(suffix):
            return unit
    return ""
