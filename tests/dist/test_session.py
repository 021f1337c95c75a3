"""DistSession against real engines and a real gloo process group (2 CPU ranks)."""

from __future__ import annotations

import operator
import re
import time

import numpy as np
import pytest
import torch

import nbdist
from nbdist.driver.sinks import ListSink
from nbdist.errors import NbdistError, RankError


@pytest.fixture(scope="module")
def session():
    with nbdist.DistSession(2, cpu=True, timeout=120) as s:
        yield s


def lines(sink: ListSink) -> list[tuple[str, str, str]]:
    return [e[1:] for e in sink.events if e[0] == "line"]


def test_all_reduce_runs_on_every_rank(session):
    sink = ListSink()
    session.run("t = torch.ones(2) * rank\ndist.all_reduce(t)\nprint(rank, t)", sink=sink)
    assert lines(sink) == [
        ("stdout", "rank 0", "0 tensor([1., 1.])"),
        ("stdout", "rank 1", "1 tensor([1., 1.])"),
    ]
    assert [t.tolist() for t in session.pull("t")] == [[1.0, 1.0], [1.0, 1.0]]


def test_namespace_starts_with_the_rank_names(session):
    session.run(
        "names = sorted(n for n in ('torch','dist','nbdist','rank','local_rank','world_size','device') if n in globals())"
    )
    assert (
        session.pull("names")
        == [sorted(["torch", "dist", "nbdist", "rank", "local_rank", "world_size", "device"])] * 2
    )
    session.run(
        "info = (rank, local_rank, world_size, str(device), nbdist.rank(), nbdist.world_size())"
    )
    assert session.pull("info") == [(0, 0, 2, "cpu", 0, 2), (1, 1, 2, "cpu", 1, 2)]


def test_reset_clears_the_users_names_and_keeps_the_ranks(session):
    """%reset -f on the ranks (to free memory) cleared rank, dist, torch and nbdist too, and
    every later cell using them failed with "NameError: name 'rank' is not defined"."""
    session.run("mine = rank + 100\ndel world_size")
    session.run("%reset -f")
    session.run(
        "gone = 'mine' not in globals()\n"
        "info = (rank, local_rank, world_size, str(device), nbdist.rank())\n"
        "t = torch.ones(1)\ndist.all_reduce(t)"
    )
    assert session.pull("gone") == [True, True]
    assert session.pull("info") == [(0, 0, 2, "cpu", 0), (1, 1, 2, "cpu", 1)]
    assert [t.item() for t in session.pull("t")] == [2.0, 2.0]
    # %who lists the user's names only; a soft reset (it deletes those) keeps the rank's.
    session.run("%reset -f\nmine = 1\nnames = get_ipython().run_line_magic('who_ls', '')")
    assert session.pull("names") == [["mine"], ["mine"]]
    session.run("%reset -f -s")
    session.run("gone = 'mine' not in globals()\nleft = (rank, world_size, nbdist.rank())")
    assert session.pull("gone") == [True, True]
    assert session.pull("left") == [(0, 2, 0), (1, 2, 1)]


def test_a_session_started_on_the_ranks_is_refused_and_starts_nothing(session):
    """%dist_start pasted into %%on_all_ranks made every rank start ranks of its own."""
    children = session.pull("len(__import__('psutil').Process().children(recursive=True))")
    session.run("%load_ext nbdist")
    for cell in ("%dist_start 2 --cpu", "s = nbdist.DistSession(2, cpu=True)"):
        with pytest.raises(RankError) as info:
            session.run(cell)
        assert [(f.rank, f.ename) for f in info.value.failures] == [
            (0, "NbdistError"),
            (1, "NbdistError"),
        ], cell
        assert info.value.failures[1].evalue.startswith(
            "a session cannot start on a rank (this is rank 1 of 2, "
        )
        assert "run %dist_start (or DistSession) in the notebook's own cells" in str(info.value)
    assert session.pull("len(__import__('psutil').Process().children(recursive=True))") == children


def test_state_persists_between_cells(session):
    session.run("counter = rank * 10")
    session.run("counter += 1")
    assert session.pull("counter") == [1, 11]
    assert session.pull("counter", rank=1) == 11


