"""Named sessions outlive the kernel: real kernels (jupyter_client), real engines, a real keeper.

The keeper of a named session is detached from the kernel (its own session,
not a descendant of the test process), so the session-wide leftover check of
tests/conftest.py cannot see it: each test here checks by PID that the keeper,
the controller, the zygote and the engines are gone at the end.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import time

import psutil
import pytest

from nbdist.driver import live_sessions
from nbdist.driver.named_sessions import NamedSession, named_sessions, stop_named
from nbdist.driver.status import StatusTable
from nbdist.errors import NbdistError, PlacementError
from nbdist.launch import named_session_records
from tests.conftest import wait_gone
from tests.kernel_start import start_kernel

pytestmark = pytest.mark.slow  # real kernels, engines, servers: 3-15 s each on 2 cores; in CI

START_TIMEOUT = 120
CELL_TIMEOUT = 240
STEPS = 60

# Each rank logs STEPS points and prints a line per step. Halfway it waits for a gate file
# that the test creates only once a new kernel has attached: so the cell is still running
# when the first kernel is killed and when the second attaches, however slow the machine.
LOGGING_CELL = """%%on_all_ranks
import os, time
for step in range({steps}):
    nbdist.log(step=step, loss=step * 0.5 + rank)
    print(f"step {{step}}", flush=True)
    time.sleep(0.02)
    while step == {steps} // 2 and not os.path.exists({gate!r}):
        time.sleep(0.05)
