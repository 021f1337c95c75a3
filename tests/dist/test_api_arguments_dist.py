"""Bad arguments on real ranks (2 CPU ranks, gloo): every rank gets the same clear error.

A mistake that only one rank can see (rank 0 makes the checkpoint directory) must
still raise on all of them, instead of leaving the others in a collective until
the group's timeout. The single-process cases are in ``tests/unit/test_api_arguments.py``.
"""

from __future__ import annotations

import pytest

import nbdist
from nbdist.driver.sinks import ListSink

# Runs a statement on every rank and keeps what it raised (or "ok") as `outcome`.
SETUP = """
import torch
import torch.nn as nn

def outcome_of(fn):
    try:
        fn()
        return "ok"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
"""


@pytest.fixture(scope="module")
def session():
    # A short group timeout: a rank left waiting in a collective fails the test in
    # seconds rather than hanging it.
    s = nbdist.DistSession(2, cpu=True, timeout=300, history=False, group_timeout=20)
    s.start()
    try:
        s.run(SETUP, sink=ListSink())
        yield s
    finally:
        s.stop()


def _outcomes(session, statement: str) -> list[str]:
    session.run(f"outcome = outcome_of(lambda: {statement})", sink=ListSink(), timeout=120)
    return session.pull("outcome")


def test_save_where_rank0_cannot_write_fails_on_every_rank(session, tmp_path):
    (tmp_path / "ckpt").write_text("a file, not a directory")
    session.push({"path": str(tmp_path / "ckpt" / "step_1")})
    # Before: rank 0 raised NotADirectoryError and rank 1 waited in a barrier.
    outcomes = _outcomes(session, "nbdist.checkpoint.save(path, model=nn.Linear(2, 2), step=1)")
    assert all(o.startswith("CheckpointError: checkpoint ") for o in outcomes), outcomes
    assert all("cannot be written (Not a directory)" in o for o in outcomes), outcomes
    # The group is still usable afterwards.
    session.push({"path": str(tmp_path / "good")})
    assert _outcomes(session, "nbdist.checkpoint.save(path, model=nn.Linear(2, 2))") == [
        "ok",
        "ok",
    ]