def test_ranks_collect_their_own_cyclic_garbage(session):
    """The zygote imports torch with the cyclic collector off and freezes what it imported
    before forking; each rank must collect its own cycles again, unprompted (a rank that
    never did would grow with every cell)."""
    session.run(
        """
import gc, weakref
class Node:
    pass
a, b = Node(), Node()
a.other, b.other = b, a  # a cycle: only the collector frees it
alive = weakref.ref(a)
del a, b
# Containers kept alive (as a training loop keeps losses, batches): allocations alone
# trigger collections, 100,000 of them well over the young generations' thresholds.
kept = [[] for _ in range(100_000)]
del kept
gc_state = (gc.isenabled(), gc.get_freeze_count() > 0, alive() is None)
"""
    )
    # Enabled, the zygote's imports frozen (the default fork start), the cycle gone.
    assert session.pull("gc_state") == [(True, True, True)] * 2


def test_identical_output_is_shown_once(session):
    sink = ListSink()
    session.run("print('same on every rank')\nprint('rank says', rank)", sink=sink)
    assert lines(sink) == [
        ("stdout", "ranks 0-1", "same on every rank"),
        ("stdout", "rank 0", "rank says 0"),
        ("stdout", "rank 1", "rank says 1"),
    ]


def test_what_forked_children_print_reaches_the_notebook_in_whole_lines(session):
    # DataLoader workers and fork processes wrote on a zmq socket a fork cannot use: every
    # line was lost. Two workers' prints (text, then newline) also arrived interleaved.
    session.run(
        "import multiprocessing as mp, sys\n"
        "import torch.utils.data as tud\n"
        "class Items(tud.Dataset):\n"
        "    def __len__(self):\n"
        "        return 8\n"
        "    def __getitem__(self, i):\n"
        "        print('item', i, 'of a worker of rank', rank)\n"
        "        return i\n"
        "for _ in tud.DataLoader(Items(), num_workers=2, batch_size=2):\n"
        "    pass\n"
        # A last line without its newline goes out with the child's flush at its end.
        "child = mp.get_context('fork').Process(\n"
        "    target=print, args=('a fork child of rank', rank), kwargs={'end': '', 'file': sys.stderr})\n"
        "child.start()\n"
        "child.join()\n",
        sink=ListSink(),
    )
    for rank in (0, 1):
        printed = nbdist.output(rank, "stdout").splitlines()
        assert sorted(printed) == sorted(f"item {i} of a worker of rank {rank}" for i in range(8))
        assert nbdist.output(rank, "stderr") == f"a fork child of rank {rank}\n"


def test_nbdist_log_in_a_forked_child_records_nothing_and_says_so_once(session):
    # The child's copy of the rank's channel has no flush thread: its points were lost
    # without a word (and a buffer lock held at the fork would have hung the child).
    before = session.metrics.count()
    session.run(
        "import multiprocessing as mp\n"
        "def child():\n"
        "    for i in range(3):\n"
        "        nbdist.log(step=i, loss=1.0)\n"
        "proc = mp.get_context('fork').Process(target=child)\n"
        "proc.start()\n"
        "proc.join()\n"
        "nbdist.log(step=0, loss=2.0)\n"
        "code = proc.exitcode\n",
        sink=ListSink(),
    )
    for rank in (0, 1):
        said = nbdist.output(rank, "stderr")
        assert said.count("nbdist.log records nothing in a process forked from a rank") == 1
    assert session.pull("code") == [0, 0]
    assert session.metrics.count() == before + 2  # each rank's own point, no child's


def test_stderr_and_selected_ranks(session):
    sink = ListSink()
    session.run("import sys; print('warn', rank, file=sys.stderr)", ranks="1", sink=sink)
    assert lines(sink) == [("stderr", "rank 1", "warn 1")]


def test_an_error_on_one_rank_fails_the_run_and_names_it(session):
    with pytest.raises(RankError) as info:
        session.run("x = 1 / (rank - 1)", sink=ListSink())
    err = info.value
    assert err.ranks == [1]
    assert "rank 1: ZeroDivisionError" in str(err)
    # The other rank's work happened.
    assert session.pull("x", rank=0) == -1.0


def test_identical_errors_are_grouped(session):
    with pytest.raises(RankError) as info:
        session.run("raise ValueError('bad batch')", sink=ListSink())
    assert str(info.value).splitlines()[0] == "ranks 0-1: ValueError: bad batch"
    assert len(info.value.groups()) == 1


