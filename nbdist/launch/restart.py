"""Kernel side, the processes kept: a fast restart forks fresh ranks from the running zygote.

``%dist_start`` pays for a controller and for a zygote that imports torch and
the engine stack; a restart needs neither again. :func:`restart_in_place`
keeps both: it asks the zygote (SIGUSR1, see :mod:`nbdist.launch.zygote`) to
end every process below it, the old ranks and whatever they started, and to
fork one fresh engine per slot; the old engines' registrations leave the
controller at once (:mod:`nbdist.launch.engine_unregister`), and the new engines
register under new engine ids. The caller forms the group again over them.

:func:`in_place_refusal` says when this cannot be done and a full restart
(stop, then start) is needed: an attached cluster or one started by another
launcher (their engines are not forks of a zygote of ours), engines that were
spawned (nothing imported to fork from), a zygote or controller that is gone.
"""

from __future__ import annotations

import signal
import time

import psutil

from nbdist.errors import NbdistError
from nbdist.launch import engine_unregister
from nbdist.launch.cluster import ClusterHandle
from nbdist.launch.local_engines import ZygoteEngineSetLauncher

__all__ = ["in_place_refusal", "restart_in_place"]

# The zygote's own stop grace (3 s) for what ignores SIGTERM, then ending and forking the
# ranks, which grows with them: 18.5 s at 256 ranks on 2 cores (2026-11-29), where a fixed
# 10 s gave up and fell back to a full restart (65 s instead of 48 s).
_ZYGOTE_REPLY_S = 10.0
_ZYGOTE_REPLY_PER_RANK_S = 0.15


def _zygote_reply_s(n: int) -> float:
    """Seconds the zygote may take to end ``n`` ranks and fork ``n`` fresh ones."""
    return _ZYGOTE_REPLY_S + _ZYGOTE_REPLY_PER_RANK_S * n


def in_place_refusal(handle: ClusterHandle) -> str:
    """Why ``handle``'s ranks need a full restart ('' when the zygote can fork fresh ones)."""
    engines = handle.engine_launcher()
    if not handle.owned:
        return (
            "attached cluster: its engines are not nbdist's to end or fork, so they left "
            "the group and formed it again"
        )
    if not isinstance(engines, ZygoteEngineSetLauncher):
        return (
            f"engines started by ipyparallel's {handle.start_method} launcher, not forked by "
            "nbdist's zygote: they are stopped and started again"
        )
    if handle.start_method != "fork":
        return "engines were spawned, not forked (--spawn): nothing imported to fork from"
    status = engines.read_status()
    if _zygote(engines, status) is None:
        return "the engine zygote is gone"
    controller = getattr(handle.cluster, "controller", None)
    if controller is None or not _alive(getattr(controller, "pid", None)):
        return "the controller is gone"
    return ""


def restart_in_place(handle: ClusterHandle, *, n: int, timeout: float) -> list[int]:
    """End the ranks, fork ``n`` fresh engines from the zygote, wait until they registered.

    Returns the new engines' PIDs (in slot order); ``handle.pids`` then holds
    them instead of the old ones. Raises :class:`~nbdist.errors.NbdistError`
    if the zygote does not answer or the engines do not register in ``timeout`` s.
    """
    engines = handle.engine_launcher()
    status = engines.read_status()
    zygote = _zygote(engines, status)
    if zygote is None:
        raise NbdistError("the engine zygote is gone")
    client = handle.client
    old_ids, old_pids = set(client.ids), set(status.get("pids", []))
    generation = status.get("generation", 0) + 1
    zygote.send_signal(signal.SIGUSR1)  # psutil: never a reused PID
    limit = _zygote_reply_s(n)
    deadline = time.monotonic() + limit
    while status.get("generation", 0) < generation:
        if time.monotonic() > deadline or not zygote.is_running():
            raise NbdistError(
                f"the engine zygote (pid {zygote.pid}) did not fork fresh ranks within {limit:g} s"
            )
        time.sleep(0.005)
        status = engines.read_status()
    # The old engines are gone now (the zygote reaped them): their registrations go too.
    engine_unregister.unregister(handle, old_ids & set(client.ids))
    handle.forget(old_pids | {p for p in handle.pids if handle.process(p) is None})
    handle.note(status["pids"])
    deadline = time.monotonic() + timeout
    while True:
        ids = set(client.ids)
        if not ids & old_ids and len(ids) >= n:
            return list(status["pids"])
        if time.monotonic() > deadline:
            raise NbdistError(
                f"the {n} fresh ranks did not all register within {timeout:g} s "
                f"(registered: {len(ids - old_ids)}; old engines still listed: "
                f"{sorted(ids & old_ids)}): raise --timeout if the machine is busy"
            )
        time.sleep(0.005)


def _zygote(engines: ZygoteEngineSetLauncher, status: dict) -> psutil.Process | None:
    """The running zygote process, as ipyparallel started it (None if it is gone)."""
    pid = getattr(engines, "pid", None)
    if not pid or status.get("zygote") != pid:
        return None
    try:
        proc = psutil.Process(pid)
        return proc if proc.status() != psutil.STATUS_ZOMBIE else None
    except psutil.Error:
        return None


def _alive(pid) -> bool:
    try:
        return bool(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
