"""nbdist's REST API in a real jupyter_server: every route needs a login, and answers truly.

Real components: the server (pytest-jupyter), real ranks (DistSession, gloo),
a real kernel started through the server for the restart/stop actions, and
the real run history (SQLite).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time

import psutil
import pytest
from tornado.httpclient import HTTPClientError

from nbdist import DistSession, RankError
from nbdist.dashboard.palette import rank_colours
from nbdist.dashboard.table import rank_rows
from nbdist.driver import registry
from nbdist.metrics.store import RunStore
from tests.cluster.conftest import own_pid_namespace_unavailable, python_in_own_pid_namespace
from tests.conftest import wait_gone

# One request per route nbdist registers; the test below fails if a route is missing here.
SAMPLE_PATHS = {
    "nbdist/api/clusters": "GET",
    "nbdist/api/clusters/cluster-1-0/interrupt": "POST",
    "nbdist/api/clusters/cluster-1-0/restart": "POST",
    "nbdist/api/clusters/cluster-1-0/stop": "POST",
    "nbdist/api/runs": "GET",
    "nbdist/api/runs/1": "GET",
    "nbdist/api/palette": "GET",
    "nbdist/api/sessions": "GET",
    "nbdist/api/sessions/train1/stop": "POST",
    "nbdist/static/plotly.min.js": "GET",
}


def _nbdist_patterns(web_app) -> list[str]:
    patterns = []
    stack = list(web_app.default_router.rules) + list(web_app.wildcard_router.rules)
    while stack:
        rule = stack.pop()
        target = rule.target
        if hasattr(target, "rules"):
            stack.extend(target.rules)
            continue
        regex = getattr(rule.matcher, "regex", None)
        if regex is not None and "nbdist" in regex.pattern:
            patterns.append(regex.pattern)
    return patterns


async def _json(jp_fetch, *parts, method="GET", body=None):
    kwargs = {"method": method}
    if method == "POST":
        kwargs["body"] = json.dumps(body or {})
    response = await jp_fetch(*parts, **kwargs)
    return response.code, json.loads(response.body)


@contextlib.asynccontextmanager
async def _kernel(jp_fetch, jp_serverapp):
    """A python3 kernel the server started, and a client on it: ``(kernel_id, client)``.

    Deleted through the server afterwards, and its process must be gone.
    """
    code, kernel = await _json(jp_fetch, "api", "kernels", method="POST", body={"name": "python3"})
    kernel_id = kernel["id"]
    client = jp_serverapp.kernel_manager.get_kernel(kernel_id).client()
    client.start_channels()
    try:
        yield kernel_id, client
    finally:
        client.stop_channels()
        kernel_pid = jp_serverapp.kernel_manager.get_kernel(kernel_id).provisioner.pid
        await jp_fetch("api", "kernels", kernel_id, method="DELETE")
        assert wait_gone([kernel_pid]) == []


async def _clusters(jp_fetch) -> list[dict]:
    return (await _json(jp_fetch, "nbdist", "api", "clusters"))[1]["clusters"]


async def test_every_nbdist_route_requires_login(jp_fetch, jp_web_app, jp_base_url):
    import re

    patterns = _nbdist_patterns(jp_web_app)
    for pattern in patterns:
        assert any(re.fullmatch(pattern.rstrip("$"), jp_base_url + p) for p in SAMPLE_PATHS), (
            f"route {pattern} has no sample request here: add one, so its login check is tested"
        )
    for path in SAMPLE_PATHS:  # and no sample is left over from a route that went away
        assert any(re.fullmatch(pt.rstrip("$"), jp_base_url + path) for pt in patterns), path
    for path, method in SAMPLE_PATHS.items():
        # A matching XSRF cookie/header pair: a POST then fails only for want of a login,
        # so a handler without @web.authenticated would answer (200/202/404) and fail here.
        headers = {"Authorization": "", "Cookie": "_xsrf=abc", "X-XSRFToken": "abc"}
        body = b"{}" if method == "POST" else None
        with pytest.raises(HTTPClientError) as err:
            await jp_fetch(
                *path.split("/"), method=method, body=body, headers=headers, follow_redirects=False
            )
        code = err.value.code
        location = err.value.response.headers.get("Location", "") if code == 302 else ""
        # API routes answer 403; the static file (a browser URL) redirects to the login page.
        assert code == 403 or "/login" in location, f"{method} {path}: {code} without login"
    # With the token, the same routes answer.
    code, body = await _json(jp_fetch, "nbdist", "api", "clusters")
    assert code == 200 and body == {"clusters": []}


async def test_runs_list_and_chart_series(jp_fetch, history):
    store = RunStore(history)
    run = store.new_run(world_size=2, backend="gloo")
    t0 = time.time()
    for rank in (0, 1):
        store.append(
            run.id,
            rank,
            [
                [
                    s,
                    t0 + s,
                    {
                        "loss": 2.0 - s / 10,
                        "samples": 64,
                        "samples_per_s": 50.0 + rank,
                        "comm_s": 0.0,
                    },
                ]
                for s in range(10)
            ],
        )
    store.commit()
    store.end_run(run.id)
    # A run whose kernel was killed before it could end it: no end time, and no cluster.
    orphan = store.new_run(world_size=1, backend="gloo")
    store.close()

    code, body = await _json(jp_fetch, "nbdist", "api", "runs")
    assert code == 200
    [record] = [r for r in body["runs"] if r["id"] == run.id]
    assert record["points"] == 20 and record["world_size"] == 2 and record["backend"] == "gloo"
    assert record["running"] is False and record["ended"] is not None
    [gone] = [r for r in body["runs"] if r["id"] == orphan.id]
    assert gone["running"] is False and gone["ended"] is None  # shown finished, not running

    code, chart = await _json(jp_fetch, "nbdist", "api", "runs", str(run.id))
    assert chart["running"] is False
    # The dashboard's panels: the user's key, then throughput; a counter is no chart, nor is
    # a metric that stayed 0 (no collectives: no communication time).
    assert chart["keys"] == ["loss", "samples_per_s"]
    assert chart["series"]["loss"]["1"][-1] == [9, pytest.approx(1.1)]
    loss, rate = chart["panels"]["loss"], chart["panels"]["samples_per_s"]
    assert (loss["xtitle"], loss["ytitle"], loss["by_time"]) == ("step", "loss", False)
    # Throughput against seconds since the run started, as on the dashboard.
    assert rate["ytitle"] == "samples/s" and rate["by_time"] is True
    assert rate["xtitle"] == "time since the run started (s)"
    x0, y0 = chart["series"]["samples_per_s"]["0"][0]
    assert y0 == 50.0 and x0 == pytest.approx(t0 - chart["started"], abs=1e-3)
    with pytest.raises(HTTPClientError) as err:
        await jp_fetch("nbdist", "api", "runs", "9999")
    assert err.value.code == 404


async def test_live_cluster_metrics_interrupt_and_dead_rank(jp_fetch, history):
    session = DistSession(2, cpu=True, timeout=120)
    await asyncio.to_thread(session.start)
    try:
        pids = [r.pid for r in session.ranks]
        await asyncio.to_thread(
            session.run,
            "for i in range(6):\n    nbdist.log(step=i, loss=1.0 / (i + 1), samples=8)",
        )
        [cluster] = await _clusters(jp_fetch)
        assert cluster["world_size"] == 2 and cluster["backend"] == "gloo"
        assert cluster["kernel_id"] is None  # started from a script, not a kernel
        assert [r["pid"] for r in cluster["ranks"]] == pids
        [entry] = registry.clusters()  # what the kernel side wrote, privately
        assert entry["connection_file"].endswith("-client.json")
        assert os.path.exists(entry["connection_file"])
        assert entry["kernel_pid"] == os.getpid() and entry["controller_pid"] in entry["pids"]
        assert os.stat(registry.registry_dir()).st_mode & 0o777 == 0o700
        assert os.stat(registry.registry_dir() + f"/{entry['id']}.json").st_mode & 0o777 == 0o600
        for row in cluster["ranks"]:
            assert row["step"] == 5 and row["loss"] == pytest.approx(1 / 6)
            assert row["samples_per_s"] > 0 and row["state"] in ("busy", "idle")
            assert [p[0] for p in row["loss_series"]] == list(range(6))
            assert row["points"] == 6
            assert row["memory_mib"] > 0
        assert (cluster["step_min"], cluster["step_max"]) == (5, 5) and cluster["dead"] == []
        assert cluster["rate_key"] == "samples_per_s"
        # The run in "Past runs" is running while its cluster lives.
        _, body = await _json(jp_fetch, "nbdist", "api", "runs")
        [record] = [r for r in body["runs"] if r["id"] == cluster["run_id"]]
        assert record["running"] is True
        # The next poll reads only what was stored since, and adds it.
        await asyncio.to_thread(
            session.run, "for i in range(6, 10):\n    nbdist.log(step=i, loss=0.5, samples=8)"
        )
        [cluster] = await _clusters(jp_fetch)
        for row in cluster["ranks"]:
            assert row["step"] == 9 and row["points"] == 10 and row["loss"] == 0.5
            assert [p[0] for p in row["loss_series"]] == list(range(10))

        # Interrupt from the sidebar: SIGINT to the engine PIDs stops a running cell. While it
        # runs, the cluster's rate is a number; once the ranks stop logging it is gone.
        run = session.run(
            "import time\nfor i in range(10, 610):\n"
            "    nbdist.log(step=i, samples=8)\n    time.sleep(0.1)",
            block=False,
        )
        await _wait_for(
            jp_fetch, lambda cs: cs and cs[0]["samples_per_s"] and cs[0]["step_min"] > 10
        )
        code, reply = await _json(
            jp_fetch, "nbdist", "api", "clusters", cluster["id"], "interrupt", method="POST"
        )
        assert code == 200 and sorted(reply["pids"]) == sorted(pids)
        with pytest.raises(RankError) as err:
            await asyncio.to_thread(run.wait)
        assert {f.ename for f in err.value.failures} == {"KeyboardInterrupt"}
        assert await asyncio.to_thread(session.pull, "rank") == [0, 1]  # ranks still usable
        await _wait_for(jp_fetch, lambda cs: cs[0]["samples_per_s"] is None)

        # Rank 1 steps 5x slower and logs 10 steps fewer: the sidebar flags it as the
        # dashboard does (same rule, same reason), and shows the range of steps.
        await asyncio.to_thread(
            session.run,
            "import time\nfor i in range(1000, 1030 if rank == 0 else 1020):\n"
            "    time.sleep(0.01 if rank == 0 else 0.05)\n    nbdist.log(step=i, samples=8)",
        )
        [cluster] = await _clusters(jp_fetch)
        assert (cluster["step_min"], cluster["step_max"]) == (1019, 1029)
        flags = {row["rank"]: row["straggler"] for row in cluster["ranks"]}
        dashboard = {row.rank: row.straggler for row in rank_rows(session.metrics)}
        assert flags[0] == "" and "step time" in flags[1], flags
        assert flags == dashboard

        # A rank whose process is stopped (SIGSTOP, Ctrl-Z) says so beside its state, and
        # goes back once continued (a debugger holding one: tests/unit/test_sidebar_held.py).
        [cluster] = await _clusters(jp_fetch)
        assert [r.get("process") for r in cluster["ranks"]] == [None, None]
        os.kill(pids[1], signal.SIGSTOP)
        try:
            await _wait_for(jp_fetch, lambda cs: cs[0]["ranks"][1].get("process") == "stopped")
        finally:
            os.kill(pids[1], signal.SIGCONT)
        await _wait_for(jp_fetch, lambda cs: "process" not in cs[0]["ranks"][1])
        assert await asyncio.to_thread(session.pull, "rank") == [0, 1]  # it went on

        # A rank killed outright shows as dead, and is not a straggler (nor on the dashboard).
        os.kill(pids[1], signal.SIGKILL)
        assert wait_gone([pids[1]]) == []
        [cluster] = await _clusters(jp_fetch)
        assert [r["state"] for r in cluster["ranks"]][1] == "dead"
        assert cluster["dead"] == [1] and cluster["ranks"][1]["straggler"] == ""
        assert (cluster["step_min"], cluster["step_max"]) == (1029, 1029)  # the live ranks'
        dashboard = rank_rows(session.metrics, {0: "idle", 1: "dead"})
        assert [(row.state, row.straggler) for row in dashboard][1] == ("dead", "")
    finally:
        await asyncio.to_thread(session.stop)
    assert await _clusters(jp_fetch) == []  # stop() removed its entry
    assert wait_gone(pids) == []
    _, body = await _json(jp_fetch, "nbdist", "api", "runs")
    [record] = [r for r in body["runs"] if r["id"] == cluster["run_id"]]
    assert record["running"] is False and record["ended"] is not None


async def test_palette_route_serves_the_dashboard_palette(jp_fetch):
    code, body = await _json(jp_fetch, "nbdist", "api", "palette")
    assert code == 200 and body == {"colours": rank_colours()}
    assert len(set(body["colours"])) == len(body["colours"]) >= 8


def test_subshell_messages_do_not_set_the_kernel_state(jp_serverapp, jp_web_app):
    """JupyterLab shows Idle on any status whose parent is not untracked: a widget's
    create_subshell_request (control channel) must not make a running kernel read Idle.
    The browser test samples the indicators themselves."""
    untracked = jp_serverapp.kernel_manager.untracked_message_types
    page = jp_web_app.settings["page_config_data"]["untracked_message_types"]
    for kind in ("create_subshell_request", "delete_subshell_request", "list_subshell_request"):
        assert kind in untracked and kind in page
    assert "execute_request" not in untracked and "execute_request" not in page


async def test_restart_and_stop_go_through_the_kernel(jp_fetch, jp_serverapp, history):
    async with _kernel(jp_fetch, jp_serverapp) as (kernel_id, client):
        reply = await client.execute_interactive(
            "%load_ext nbdist\n%dist_start 2 --cpu", timeout=180
        )
        assert reply["content"]["status"] == "ok", reply["content"]
        [cluster] = await _clusters(jp_fetch)
        assert cluster["kernel_id"] == kernel_id
        old_pids = [r["pid"] for r in cluster["ranks"]]

        code, body = await _json(
            jp_fetch, "nbdist", "api", "clusters", cluster["id"], "restart", method="POST"
        )
        assert code == 202 and body["via"] == "kernel"
        restarted = await _wait_for(jp_fetch, lambda cs: cs and cs[0]["id"] != cluster["id"])
        new_pids = [r["pid"] for r in restarted[0]["ranks"]]
        assert len(new_pids) == 2 and not set(new_pids) & set(old_pids)
        assert wait_gone(old_pids) == []
        reply = await client.execute_interactive(
            "%%on_all_ranks\nt = torch.ones(1); dist.all_reduce(t); assert t.item() == 2",
            timeout=60,
        )
        assert reply["content"]["status"] == "ok", reply["content"]

        code, body = await _json(
            jp_fetch, "nbdist", "api", "clusters", restarted[0]["id"], "stop", method="POST"
        )
        assert code == 202
        assert await _wait_for(jp_fetch, lambda cs: cs == []) == []
        assert wait_gone(new_pids) == []
        with pytest.raises(HTTPClientError) as err:  # it is gone: a clear 404
            await jp_fetch(
                "nbdist", "api", "clusters", restarted[0]["id"], "stop", method="POST", body=b"{}"
            )
        assert err.value.code == 404


async def _wait_for(jp_fetch, predicate, timeout: float = 90.0):
    deadline = time.monotonic() + timeout
    while True:
        clusters = await _clusters(jp_fetch)
        if predicate(clusters):
            return clusters
        if time.monotonic() > deadline:
            raise AssertionError(f"clusters did not change as expected in {timeout} s: {clusters}")
        await asyncio.sleep(0.3)


def test_registry_skips_entries_of_dead_kernels(tmp_path):
    folder = tmp_path / "reg"
    folder.mkdir()
    dead = psutil.Popen(["true"])
    dead.wait()
    for name, pid in (("cluster-1-0.json", dead.pid), ("cluster-2-0.json", os.getpid())):
        (folder / name).write_text(
            json.dumps({"format": registry.FORMAT, "kernel_pid": pid, "ranks": [], "started": 1})
        )
    assert [e["id"] for e in registry.clusters(str(folder))] == ["cluster-2-0"]
    assert not (folder / "cluster-1-0.json").exists()


def test_a_new_cluster_removes_the_entries_of_killed_kernels_without_a_server(
    tmp_path, monkeypatch
):
    # A kernel killed with SIGKILL leaves its entry; only a server listing the clusters
    # removed such entries, so kernels run without one gathered a file per killed kernel.
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    folder = registry.registry_dir(create=True)
    dead = psutil.Popen(["true"])
    dead.wait()
    stale = os.path.join(folder, "cluster-1-0.json")
    with open(stale, "w") as f:
        json.dump({"format": registry.FORMAT, "kernel_pid": dead.pid, "ranks": [], "started": 1}, f)
    session = DistSession(2, cpu=True, timeout=120).start()
    try:
        assert not os.path.exists(stale)
        assert len(os.listdir(folder)) == 1  # this session's own
    finally:
        session.stop()


async def test_interrupt_of_an_attached_cluster_goes_through_its_kernel(
    jp_fetch, jp_serverapp, history, external_cluster
):
    """Attached engines may be on other hosts: the sidebar's Interrupt interrupts the
    kernel, which relays SIGINT to every rank; the cell stops and the ranks stay usable."""
    client_file, _ = external_cluster
    async with _kernel(jp_fetch, jp_serverapp) as (kernel_id, client):
        reply = await client.execute_interactive(
            f"%load_ext nbdist\n%dist_start --connect {client_file} --cpu", timeout=180
        )
        assert reply["content"]["status"] == "ok", reply["content"]
        [cluster] = await _clusters(jp_fetch)
        assert cluster["kernel_id"] == kernel_id
        # stop_on_error=False: ipykernel would otherwise abort a request that reaches it
        # just after this cell's error (the next cell came back "aborted" once, under load).
        msg_id = client.execute(
            "%%on_all_ranks\nimport time\nfor step in range(1200):\n"
            "    nbdist.log(step=step, loss=1.0)\n    time.sleep(0.05)",
            stop_on_error=False,
        )
        # Interrupt once the sidebar shows both ranks training (attached ranks may be on
        # other hosts: their state comes from their metrics, not from local PIDs).
        await _wait_for(
            jp_fetch, lambda cs: cs and all(r["state"] == "busy" for r in cs[0]["ranks"]), 60
        )
        t0 = time.monotonic()
        code, body = await _json(
            jp_fetch, "nbdist", "api", "clusters", cluster["id"], "interrupt", method="POST"
        )
        assert code == 200 and body["via"] == "kernel"
        while True:
            reply = await client.get_shell_msg(timeout=60)
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        assert time.monotonic() - t0 < 30  # not the 60 s the loop would take
        assert reply["content"]["status"] == "error"
        assert "KeyboardInterrupt" in "\n".join(reply["content"]["traceback"])
        reply = await client.execute_interactive(
            "%%on_all_ranks\nt = torch.ones(1); dist.all_reduce(t); assert t.item() == 2",
            timeout=60,
        )
        assert reply["content"]["status"] == "ok", reply["content"]


async def test_interrupt_of_ranks_on_other_hosts_goes_through_their_kernel(
    jp_fetch, jp_serverapp, history, sshd, tmp_path
):
    """Ranks a launcher started elsewhere have PIDs that name other processes here: the
    sidebar's Interrupt goes through their kernel, as for attached engines, and stops the cell.

    Elsewhere, here: each rank over SSH in a PID namespace of its own (PID 1 there)."""
    why = own_pid_namespace_unavailable()
    if why:
        pytest.skip(f"needs a PID namespace of its own (root): {why}")
    wrapper = python_in_own_pid_namespace(tmp_path)
    async with _kernel(jp_fetch, jp_serverapp) as (kernel_id, client):
        reply = await client.execute_interactive(
            "%load_ext nbdist\n%dist_start --cpu --launcher ssh --hosts nbdist-ssh-test:2 "
            f'--launch-opt "ssh_args=-F {sshd.config}" --launch-opt python={wrapper}',
            timeout=180,
        )
        assert reply["content"]["status"] == "ok", reply["content"]
        [cluster] = await _clusters(jp_fetch)
        assert [r["pid"] for r in cluster["ranks"]] == [1, 1]
        # stop_on_error=False: as in the attached-cluster test above (ipykernel aborts a
        # request reaching it just after an error; %dist_stop came back "aborted" once).
        msg_id = client.execute(
            "%%on_all_ranks\nimport time\nfor step in range(1200):\n"
            "    nbdist.log(step=step, loss=1.0)\n    time.sleep(0.05)",
            stop_on_error=False,
        )
        # Their state comes from their metrics, not from PIDs here.
        await _wait_for(
            jp_fetch, lambda cs: cs and all(r["state"] == "busy" for r in cs[0]["ranks"]), 60
        )
        code, body = await _json(
            jp_fetch, "nbdist", "api", "clusters", cluster["id"], "interrupt", method="POST"
        )
        assert code == 200 and body == {"action": "interrupt", "via": "kernel", "pids": []}
        while True:
            reply = await client.get_shell_msg(timeout=60)  # not the 60 s the loop would take
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        assert reply["content"]["status"] == "error"
        assert "KeyboardInterrupt" in "\n".join(reply["content"]["traceback"])
        reply = await client.execute_interactive("%dist_stop", timeout=60)
        assert reply["content"]["status"] == "ok", reply["content"]