def test_an_error_naming_its_rank_is_one_error_with_one_traceback(session):
    """The ranks' real tracebacks (IPython's, with the message in colour) are alike but for the
    message's numbers: one traceback under both ranks' lines."""
    with pytest.raises(RankError) as info:
        session.run(
            "raise ValueError(f'bad batch on rank {rank}: {10 * rank + 3} rows')", sink=ListSink()
        )
    assert str(info.value) == (
        "rank 0: ValueError: bad batch on rank 0: 3 rows\n"
        "rank 1: ValueError: bad batch on rank 1: 13 rows"
    )
    rendered = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(info.value._render_traceback_()))
    assert rendered.count("raise ValueError") == 1, rendered
    assert "the traceback is rank 0's" in rendered


def test_push_and_apply(session):
    session.push({"lr": 0.5})
    assert session.pull("lr") == [0.5, 0.5]
    # Functions from importable modules run by reference on the ranks.
    assert session.apply(operator.add, 2, 3) == [5, 5]
    assert session.apply(divmod, 7, 2, ranks=[1]) == [(3, 1)]


def test_pull_of_a_missing_name_is_a_rank_error(session):
    with pytest.raises(RankError, match="NameError"):
        session.pull("no_such_variable_here")


def test_bad_rank_selection_is_refused(session):
    with pytest.raises(nbdist.PlacementError, match="rank 5 does not exist"):
        session.run("pass", ranks="5")
    # NumPy's integers are rank numbers (an array of them too); a float is refused.
    session.run("y = rank * 10", sink=ListSink())
    assert session.pull("y", rank=np.int64(1)) == 10
    assert session.apply(abs, -1, ranks=np.array([0, 1])) == [1, 1]
    with pytest.raises(nbdist.PlacementError, match=r"ranks 1.5: give whole rank numbers"):
        session.run("pass", ranks=1.5)


@pytest.mark.parametrize(
    "call, error, message",
    [
        # Before: it waited for ever.
        (lambda s: s.run(None), TypeError, r"code must be a str of Python source, got None"),
        # Before: base64 text ran on the ranks.
        (lambda s: s.run(b"x = 1"), TypeError, r"got b'x = 1' \(a bytes\): decode it first"),
        (
            lambda s: s.run("x = 1", timeout=-1),
            nbdist.PlacementError,
            r"timeout must be a positive",
        ),
        (lambda s: s.run("x = 1", timeout="a"), nbdist.PlacementError, r"got 'a'"),
        # Before: a SyntaxError, then a TypeError, on every rank.
        (lambda s: s.push({"1a": 1}), nbdist.PlacementError, r"'1a' is no Python name"),
        (lambda s: s.push({1: 1}), nbdist.PlacementError, r"1 is no Python name"),
        (lambda s: s.push({"class": 1}), nbdist.PlacementError, r"'class' is no Python name"),
        (lambda s: s.run("x = 1", timeout=True), nbdist.PlacementError, r"got True"),
        (lambda s: s.run("x = 1", ranks=b"0,1"), nbdist.PlacementError, r"give whole rank"),
        (lambda s: s.push(None), TypeError, r"give a dict of names to values"),
        # Before: rank 0's value alone, as if one rank had been asked for.
        (lambda s: s.pull("y", rank=[0, 1]), nbdist.PlacementError, r"rank=\[0, 1\] is not one"),
        (lambda s: s.pull("y", rank="0-1"), nbdist.PlacementError, r"rank='0-1' is not one"),
        # Before: the ranks' kernels failed the cell without a reply; it waited for ever.
        (
            lambda s: s.run("import asyncio\ny = 1\nawait asyncio.sleep(0)"),
            ValueError,
            r"awaits at its top level \(line 3\).*ThreadPoolExecutor\(1\)\.submit\(asyncio\.run",
        ),
        (lambda s: s.run("y = [v async for v in g()]"), ValueError, r"top level \(line 1\)"),
    ],
)
def test_what_run_push_and_pull_are_given_is_checked_in_the_kernel(session, call, error, message):
    session.run("y = rank * 10", sink=ListSink())
    with pytest.raises(error, match=message):
        call(session)
    assert session.pull("y") == [0, 10]  # nothing reached the ranks