print("cell done", flush=True)
f"value of rank {{rank}}"
"""


class _Kernel:
    """A real python3 kernel, executing cells and collecting what a notebook would show."""

    def __init__(self, env: dict[str, str]):
        self.km, self.kc = start_kernel(env, timeout=START_TIMEOUT)

    @property
    def pid(self) -> int:
        return self.km.provisioner.pid

    def collect(self, msg_id: str, until=None, timeout: float = CELL_TIMEOUT) -> str:
        """Stream text of ``msg_id`` until idle (or until ``until(text)``); errors raise."""
        deadline = time.monotonic() + timeout
        text = ""
        while time.monotonic() < deadline:
            try:
                msg = self.kc.get_iopub_msg(timeout=1.0)
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                text += content["text"]
            elif kind in ("display_data", "execute_result", "update_display_data"):
                text += content.get("data", {}).get("text/plain", "") + "\n"
            elif kind == "error":
                raise AssertionError("\n".join(content["traceback"]))
            elif kind == "status" and content["execution_state"] == "idle":
                return text
            if until is not None and until(text):
                return text
        raise TimeoutError(f"cell not done within {timeout} s; output so far:\n{text}")

    def ok(self, code: str, timeout: float = CELL_TIMEOUT) -> str:
        return self.collect(self.kc.execute(code), timeout=timeout)

    def shutdown(self) -> None:
        try:
            self.kc.stop_channels()
        finally:
            if self.km.has_kernel:
                # Jupyter kills a kernel's whole process group: the keeper is not in it.
                self.km.shutdown_kernel(now=not self.km.is_alive())


@pytest.fixture
def history_env(tmp_path):
    env = dict(os.environ, NBDIST_HISTORY=str(tmp_path / "history.sqlite"))
    old = os.environ.get("NBDIST_HISTORY")
    os.environ["NBDIST_HISTORY"] = env["NBDIST_HISTORY"]
    yield env
    if old is None:
        os.environ.pop("NBDIST_HISTORY", None)
    else:
        os.environ["NBDIST_HISTORY"] = old


def _session_pids(name: str) -> list[int]:
    record = named_session_records.read(name)
    assert record is not None, f"no record for {name!r}"
    return [record["keeper"]["pid"], *(e["pid"] for e in record["pids"])]


@pytest.fixture
def cleanup_named():
    """Ends the named sessions a test leaves behind (a failed assertion), by their records."""
    names: list[str] = []
    yield names
    for name in names:
        if named_session_records.read(name) is not None:
            stop_named(name)


def test_session_survives_a_killed_kernel_and_a_new_kernel_attaches(
    history_env, cleanup_named, tmp_path
):
    cleanup_named.append("kept")
    gate = str(tmp_path / "gate")
    first = _Kernel(history_env)
    try:
        first.ok("%load_ext nbdist")
        out = first.ok("%dist_start 2 --cpu --name kept", timeout=START_TIMEOUT + 60)
        assert "2 ranks ready" in out and "outlives this kernel" in out
        first.ok("%%on_all_ranks\nstate = (torch.arange(3) * (rank + 1)).tolist()")
        pids = _session_pids("kept")
        running = first.kc.execute(LOGGING_CELL.format(steps=STEPS, gate=gate))
        seen = first.collect(running, until=lambda text: "step 5\n" in text)
        assert "step 5" in seen
        os.kill(first.pid, signal.SIGKILL)  # mid-cell: the rest is logged with no kernel there
        assert wait_gone([first.pid]) == []
    finally:
        first.shutdown()
    # Nothing of the session went with the kernel (nor with its process group).
    assert [p for p in pids if not psutil.pid_exists(p)] == []

    second = _Kernel(history_env)
    try:
        second.ok("%load_ext nbdist")
        listing = second.ok("%dist_sessions")
        rows = [line.split() for line in listing.splitlines()]
        assert any(row[:2] == ["kept", "2"] and "running" in row for row in rows), listing
        attaching = second.kc.execute("%dist_attach kept")
        attached = second.collect(attaching, until=lambda text: "attached to session" in text)
        assert "attached to session 'kept'" in attached
        assert "cell done" not in attached  # the ranks wait at the gate: the cell runs on
        open(gate, "w").close()
        attached += second.collect(attaching)
        # The cell the dead kernel left running streams its output here until it ends.
        assert "step 59" in attached and "cell done" in attached, attached
        # And its value, shown as after any cell.
        assert "value of rank 0" in attached and "value of rank 1" in attached, attached
        state = second.ok("%%on_all_ranks\nprint(state)")
        assert "[0, 1, 2]" in state and "[0, 2, 4]" in state, state
        # Every step of both ranks is in the run, also those logged while no kernel was there;
        # step * 0.5 + rank is exact in float64, so the values compare exactly.
        metrics = second.ok(
            "import nbdist\nrun = nbdist.current_session().metrics\n"
            "for r in range(2):\n"
            "    steps, losses = run.series('loss', r)\n"
            "    print(r, steps == list(range(60)), losses == [s * 0.5 + r for s in steps])"
        )
        assert "0 True True" in metrics and "1 True True" in metrics, metrics
        stopped = second.ok("%dist_stop kept")
        assert "stopped session 'kept'" in stopped
        assert wait_gone(pids) == []
        assert named_session_records.read("kept") is None
        assert "no named sessions" in second.ok("%dist_sessions")
    finally:
        second.shutdown()


def test_kernel_exit_detaches_and_a_killed_keeper_shows_gone(history_env, cleanup_named):
    cleanup_named.append("api")
    session = NamedSession(2, cpu=True, name="api", timeout=START_TIMEOUT).start()
    session.run("x = rank + 40")
    pids = _session_pids("api")
    # Only this user may read what reaches the session: its records and connection file.
    folder = named_session_records.session_dir("api")
    record = named_session_records.read("api")
    assert os.stat(folder).st_mode & 0o777 == 0o700
    for path in (
        os.path.join(folder, "session.json"),
        os.path.join(folder, "group.json"),
        record["connection_file"],
    ):
        assert os.stat(path).st_mode & 0o777 == 0o600, path
    with pytest.raises(NbdistError, match="'api' is running already"):
        NamedSession(2, cpu=True, name="api").start()
    # A cell sent without waiting (--noblock) just before the kernel exits still runs:
    # the client used to be closed before its request left, and the cell never ran.
    session.run("y = rank + 50", block=False)
    live_sessions.stop_all()  # what a kernel's exit runs: a named session is only let go
    assert not session.running
    assert [p for p in pids if not psutil.pid_exists(p)] == []
    again = NamedSession.attach("api")
    assert again.pull("x") == [40, 41]
    assert again.pull("y") == [50, 51]
    victim = again.ranks[1].pid
    again.detach()
    # A rank killed while no kernel holds the session: the next kernel to attach names it
    # dead, with how it died (the zygote's record, found through the session's record), at
    # once (its PID names nothing by then; the controller keeps a silent local rank).
    os.kill(victim, signal.SIGKILL)
    assert wait_gone([victim]) == []
    third = NamedSession.attach("api")
    try:
        with pytest.raises(NbdistError) as died:
            third.run("print(rank)")
        assert str(died.value).startswith(
            f"rank 1 died: pid {victim} killed by SIGKILL (signal 9): kill -9, or the kernel's "
            "out-of-memory killer (dmesg names it). A named session's ranks are not restarted "
            "from a kernel: %dist_stop api, then %dist_start with --name api again"
        ), str(died.value)
        assert third.pull("x", rank=0) == 40
    finally:
        third.detach()
    # The keeper killed: its controller and ranks end with it, the record stays as 'gone'.
    os.kill(pids[0], signal.SIGKILL)
    assert wait_gone(pids) == []
    [row] = [r for r in named_sessions() if r["name"] == "api"]
    assert row["state"] == "gone"
    with pytest.raises(NbdistError, match="%dist_stop api removes what is left"):
        NamedSession.attach("api")
    stop_named("api")
    assert named_session_records.read("api") is None


def test_a_kernel_attaching_keeps_checking_collectives(history_env, cleanup_named):
    """A session started with check_collectives: a kernel attaching later forms the group
    again (after a release) with the check too, and says so."""
    cleanup_named.append("checked")
    first = NamedSession(
        2, cpu=True, name="checked", timeout=START_TIMEOUT, check_collectives=True
    ).start()
    first.detach()
    again = NamedSession.attach("checked")
    try:
        # (summary() of an attached session failed: it has no start-up seconds.)
        said = again.summary()
        assert "nbdist: 2 ranks ready · backend gloo · device cpu · attached" in said, said
        assert "each collective is compared across the ranks" in said, said
        again.reform_group()
        again.run("level = str(dist.get_debug_level())")
        assert again.pull("level") == ["DebugLevel.DETAIL"] * 2
    finally:
        again.stop()


def test_synced_copies_outlive_a_detach_serve_the_next_kernel_and_go_at_the_stop(
    history_env, cleanup_named, tmp_path
):
    from nbdist.driver.file_sync import sync_files

    cleanup_named.append("synced")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "model.py").write_text("VALUE = 5\n")
    session = NamedSession(2, cpu=True, name="synced", timeout=START_TIMEOUT).start()
    copy = sync_files(session, [tmp_path / "src"], copy=True).used[0][str(tmp_path / "src")]
    session.detach()  # a kernel's exit: the ranks and their copies stay
    assert os.path.isfile(os.path.join(copy, "model.py"))
    again = NamedSession.attach("synced")
    # The next kernel's sync finds the copy the first one made: nothing travels again.
    report = sync_files(again, [tmp_path / "src"], copy=True)
    assert report.used[0][str(tmp_path / "src")] == copy and report.sent_files == 0, str(report)
    again.run("import model")
    assert again.pull("model.VALUE") == [5, 5]
    again.detach()
    # A third kernel that never syncs: the ranks still import the copy, and its stop removes it.
    third = NamedSession.attach("synced")
    third.run("import sys; sys.modules.pop('model'); import model")
    assert third.pull("model.__file__") == [os.path.join(copy, "model.py")] * 2
    third.stop()
    assert not os.path.exists(os.path.dirname(copy)), "the stop removed the copies"


def test_a_session_stopped_from_elsewhere_says_so_to_a_kernel_still_attached(
    history_env, cleanup_named
):
    # Not "%dist_restart brings every rank back", which a named session does not offer.
    cleanup_named.append("elsewhere")
    session = NamedSession(2, cpu=True, name="elsewhere", timeout=START_TIMEOUT).start()
    pids = _session_pids("elsewhere")
    try:
        session.run("x = rank")
        stop_named("elsewhere")  # what %dist_stop elsewhere does in another kernel
        assert wait_gone(pids, timeout=30) == []
        stopped = (
            r"Session 'elsewhere' was stopped \(%dist_stop elsewhere in another kernel, or its "
            r"keeper ended\): %dist_start with --name elsewhere starts it again"
        )
        with pytest.raises(NbdistError, match=r"^rank \d died: .*" + stopped):
            session.run("print(x)")
        with pytest.raises(NbdistError, match=stopped):
            session.pull("x")
        # %dist_status's note under the table says the same.
        table = repr(StatusTable(session.status(), hint=session.restart_hint()))
        assert re.search(stopped, table) and "%dist_restart" not in table, table
    finally:
        session.detach()


def test_a_failed_start_says_why_in_one_message_and_leaves_nothing(history_env, cleanup_named):
    # 10 ms: no rank can be up in time, whatever the machine; the keeper fails after starting
    # its controller and engines, and must stop them.
    cleanup_named.append("late")
    with pytest.raises(NbdistError) as caught:
        NamedSession(2, cpu=True, name="late", timeout=0.01).start()
    message = str(caught.value)
    assert message.startswith("session 'late' did not start: the 2 ranks did not all start within")
    assert "raise --timeout" in message
    # In 10 ms no engine printed a line: the message points to no log it does not show.
    assert "log below" not in message or "--- engine log" in message
    # nbdist's own error is the message; no traceback of the keeper is shown or logged.
    assert "Traceback" not in message and "NbdistError" not in message
    assert named_session_records.read("late") is None
    assert [r for r in named_sessions() if r["name"] == "late"] == []


def test_a_rank_killed_while_the_first_group_forms_ends_the_start_and_the_session(
    history_env, cleanup_named, monkeypatch
):
    """The keeper's ranks join from this kernel: one killed as rank 0 opens the rendezvous
    ends the start at once with how it died (not the --timeout's wait), and the failed start
    ends the keeper, its controller and the other rank, its record too."""
    import nbdist.driver.group as group_module
    from nbdist.errors import RankError

    cleanup_named.append("joinfail")
    asked = group_module.ask_engines
    seen: dict[str, list[int]] = {}

    def then_kill_rank_1(client, engine_ids, fn, *args, **kwargs):
        answer = asked(client, engine_ids, fn, *args, **kwargs)
        if fn.__name__ == "describe_rank":
            seen["pids"] = _session_pids("joinfail")
            seen["by_engine"] = {e: info["pid"] for e, info in zip(engine_ids, answer)}
        elif fn.__name__ == "open_rendezvous":
            # Rank 0 has opened the rendezvous; before any rank joins, the other is killed.
            (victim,) = (p for e, p in seen["by_engine"].items() if e != engine_ids[0])
            seen["killed"] = [victim]
            os.kill(victim, signal.SIGKILL)
        return answer

    monkeypatch.setattr(group_module, "ask_engines", then_kill_rank_1)
    with pytest.raises(RankError) as caught:  # at once, not a CellTimeout after 120 s
        NamedSession(2, cpu=True, name="joinfail", timeout=START_TIMEOUT).start()
    error = caught.value
    assert [(f.rank, f.ename) for f in error.failures] == [(1, "RankDied")], str(error)
    assert error.failures[0].evalue.startswith(f"pid {seen['killed'][0]} killed by SIGKILL")
    assert error.note == (
        "the process group did not form: rank 0 waited for the rank(s) above to join"
    )
    assert wait_gone(seen["pids"]) == []  # the keeper, its controller, the ranks
    assert named_session_records.read("joinfail") is None


def test_bad_names_and_options_are_refused_before_anything_starts():
    with pytest.raises(PlacementError, match="'no/slash'.*--name train1"):
        NamedSession(2, cpu=True, name="no/slash")
    with pytest.raises(PlacementError, match="--connect"):
        NamedSession(2, cpu=True, name="ok", connect="/tmp/cluster.json")
    with pytest.raises(NbdistError, match="no named session 'absent'"):
        NamedSession.attach("absent")
    with pytest.raises(NbdistError, match="no named session 'absent'"):
        stop_named("absent")


@pytest.fixture
def server(history_env, tmp_path):
    """A real jupyter_server with nbdist's extension, on a free loopback port: (url, token)."""
    import secrets
    import socket
    import subprocess
    import sys
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = secrets.token_hex(16)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyter_server",
            "--ip=127.0.0.1",
            f"--port={port}",
            "--port-retries=0",
            "--no-browser",
            "--allow-root",
            f"--IdentityProvider.token={token}",
            "--ServerApp.jpserver_extensions={'nbdist.server': True}",
            f"--ServerApp.root_dir={tmp_path}",
        ],
        env=history_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            try:
                request = urllib.request.Request(f"{url}/api/status")
                request.add_header("Authorization", f"token {token}")
                urllib.request.urlopen(request, timeout=5).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        yield url, token
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _call(server, path: str, method: str = "GET") -> tuple[int, dict]:
    import json
    import urllib.error
    import urllib.request

    url, token = server
    request = urllib.request.Request(
        f"{url}/nbdist/api/{path}", method=method, data=b"{}" if method == "POST" else None
    )
    request.add_header("Authorization", f"token {token}")
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {}


