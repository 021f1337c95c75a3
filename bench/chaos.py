"""Chaos while training: ranks SIGKILLed at random steps, restarted, resumed; the weights end bitwise equal.

Each run (separate process side: this script drives a :class:`nbdist.DistSession`
directly, 2 CPU ranks, gloo) first trains a seeded DDP model ``--steps`` steps
without interruption (the reference), then trains it again from scratch with
``nbdist.checkpoint.save`` every ``--every`` steps while rank 1 SIGKILLs itself at
``--kills`` steps drawn at random (seeded per run). After each death:
``session.restart()`` (fresh rank processes), the model and optimizer built
again, ``nbdist.checkpoint.resume`` from the newest checkpoint, and the loop
goes on. Per run it prints the kill steps, the steps resumed from, the steps
computed twice, the time a restart and a resume took, whether the final weights
equal the reference bitwise, and the restarts the history recorded.

Usage::

    python bench/chaos.py                    # 5 runs, 60 steps, 4 kills each
    python bench/chaos.py --runs 2 --kills 2 # shorter
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _common import assert_no_children, machine, median, print_summary  # noqa: E402

import nbdist  # noqa: E402
from nbdist.driver.sinks import ListSink  # noqa: E402
from nbdist.errors import NbdistError  # noqa: E402
from nbdist.metrics.hub import RESTART_KEY  # noqa: E402
from nbdist.text_table import format_table  # noqa: E402

# A step's result depends only on the weights and optimizer state it starts from (the
# checkpoint holds both) and on its own seeded batch.
SETUP = """
import os, signal
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

torch.manual_seed(0)
net = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)))
opt = torch.optim.AdamW(net.parameters(), lr=0.01)

def train(start, stop, ckpt, every, kill_at=None):
    for step in range(start, stop):
        if step == kill_at and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(64, 32, generator=g), torch.randn(64, 8, generator=g)
        loss = ((net(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        nbdist.log(step=step, loss=loss.item())
        if ckpt and (step + 1) % every == 0:
            nbdist.checkpoint.save(f"{ckpt}/step_{step + 1}", model=net, optimizer=opt,
                                   step=step + 1)

def flat():
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])
"""


def one_run(index: int, args, tmp: str) -> dict:
    """One chaos run; its row's figures."""
    history = os.path.join(tmp, f"history-{index}.sqlite")
    ckpt = os.path.join(tmp, f"ckpt-{index}")
    session = nbdist.DistSession(2, cpu=True, timeout=300, history=history)
    session.start()
    restart_s, resume_s, resumed_from = [], [], []
    try:
        session.run(SETUP)
        session.run(f"train(0, {args.steps}, None, {args.every})")
        reference = session.pull("flat()", rank=0)
        kills = sorted(random.Random(1000 + index).sample(range(1, args.steps - 1), args.kills))
        for kill_at in [*kills, None]:
            t0 = time.perf_counter()
            session.restart()
            restart_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            session.run(SETUP)
            session.run(f"start = nbdist.checkpoint.resume({ckpt!r}, model=net, optimizer=opt)")
            resume_s.append(time.perf_counter() - t0)
            start = session.pull("start", rank=0)
            resumed_from.append(start)
            cell = f"train(start, {args.steps}, {ckpt!r}, {args.every}, kill_at={kill_at})"
            if kill_at is None:
                session.run(cell)
            else:
                try:
                    session.run(cell, sink=ListSink())  # the survivors' interrupts
                except NbdistError as exc:
                    if "died" not in str(exc):
                        raise
                else:
                    raise RuntimeError(f"rank 1 should have died at step {kill_at}")
        final = session.pull("flat()", rank=0)
        restarts = [
            int(p[RESTART_KEY])
            for p in session.metrics.rows()
            if p.get(RESTART_KEY) is not None and p["rank"] == 0
        ]
    finally:
        session.stop()
    # Steps a death cost: from the checkpoint resumed to the step that died.
    redone = sum(k - s for k, s in zip(kills, resumed_from[1:]))
    return {
        "run": index,
        "kills": kills,
        "resumed_from": resumed_from[1:],
        "redone": redone,
        "restart_s": median(restart_s),
        "resume_s": median(resume_s),
        "bitwise": bool(torch.equal(final, reference)),
        "restarts_in_history": restarts,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=5, help="checkpoint every K steps")
    parser.add_argument("--kills", type=int, default=4, help="SIGKILLed rank per run")
    args = parser.parse_args()
    print(f"chaos: {args.runs} runs · {machine()}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="nbdist-chaos-") as tmp:
        for index in range(1, args.runs + 1):
            rows.append(one_run(index, args, tmp))
            print(f"run {index}: {rows[-1]}", flush=True)
    leftover = assert_no_children(grace=15.0)
    header = [
        "run",
        "killed at step",
        "resumed from",
        "steps redone",
        "restart s (median)",
        "resume s (median)",
        "restarts in history",
        "bitwise equal",
    ]
    print(
        format_table(
            header,
            [
                [
                    r["run"],
                    " ".join(map(str, r["kills"])),
                    " ".join(map(str, r["resumed_from"])),
                    r["redone"],
                    round(r["restart_s"], 2),
                    round(r["resume_s"], 2),
                    " ".join(map(str, r["restarts_in_history"])),
                    "yes" if r["bitwise"] else "NO",
                ]
                for r in rows
            ],
        )
    )
    summary = {
        "bench": "chaos",
        "runs": len(rows),
        "kills": sum(len(r["kills"]) for r in rows),
        "restarts": sum(len(r["restarts_in_history"]) for r in rows),
        "all_bitwise": all(r["bitwise"] for r in rows),
        "leftover_pids": leftover,
        "rows": rows,
    }
    summary["goal_met"] = summary["all_bitwise"] and not leftover
    print_summary(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