def test_a_ranks_first_prompt_is_kept_until_the_cell_is_followed(session):
    """A rank can ask for input before the kernel has built the cell's RankRun (pdb right
    after %dist_debug): the request is kept, not lost, and the rank gets its answer."""
    from nbdist.driver.cells import cell_channel
    from nbdist.driver.early_iopub import EarlyIopub
    from nbdist.driver.ipp_internals import send_control
    from nbdist.engine.stdin_bridge import INPUT_REPLY, INPUT_REQUEST

    ranks = session.select(None)
    early = EarlyIopub()
    ar = cell_channel(session.client).execute(
        [r.engine_id for r in ranks],
        "print('asking', flush=True)\nanswer = input('name? ')",
        iopub_callbacks=[early.callback(r.rank) for r in ranks],
    )
    # The kernel is busy elsewhere until every rank has asked (its print comes just before).
    deadline = time.monotonic() + 60
    while not all("asking" in (out or "") for out in ar.stdout):
        assert time.monotonic() < deadline, ar.stdout
        time.sleep(0.05)
    time.sleep(0.5)
    requests: dict[int, dict] = {}
    early.attach(
        lambda rank, msg: (
            requests.setdefault(rank, msg["content"])
            if msg["header"]["msg_type"] == INPUT_REQUEST
            else None
        )
    )
    while len(requests) < len(ranks):
        assert time.monotonic() < deadline, requests
        time.sleep(0.05)
    assert {rank: r["prompt"] for rank, r in requests.items()} == {
        0: "[rank 0] name? ",
        1: "[rank 1] name? ",
    }
    for r in ranks:
        content = {"id": requests[r.rank]["id"], "value": f"n{r.rank}"}
        send_control(session.client, r.engine_id, INPUT_REPLY, content)
    ar.get(timeout=60)
    assert session.pull("answer") == ["n0", "n1"]


def test_requests_sent_just_before_their_client_closes_still_reach_the_ranks(session):
    """What a kernel letting go of a named session does after a --noblock cell: without
    the flush, the client closed before its request left (19 times in 20 here)."""
    import ipyparallel as ipp

    from nbdist.driver.ipp_internals import flush_sends

    engine_ids = [r.engine_id for r in session.ranks]
    for i in range(5):
        client = ipp.Client(session.cluster.client_file(), timeout=60)
        client[engine_ids].execute(f"sent_{i} = {i} + rank", block=False)
        assert flush_sends(client)
        client.close()
    # Delivered by zmq after the close: wait for them (a lost one never comes).
    deadline = time.monotonic() + 30
    while True:
        try:
            assert [session.pull(f"sent_{i}") for i in range(5)] == [[i, i + 1] for i in range(5)]
            break
        except RankError:
            assert time.monotonic() < deadline, "a request sent before its client closed was lost"
            time.sleep(0.2)
    closed = ipp.Client(session.cluster.client_file(), timeout=60)
    closed.close()
    assert flush_sends(closed) is False  # nothing to flush on a closed client


def test_cell_timeout_interrupts(session):
    with pytest.raises(NbdistError, match="--timeout"):
        session.run("import time\ntime.sleep(60)", timeout=1.0, sink=ListSink())
    session.run("still = 2")
    assert session.pull("still") == [2, 2]


def test_rank_helpers_on_ranks(session):
    sink = ListSink()
    session.run(
        "nbdist.print0('only once')\n"
        "s = nbdist.seed_all(7)\n"
        "with nbdist.rank_zero_first():\n"
        "    order = time.monotonic() if 'time' in globals() else 0\n",
        sink=sink,
    )
    assert lines(sink) == [("stdout", "rank 0", "only once")]
    assert session.pull("s") == [7, 8]


def test_ddp_matches_single_process_on_the_full_batch(session):
    """Two DDP ranks on half-batches give the parameters of one process on the whole batch."""
    code = """
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = nn.Linear(4, 1)
ddp = DDP(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
g = torch.Generator().manual_seed(1)
X, Y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
for _ in range(3):
    opt.zero_grad()
    loss = nn.functional.mse_loss(ddp(X[rank::2]), Y[rank::2])
    loss.backward()
    opt.step()
weights = [p.detach().clone() for p in model.parameters()]
"""
    session.run(code)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    X, Y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
    for _ in range(3):
        opt.zero_grad()
        # Mean of the two ranks' mean losses == the mean over the interleaved full batch.
        loss = (
            torch.nn.functional.mse_loss(model(X[0::2]), Y[0::2])
            + torch.nn.functional.mse_loss(model(X[1::2]), Y[1::2])
        ) / 2
        loss.backward()
        opt.step()
    for weights in session.pull("weights"):
        for got, want in zip(weights, model.parameters()):
            torch.testing.assert_close(got, want.detach())


