"""The line a rank's death gets from faulthandler's record (nbdist.driver.crash_stack): pure parsing."""

from __future__ import annotations

from nbdist.driver.crash_stack import ABORTED_IN_COLLECTIVE, summary

SITE = "/venv/lib/python3.12/site-packages"
RUN_CODE = f'  File "{SITE}/IPython/core/interactiveshell.py", line 3577 in run_code'


def test_the_crashed_threads_innermost_frames_and_the_cell_line():
    dump = f"""Fatal Python error: Segmentation fault

Thread 0x00007f01 (most recent call first):
  File "{SITE}/zmq/sugar/socket.py", line 800 in recv_multipart
  File "/usr/lib/python3.12/threading.py", line 1010 in run

Current thread 0x00007f00 (most recent call first):
  File "{SITE}/torch/_ops.py", line 872 in redispatch
  File "{SITE}/torch/distributed/_functional_collectives.py", line 203 in all_gather_tensor
  File "{SITE}/torch/distributed/tensor/placement_types.py", line 391 in _to_replicate_tensor
  File "{SITE}/torch/distributed/tensor/_api.py", line 670 in full_tensor
  File "/tmp/ipykernel_4242/2718.py", line 2 in <module>
{RUN_CODE}

Extension modules: numpy._core._multiarray_umath, torch._C (total: 2)
"""
    assert summary(dump) == (
        "in redispatch (torch/_ops.py:872) <- all_gather_tensor "
        "(torch/distributed/_functional_collectives.py:203) <- _to_replicate_tensor "
        "(torch/distributed/tensor/placement_types.py:391), from the cell, line 2"
    )


def _crashed_outside_python(fatal: str, path: str, line: int, func: str, cell_line: int) -> str:
    """A dump with no "Current thread" (gloo's own thread crashed): ``fatal`` ('Aborted'), and
    the cell's thread (the one in run_code) waiting in ``func`` at ``path:line``."""
    return f"""Fatal Python error: {fatal}

Thread 0x00007f01 (most recent call first):
  File "/usr/lib/python3.12/threading.py", line 355 in wait

Thread 0x00007f00 (most recent call first):
  File "{SITE}/{path}", line {line} in {func}
  File "/tmp/ipykernel_4242/2718.py", line {cell_line} in <module>
{RUN_CODE}
"""


def test_a_crash_outside_python_names_where_the_cells_thread_waited():
    dump = _crashed_outside_python(
        "Segmentation fault", "torch/distributed/_functional_collectives.py", 138, "wait_tensor", 5
    )
    assert summary(dump) == (
        "a thread without Python frames crashed while the cell's thread was in wait_tensor "
        "(torch/distributed/_functional_collectives.py:138), from the cell, line 5"
    )


def test_an_abort_from_a_thread_of_its_own_in_a_collective_says_what_aborts_there():
    def dump(fatal: str, path: str = "torch/distributed/distributed_c10d.py") -> str:
        return _crashed_outside_python(fatal, path, 3252, "all_reduce", 2)

    where = (
        "a thread without Python frames crashed while the cell's thread was in all_reduce "
        "(torch/distributed/distributed_c10d.py:3252), from the cell, line 2"
    )
    aborted = summary(dump("Aborted"))
    assert aborted == f"{where}: {ABORTED_IN_COLLECTIVE}"
    assert "--check-collectives" in aborted
    # Another signal, or an abort outside a collective, is not said to be one of those.
    assert summary(dump("Segmentation fault")) == where
    assert "gloo" not in summary(dump("Aborted", path="numpy/linalg.py"))


def test_a_crash_in_the_cell_itself_and_a_dump_that_names_nothing():
    dump = f"""Current thread 0x00007f00 (most recent call first):
  File "/tmp/ipykernel_4242/2718.py", line 7 in <module>
{RUN_CODE}
"""
    assert summary(dump) == "in the cell, line 7"
    assert summary("") == ""
    assert summary("Fatal Python error: Aborted\n\n<no Python frame>\n") == ""


def test_a_function_of_an_earlier_cell_and_the_running_cells_line():
    # f was defined in an earlier cell (a cell file too); the running cell's line is the
    # outermost cell frame's.
    dump = f"""Current thread 0x00007f00 (most recent call first):
  File "/usr/lib/python3.12/ctypes/__init__.py", line 530 in string_at
  File "/tmp/ipykernel_4242/1111.py", line 3 in f
  File "/tmp/ipykernel_4242/2222.py", line 9 in <module>
{RUN_CODE}
"""
    assert summary(dump) == (
        "in string_at (ctypes/__init__.py:530) <- f (a cell, line 3), from the cell, line 9"
    )


def test_the_last_dump_of_a_record_and_a_crash_between_cells():
    first = """Fatal Python error: Segmentation fault

Current thread 0x00007f00 (most recent call first):
  File "/tmp/ipykernel_4242/1111.py", line 1 in <module>
"""
    idle = f"""Fatal Python error: Aborted

Thread 0x00007f01 (most recent call first):
  File "{SITE}/zmq/sugar/socket.py", line 800 in recv_multipart

Thread 0x00007f00 (most recent call first):
  File "/usr/lib/python3.12/selectors.py", line 468 in select
"""
    assert summary(first + "\n" + idle) == (
        "in a thread without Python frames, while no cell was running"
    )
