"""A real Jupyter kernel (the venv's ``python3`` kernel) driven through jupyter_client.

:class:`Kernel` wraps a ``KernelManager`` and its blocking client: execute a
cell and collect what the notebook would show (stream text, displays, errors)
together with the execute reply. The ``kernel_factory`` fixture starts kernels
and always shuts them down at the end of the test.
"""

from __future__ import annotations

import queue
import re
import time
from dataclasses import dataclass, field

import pytest

from tests.kernel_start import start_kernel

# Generous: the machine is shared with other test runs.
START_TIMEOUT = 120
CELL_TIMEOUT = 240

_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")


def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text)


@dataclass
class CellResult:
    """What one executed cell produced."""

    reply: dict  # the execute_reply content
    outputs: list[dict] = field(default_factory=list)  # iopub messages: stream/display/error
    seconds: float = 0.0

    @property
    def status(self) -> str:
        return self.reply["status"]

    @property
    def stdout(self) -> str:
        return "".join(
            m["content"]["text"]
            for m in self.outputs
            if m["msg_type"] == "stream" and m["content"]["name"] == "stdout"
        )

    @property
    def errors(self) -> list[dict]:
        """The ``error`` outputs (iopub message contents)."""
        return [m["content"] for m in self.outputs if m["msg_type"] == "error"]

    def error_text(self) -> str:
        """Every error output as a notebook shows it: traceback lines, colours removed."""
        return "\n".join(
            strip_ansi("\n".join(e["traceback"]) + f"\n{e['ename']}: {e['evalue']}")
            for e in self.errors
        )


class Kernel:
    """One kernel process started from the ``python3`` kernel spec (the venv's python)."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        # env: the kernel's whole environment
        self.km, self.kc = start_kernel(env, timeout=START_TIMEOUT)

    @property
    def pid(self) -> int:
        return self.km.provisioner.pid

    def submit(self, code: str) -> str:
        return self.kc.execute(code)

    def collect(
        self, msg_id: str, timeout: float = CELL_TIMEOUT, until=None
    ) -> tuple[list[dict], bool]:
        """Read iopub messages of ``msg_id`` until the kernel is idle again, or ``until(outputs)``.

        Returns (outputs, idle): idle is False when ``until`` stopped the reading.
        """
        deadline = time.monotonic() + timeout
        outputs: list[dict] = []
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no idle status within {timeout} s; got {outputs!r}")
            try:
                msg = self.kc.get_iopub_msg(timeout=min(remaining, 1.0))
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind = msg["msg_type"]
            # update_display_data: a display redrawn in place (several ranks' lines while a
            # cell runs are one such display until the cell ends).
            if kind in ("stream", "display_data", "update_display_data", "execute_result", "error"):
                outputs.append(msg)
                if until is not None and until(outputs):
                    return outputs, False
            elif kind == "status" and msg["content"]["execution_state"] == "idle":
                return outputs, True

    def reply(self, msg_id: str, timeout: float = CELL_TIMEOUT) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no execute_reply within {timeout} s")
            try:
                msg = self.kc.get_shell_msg(timeout=min(remaining, 1.0))
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") == msg_id:
                return msg["content"]

    def execute(self, code: str, timeout: float = CELL_TIMEOUT) -> CellResult:
        t0 = time.monotonic()
        msg_id = self.submit(code)
        outputs, _ = self.collect(msg_id, timeout)
        reply = self.reply(msg_id, timeout)
        return CellResult(reply, outputs, time.monotonic() - t0)

    def ok(self, code: str, timeout: float = CELL_TIMEOUT) -> CellResult:
        """Execute and insist it succeeded."""
        result = self.execute(code, timeout)
        assert result.status == "ok", f"{code!r} failed:\n{result.error_text()}"
        return result

    def start_dist(self, n: int = 2) -> None:
        self.ok("%load_ext nbdist")
        result = self.ok(f"%dist_start {n} --cpu", timeout=START_TIMEOUT + 60)
        assert f"nbdist: {n} ranks ready" in result.stdout

    def nbdist_pids(self) -> list[int]:
        """Every PID nbdist started for the running session: controller, zygote, engines..."""
        out = self.ok(
            "import nbdist; s = nbdist.current_session(); "
            "print(sorted(s.cluster.pids | {r.pid for r in s.ranks}))"
        ).stdout
        return [int(p) for p in out.strip().strip("[]").split(",")]

    def shutdown(self, now: bool = False) -> None:
        try:
            self.kc.stop_channels()
        finally:
            if self.km.has_kernel:
                # A killed kernel cannot answer a shutdown request: do not wait for it.
                self.km.shutdown_kernel(now=now or not self.km.is_alive())
            else:
                self.km.cleanup_resources()


@pytest.fixture
def kernel_factory():
    """Start kernels with ``kernel_factory()``; all are shut down after the test."""
    kernels: list[Kernel] = []

    def start() -> Kernel:
        kernel = Kernel()
        kernels.append(kernel)
        return kernel

    yield start
    for kernel in kernels:
        kernel.shutdown()