def test_status_rows(session):
    rows = session.status()
    assert [r["rank"] for r in rows] == [0, 1]
    assert {r["state"] for r in rows} == {"idle"}
    assert all(r["backend"] == "gloo" and r["device"] == "cpu" for r in rows)
    assert all(r["memory_mib"] > 10 for r in rows)


def test_status_says_busy_while_a_cell_runs_and_idle_once_it_ended(session):
    # The status asks the controller again where it still counts a finished cell's work
    # (the replies can arrive first): that must not hide a cell that really runs.
    run = session.run(
        "import time\ntime.sleep(3 if rank == 1 else 0)", block=False, sink=ListSink()
    )
    try:
        busy = {r["rank"]: r["state"] for r in session.status()}
    finally:
        run.wait()
    assert busy[1] == "busy", busy
    assert {r["state"] for r in session.status()} == {"idle"}


def test_starting_a_running_session_is_refused(session):
    with pytest.raises(NbdistError, match="already runs 2 ranks"):
        session.start()


def test_rich_display_and_progress_bars_from_ranks(session):
    sink = ListSink()
    session.run(
        "from IPython.display import display, HTML\n"
        "display(HTML('<b>hi</b>'))\n"
        "import sys\n"
        "for i in range(3):\n"
        "    sys.stderr.write(f'\\rstep {i}/3'); sys.stderr.flush()\n"
        "sys.stderr.write('\\rdone 3/3\\n');\n",  # ';': no cell value
        sink=sink,
    )
    displays = [e for e in sink.events if e[0] == "display"]
    assert len(displays) == 1  # identical on both ranks: shown once
    assert displays[0][1] == "ranks 0-1"
    assert displays[0][2]["text/html"] == "<b>hi</b>"
    # The \r progress line ends as one final line, not one line per update.
    assert lines(sink) == [("stderr", "ranks 0-1", "done 3/3")]


def test_a_last_expression_is_shown_after_cells_that_show_nothing(session):
    """Cells with nothing to show are sent silent (cheaper); one that ends with an
    expression still shows its value, per rank."""
    for _ in range(3):
        session.run("quiet = rank")
    sink = ListSink()
    session.run("quiet * 10", sink=sink)
    shown = [(e[1], e[2]["text/plain"]) for e in sink.events if e[0] == "display"]
    assert shown == [("rank 0", "0"), ("rank 1", "10")]


def test_the_ranks_own_display_setting_is_respected(session):
    """With ``ast_node_interactivity = 'all'`` on the ranks, every expression statement
    shows its value: a cell ending in an assignment is then no longer one that shows nothing."""
    session.run("get_ipython().ast_node_interactivity = 'all'")
    try:
        session.run("quiet = 1")  # the ranks' replies now say 'all'
        sink = ListSink()
        session.run("rank + 100\nquiet = 2", sink=sink)
        shown = [(e[1], e[2]["text/plain"]) for e in sink.events if e[0] == "display"]
        assert shown == [("rank 0", "100"), ("rank 1", "101")]
    finally:
        session.run("get_ipython().ast_node_interactivity = 'last_expr'")


def test_a_rank_can_import_debugpy_to_attach_a_debugger(session):
    """The zygote keeps debugpy out of ipykernel's start-up; a rank that wants it still gets it."""
    session.run("import debugpy\nhas_listen = callable(debugpy.listen)")
    assert session.pull("has_listen") == [True, True]


def test_the_rank_patches_are_in_place_once_and_installing_again_changes_nothing(session):
    """Every patch of nbdist.engine.patches is on the ranks, each wrapping the original once."""
    names = (
        "(k.do_execute, k.raw_input, k.getpass, pdb.Pdb, dist.all_reduce, dist.send,"
        " get_ipython().ask_exit, get_ipython().reset, sys.stdout.flush)"
    )
    session.run(
        "import pdb, sys\n"
        "from nbdist.engine import child_output, patches, stdin_bridge\n"
        "k = get_ipython().kernel\n"
        f"before = {names}\n"
        "patches.install_on_rank(k, get_ipython())\n"
        "patches.install_on_group(stage_p2p=False)\n"
        f"unchanged = before == {names}\n"
        "in_place = (pdb.Pdb is stdin_bridge.RankPdb, 'nbdist_request' in k.control_handlers,\n"
        "            not hasattr(k.do_execute.nbdist_plain, 'nbdist_plain'),\n"
        "            not hasattr(dist.all_reduce.nbdist_original, 'nbdist_original'),\n"
        "            not hasattr(get_ipython().ask_exit.nbdist_original, 'nbdist_original'),\n"
        "            not hasattr(get_ipython().reset.nbdist_original, 'nbdist_original'),\n"
        "            child_output.pipe_open(k.iopub_thread or k.iopub_socket),\n"
        "            not hasattr(sys.stdout.flush.nbdist_original, 'nbdist_original'))"
    )
    assert session.pull("unchanged") == [True, True]
    assert session.pull("in_place") == [(True,) * 8] * 2
    session.run("t = torch.ones(1)\ndist.all_reduce(t)")
    assert [t.item() for t in session.pull("t")] == [2.0, 2.0]


