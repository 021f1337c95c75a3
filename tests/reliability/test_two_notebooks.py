"""Two notebooks on one machine, each with its own cluster, and a port already taken.

Both kernels run ``%dist_start 2`` at the same time, with ``MASTER_PORT`` set to
a port something else listens on (torchrun's default, as a user's environment
may have it). nbdist never relies on a fixed port: ipyparallel's controller
takes ports the OS reports free and rank 0 opens the rendezvous socket on an
OS-chosen port, so the taken port is not used and the clusters never meet.
The same two notebooks show that, in the default setup, every socket nbdist
listens on is on loopback and the connection files are private.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import stat
import time

import psutil
import pytest

from tests.reliability.conftest import EnvKernel, survivors

TORCHRUN_PORT = 29500


@pytest.fixture(scope="module")
def taken_port():
    """A port something else listens on (torchrun's default if free, else any)."""
    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", TORCHRUN_PORT))
    except OSError:
        sock.bind(("127.0.0.1", 0))
    sock.listen()
    yield sock.getsockname()[1]
    sock.close()


@pytest.fixture(scope="module")
def notebooks(taken_port):
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(taken_port))
    kernels: list[EnvKernel] = []
    try:
        for _ in range(2):
            kernels.append(EnvKernel(env))
        for kernel in kernels:
            kernel.ok("%load_ext nbdist")
        # Both start at once: their controllers pick ports at the same moment.
        starts = [kernel.submit("%dist_start 2 --cpu") for kernel in kernels]
        for kernel, msg_id in zip(kernels, starts):
            outputs, _ = kernel.collect(msg_id, timeout=240)
            reply = kernel.reply(msg_id, timeout=60)
            text = "".join(m["content"].get("text", "") for m in outputs)
            assert reply["status"] == "ok", f"%dist_start failed: {reply} {text}"
            assert "nbdist: 2 ranks ready" in text
        yield kernels
    finally:
        for kernel in kernels:
            kernel.shutdown()


def _value(kernel, expression: str):
    import ast

    return ast.literal_eval(kernel.ok(f"print(repr({expression}))").stdout.strip())


def test_a_taken_master_port_is_not_used(notebooks, taken_port):
    for kernel in notebooks:
        kernel.ok("%%on_all_ranks\nimport os\n_port = int(os.environ['MASTER_PORT'])")
        ports = _value(kernel, "get_ipython().run_line_magic('dist_pull', '_port')")
        assert len(set(ports)) == 1 and ports[0] != taken_port, ports
    rendezvous = [
        _value(k, "get_ipython().run_line_magic('dist_pull', '_port')")[0] for k in notebooks
    ]
    assert rendezvous[0] != rendezvous[1]


def test_the_two_clusters_do_not_interfere(notebooks):
    a, b = notebooks
    pids = [set(k.nbdist_pids()) for k in notebooks]
    assert not pids[0] & pids[1]
    dirs = [_value(k, "nbdist.current_session().cluster.profile_dir") for k in notebooks]
    assert dirs[0] != dirs[1]
    # Each group reduces over its own two ranks only.
    for kernel, base in ((a, 1.0), (b, 10.0)):
        kernel.ok(
            f"%%on_all_ranks\nt = torch.tensor([{base} + rank])\ndist.all_reduce(t)\ns = t.item()"
        )
    assert _value(a, "get_ipython().run_line_magic('dist_pull', 's')") == [3.0, 3.0]
    assert _value(b, "get_ipython().run_line_magic('dist_pull', 's')") == [21.0, 21.0]
    # Stopping one cluster leaves the other whole and working.
    a.ok("%dist_stop")
    assert survivors(pids[0], until=time.monotonic() + 15) == []
    assert all(psutil.pid_exists(p) for p in pids[1])
    b.ok("%%on_all_ranks\nt = torch.ones(1)\ndist.all_reduce(t)\ns = t.item()")
    assert _value(b, "get_ipython().run_line_magic('dist_pull', 's')") == [2.0, 2.0]
    a.ok("%dist_start 2 --cpu")  # and the stopped one starts again beside it
    a.ok("%%on_all_ranks\nt = torch.ones(1) * 5\ndist.all_reduce(t)\ns = t.item()")
    assert _value(a, "get_ipython().run_line_magic('dist_pull', 's')") == [10.0, 10.0]


def _loopback(ip: str) -> bool:
    return ipaddress.ip_address(ip.split("%")[0]).is_loopback


def test_nothing_listens_beyond_loopback(notebooks):
    listening, beyond = [], []
    for kernel in notebooks:
        # Metrics flowing: the kernel's collector socket is open too.
        kernel.ok("%%on_all_ranks\nfor i in range(3):\n    nbdist.log(step=i, loss=1.0 / (i + 1))")
        for pid in [kernel.pid, *kernel.descendants()]:
            try:
                conns = psutil.Process(pid).net_connections(kind="inet")
            except psutil.NoSuchProcess:
                continue
            for c in conns:
                bound = c.status == psutil.CONN_LISTEN or (
                    c.type == socket.SOCK_DGRAM and not c.raddr
                )
                if not bound:
                    continue
                listening.append((pid, c.laddr))
                if not _loopback(c.laddr.ip):
                    beyond.append((pid, c.laddr, psutil.Process(pid).cmdline()[:4]))
    # The scan sees nbdist's sockets (controller, engines, collector) ...
    assert len(listening) >= 10, listening
    # ... and none of them beyond loopback.
    assert beyond == [], f"sockets listening beyond loopback: {beyond}"


def test_connection_files_are_private(notebooks):
    for kernel in notebooks:
        profile = _value(kernel, "nbdist.current_session().cluster.profile_dir")
        security = os.path.join(profile, "security")
        assert stat.S_IMODE(os.stat(profile).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(security).st_mode) == 0o700
        files = [f for f in os.listdir(security) if f.endswith(".json")]
        assert files, "no connection files found"
        for name in files:
            mode = stat.S_IMODE(os.stat(os.path.join(security, name)).st_mode)
            assert mode == 0o600, f"{name}: {oct(mode)}"


def test_a_profile_whose_fixed_port_is_taken_fails_fast_naming_it(taken_port, tmp_path):
    """A named profile may pin the controller's ports; when one is taken nbdist says so at once.

    (With nbdist's own private profile nothing is pinned: a port taken between the
    OS choosing it and the controller binding it makes a fresh controller pick others.)
    """
    from IPython.core.profiledir import ProfileDir
    from IPython.paths import get_ipython_dir

    import nbdist
    from nbdist.errors import NbdistError

    name = f"pinned-{os.getpid()}"
    profile = ProfileDir.create_profile_dir_by_name(get_ipython_dir(), name)
    with open(os.path.join(profile.location, "ipcontroller_config.py"), "w") as f:
        f.write(f"c.IPController.ports = [{taken_port}]\n")
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(NbdistError) as info:
        nbdist.DistSession(2, cpu=True, profile=name, timeout=60).start()
    message = str(info.value)
    assert "a port it was given is taken" in message and str(taken_port) in message, message
    assert "Address already in use" in message
    # Nothing it started is left.
    after = {p.pid for p in psutil.Process().children(recursive=True)} - before
    assert survivors(after, until=time.monotonic() + 10) == []
