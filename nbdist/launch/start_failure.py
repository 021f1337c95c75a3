"""Kernel side, while a start runs or fails: ipyparallel's words kept out of the cell, nbdist's one error.

ipyparallel's launchers warn of every process that exits non-zero ("Controller
stopped: {'exit_code': 1 ...}", "Output for ipcontroller-...:" and the
process's whole output). When nbdist stops the processes itself, or reports a
failed start in its own error with that output, those warnings only repeat it
above nbdist's one message. :class:`LauncherWords` holds them back (and keeps the
output, for the error); :func:`start_failure` words a failed start.
"""

from __future__ import annotations

import re

__all__ = ["LauncherWords", "port_clash", "start_failure"]

_TAIL_LINES = 15


class LauncherWords:
    """A logging filter: drops ipyparallel's stop and output warnings, keeping each output.

    Add it to the launchers' logger while nbdist starts or stops the processes; the
    output of each launcher that logged one is in :attr:`outputs`, by identifier.
    """

    _WORDS = ("Controller stopped:", "engine set stopped", "Output for %s")

    def __init__(self) -> None:
        """Nothing kept yet."""
        self.outputs: dict[str, str] = {}

    def filter(self, record) -> bool:
        """False (drop) for those warnings; keeps the output one carries."""
        msg = str(record.msg)
        if msg.startswith("Output for %s") and len(record.args or ()) == 2:
            self.outputs[str(record.args[0])] = str(record.args[1])
        return not msg.startswith(self._WORDS)

    def output_of(self, launcher) -> str:
        """What ``launcher`` printed: kept from its warning, or read from its log file."""
        kept = self.outputs.get(str(getattr(launcher, "identifier", "")))
        if kept is not None or launcher is None:
            return kept or ""
        try:
            return launcher.get_output() or ""
        except Exception:  # no log: the failure itself is still reported
            return ""


def port_clash(cluster, words: LauncherWords | None = None) -> str:
    """The controller's own words if it stopped because a port was taken, else ''."""
    controller = getattr(cluster, "controller", None)
    if controller is None:
        return ""
    output = (words or LauncherWords()).output_of(controller)
    for line in output.splitlines():
        if "Address already in use" in line:
            return line.strip()[-200:]
    return ""


def _tail(text: str) -> str:
    return "".join(text.splitlines(True)[-_TAIL_LINES:])


def _controller_exit(cluster, exc: BaseException) -> tuple[bool, int | None]:
    """Whether the controller has exited, and its exit code where known."""
    controller = getattr(cluster, "controller", None)
    code = (getattr(controller, "stop_data", None) or {}).get("exit_code")
    # ipyparallel's words when it saw the controller gone before its connection files came.
    said = re.match(r"Controller stopped with (-?\d+)", str(exc))
    if code is None and said:
        code = int(said.group(1))
    return code is not None or getattr(controller, "state", "") == "after" or bool(said), code


def start_failure(
    exc: BaseException, n: int, timeout: float, cluster, words: LauncherWords | None = None
) -> str:
    """nbdist's words for a start that failed with ``exc`` (a timeout, or a process that exited)."""
    words = words or LauncherWords()
    exited, code = _controller_exit(cluster, exc)
    if exited:
        tail = _tail(words.output_of(cluster.controller))
        message = (
            f"the controller exited{f' (exit code {code})' if code is not None else ''} "
            f"before the {n} ranks started"
        )
        if not tail.strip():
            return message
        return f"{message}; its last words:\n--- controller output ---\n{tail}"
    engines = None
    for engine_set in getattr(cluster, "engines", {}).values():
        engines = engine_set
    tail = _tail(words.output_of(engines)) if engines is not None else ""
    message = (
        f"the {n} ranks did not all start within {timeout:g} s ({exc}): "
        "raise --timeout if the machine is busy"
    )
    if not tail.strip():  # the engines printed nothing yet: no log to point to
        return message
    return f"{message}, or check the engine log below\n--- engine log (last lines) ---\n{tail}"