def test_a_fresh_rank_formats_its_first_traceback_with_what_the_zygote_prepared():
    """A rank's first error imports no module and finds inspect's module cache filled.

    At 256 ranks, what each rank did at its first error (stack_data and pygments imported,
    inspect's walk of every module: ~20 ms of CPU a rank) made the cell that failed take
    seconds longer, while the ranks still running were watched.
    """
    with nbdist.DistSession(1, cpu=True, timeout=120, history=False) as fresh:
        fresh.run(
            "import inspect, sys\n"
            "before = set(sys.modules)\n"
            "walked = all(m in inspect._filesbymodname for m in ('torch', 'stack_data'))",
            sink=ListSink(),
        )
        with pytest.raises(RankError, match="NameError"):
            fresh.run("undefined_name", sink=ListSink())
        fresh.run("imported = sorted(set(sys.modules) - before)", sink=ListSink())
        assert fresh.pull("walked") == [True]
        assert fresh.pull("imported") == [[]]


def test_async_code_runs_on_the_ranks_as_the_refusal_says(session):
    """What the refusal of a top-level await proposes works on a rank, and awaits inside a
    function a cell only defines are not refused."""
    session.run(
        "import asyncio, concurrent.futures\n"
        "async def main():\n"
        "    await asyncio.sleep(0.01)\n"
        "    return rank + 7\n"
        "got = concurrent.futures.ThreadPoolExecutor(1).submit(asyncio.run, main()).result()",
        sink=ListSink(),
    )
    assert session.pull("got") == [7, 8]


def test_what_ranks_print_after_the_cell_goes_to_the_script_labelled(session, tmp_path, capfd):
    go = tmp_path / "go"
    session.run(
        "import os, threading, time\n"
        "def late():\n"
        f"    while not os.path.exists({str(go)!r}):\n        time.sleep(0.05)\n"
        "    print('late from', rank, flush=True)\n"
        "    print('stderr too', file=sys.stderr, flush=True)\n"
        "import sys\nthreading.Thread(target=late, daemon=True).start()",
        sink=ListSink(),
    )
    go.touch()
    out = err = ""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not ("rank 1" in out and "stderr too" in err):
        time.sleep(0.2)
        captured = capfd.readouterr()
        out, err = out + captured.out, err + captured.err
    assert sorted(out.splitlines()) == ["[rank 0] late from 0", "[rank 1] late from 1"], out
    # Identical lines are grouped when they come within a moment of each other (a
    # terminal cannot redraw): one line for both ranks, or one each.
    assert err.splitlines() in (
        ["[ranks 0-1] stderr too"],
        ["[rank 0] stderr too", "[rank 1] stderr too"],
        ["[rank 1] stderr too", "[rank 0] stderr too"],
    ), err
    # ipyparallel's client kept every late chunk of a finished request, for good.
    kept = [v for v in session.client.metadata.values() if isinstance(v, dict)]
    assert not any(v.get("stdout") or v.get("stderr") for v in kept), kept


def test_a_child_forked_in_an_earlier_cell_prints_between_cells_labelled(session, tmp_path, capfd):
    # A persistent DataLoader worker's case: forked in one cell, printing after later ones.
    go = tmp_path / "go"
    session.run(
        "import multiprocessing, os, time\n"
        "def work():\n"
        f"    while not os.path.exists({str(go)!r}):\n        time.sleep(0.05)\n"
        "    print('child of', rank, flush=True)\n"
        "child = multiprocessing.get_context('fork').Process(target=work)\nchild.start()",
        sink=ListSink(),
    )
    session.run("x = 1", sink=ListSink())
    go.touch()
    out = ""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and out.count("child of") < 2:
        time.sleep(0.2)
        out += capfd.readouterr().out
    session.run("child.join(30)", sink=ListSink())
    assert sorted(out.splitlines()) == ["[rank 0] child of 0", "[rank 1] child of 1"], out