def test_server_lists_and_stops_named_sessions(server, cleanup_named):
    cleanup_named.append("served")
    session = NamedSession(2, cpu=True, name="served", timeout=START_TIMEOUT).start()
    session.detach()  # the session runs on without this process attached
    pids = _session_pids("served")
    code, listing = _call(server, "sessions")
    assert code == 200
    [row] = listing["sessions"]
    assert (row["name"], row["ranks"], row["state"]) == ("served", 2, "running")
    assert _call(server, "sessions/absent/stop", "POST")[0] == 404
    code, reply = _call(server, "sessions/served/stop", "POST")
    assert (code, reply["name"]) == (200, "served")
    assert wait_gone(pids) == []
    assert _call(server, "sessions") == (200, {"sessions": []})


# The browser test uses the real JupyterLab + Chromium fixtures of tests/ui (skipped, saying
# why, where Chromium or Playwright is missing).
from tests.ui.conftest import (  # noqa: E402
    artifacts_dir,  # noqa: F401 - fixtures, used by name
    browser_page,  # noqa: F401
    lab_factory,  # noqa: F401
    labextension_entry,  # noqa: F401
    notebook_json,
    poll,
)


@pytest.mark.timeout(420)
def test_sidebar_lists_attaches_and_stops_a_named_session(
    lab_factory,  # noqa: F811
    browser_page,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    server = lab_factory(
        "named.ipynb",
        notebook_json(["%load_ext nbdist", "%dist_start 2 --cpu --name ui1", "mark = 1"]),
    )
    # The server (and its kernels) keep their records in their own runtime dir (tests/ui/lab.py).
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "jupyter" / "runtime"))
    page = browser_page
    page.goto(f"{server.url}lab/tree/named.ipynb?token={server.token}")
    page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=60_000)
    tab = page.locator(".jp-SideBar .lm-TabBar-tab[data-id='nbdist-sidebar']")
    tab.wait_for(timeout=30_000)
    assert poll(server.kernel_connected, timeout=60), server.kernels()
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=30_000)
    tab.click()
    page.locator("#nbdist-sidebar").wait_for(state="visible")
    page.locator("li.lm-MenuBar-item", has_text="Run").click()
    page.locator("li.lm-Menu-item[data-command='runmenu:run-all']").click()
    row = page.locator(".nbdist-named-session[data-name='ui1']")
    try:
        assert poll(lambda: row.count() == 1 and "running" in row.inner_text(), timeout=120), (
            page.locator("#nbdist-sidebar").inner_text(),
            page.locator(".jp-NotebookPanel .jp-OutputArea-output").all_inner_texts(),
        )
        pids = _session_pids("ui1")
        last = page.locator(".jp-NotebookPanel .jp-Cell .jp-InputPrompt").nth(2)
        assert poll(lambda: last.inner_text().strip() == "[3]:", timeout=60), last.inner_text()
        # Restart the notebook's kernel: the session outlives it (the kernel only detaches).
        [kernel] = server.api("GET", "api/kernels")[1]
        server.api("POST", f"api/kernels/{kernel['id']}/restart", {}, timeout=120)
        assert [p for p in pids if not psutil.pid_exists(p)] == []
        page.wait_for_selector(
            ".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=60_000
        )
        # Attach runs %dist_attach in the active notebook, whose fresh kernel takes the session.
        row.locator("button.nbdist-named-attach").click()
        outputs = page.locator(".jp-NotebookPanel .jp-OutputArea-output")
        attached = "nbdist: attached to session 'ui1'"
        assert poll(lambda: attached in "\n".join(outputs.all_inner_texts()), timeout=90), (
            outputs.all_inner_texts()
        )
        assert poll(lambda: page.locator(".nbdist-cluster").count() == 1, timeout=30)
        # Stop, confirmed in its dialog, ends the session wherever it runs.
        row.locator("button.nbdist-named-stop").click()
        page.locator(".jp-Dialog button.jp-mod-accept").click()
        assert poll(lambda: page.locator(".nbdist-named-session").count() == 0, timeout=60)
        assert wait_gone(pids) == []
        assert named_session_records.read("ui1") is None
    finally:
        if named_session_records.read("ui1") is not None:
            stop_named("ui1")
