"""Two ranks on one GPU: which collectives each backend runs there, and what each costs.

Runs in the benchmark's own process (the notebook kernel's place) and starts
``DistSession(2, backend=...)`` on the first visible GPU, once with gloo (CUDA
tensors copied through host memory) and once with NCCL where this torch's
NCCL can share a GPU (>= 2.30, ``NCCL_MULTI_RANK_GPU_ENABLE``). On each it

- tries every collective nbdist's strategies use, on CUDA tensors, checking
  the numbers (``nbdist.engine.backend_support.probe``: the same probe the
  ranks run when they form a gloo group on a GPU; send/recv, which the probe
  leaves out on CUDA, by a real exchange through ``dist.send``/``dist.recv``), and
- times an all_reduce of 64 MiB of float32 (median of 10 after 3 warm-up), and
  one DDP step of a 3-layer MLP (median of 20 after 5).

It prints a table of collectives × backends (ok, or the error) and the NCCL /
gloo time ratios measured in the same run. Without CUDA it says so and exits 0.

Usage: python bench/shared_gpu.py [--mib 64]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import assert_no_children, machine  # noqa: E402

# Runs on both ranks; leaves `report` in their namespaces.
RANK_CODE = """
import statistics, time
from nbdist.engine import backend_support
from torch.nn.parallel import DistributedDataParallel as DDP

missing = backend_support.probe(str(device))
# The probe does not try send/recv on CUDA (gloo's own break the group): exchange for real,
# through dist.send/recv as user code calls them (host-staged by nbdist over gloo).
from nbdist.engine import p2p_staging
try:
    sent, got = torch.full((4,), 7.0 + rank, device=device), torch.empty(4, device=device)
    if rank == 0:
        dist.send(sent, 1); dist.recv(got, 1)
    elif rank == 1:
        dist.recv(got, 0); dist.send(sent, 0)
    if rank < 2 and got.tolist() != [8.0 - rank] * 4:
        missing["send/recv"] = "gave a wrong result"
except RuntimeError as e:
    missing["send/recv"] = str(e).strip().splitlines()[0][:160]
staged = p2p_staging.installed()

def timed(fn, warmup, repeats):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize(); dist.barrier(); t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(); times.append(time.perf_counter() - t0)
    return statistics.median(times)

payload = torch.ones(MIB * 2**20 // 4, device=device)
all_reduce_s = timed(lambda: dist.all_reduce(payload), 3, 10)

torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 10)).to(device))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(256, 1024, device=device), torch.randint(0, 10, (256,), device=device)

def step():
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()

ddp_step_s = timed(step, 5, 20)
report = {"missing": missing, "staged": staged, "all_reduce_s": all_reduce_s, "ddp_step_s": ddp_step_s}
"""


def measure(backend: str, mib: int) -> dict:
    """Start 2 ranks on GPU 0 with ``backend``, run RANK_CODE, return rank 0's report."""
    import nbdist
    from nbdist.driver.sinks import ListSink

    # gpus=[0]: both ranks on the first visible GPU, however many there are.
    with nbdist.DistSession(2, backend=backend, gpus=[0], timeout=300, history=False) as s:
        print(s.summary(), flush=True)
        s.push({"MIB": mib})
        s.run(RANK_CODE, sink=ListSink())
        return s.pull("report", rank=0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="all_reduce size in MiB (default 64)")
    args = parser.parse_args()
    print("machine:", machine())
    import torch

    from nbdist.engine.backend_support import COLLECTIVES
    from nbdist.engine.devices import nccl_can_share, nccl_version

    if not torch.cuda.is_available():
        print("no CUDA device here: nothing to measure (this benchmark needs one GPU)")
        return 0
    version = nccl_version()
    print(f"torch {torch.__version__}, NCCL {version}, GPU 0: {torch.cuda.get_device_name(0)}")
    backends = ["gloo"] + (["nccl"] if nccl_can_share(version) else [])
    if "nccl" not in backends:
        print(f"NCCL {version} cannot put two ranks on one GPU (needs >= 2.30): gloo only")
    reports = {b: measure(b, args.mib) for b in backends}
    print(f"\n| collective on CUDA tensors | {' | '.join(backends)} |")
    print(f"|---|{'---|' * len(backends)}")
    for name in COLLECTIVES:
        ok = {
            b: "ok (nbdist copies through host memory)"
            if name == "send/recv" and reports[b]["staged"]
            else "ok"
            for b in backends
        }
        cells = [reports[b]["missing"].get(name, ok[b]) for b in backends]
        print(f"| {name} | {' | '.join(cells)} |")
    for b in backends:
        r = reports[b]
        print(
            f"{b}: all_reduce {args.mib} MiB {r['all_reduce_s'] * 1e3:.2f} ms, "
            f"DDP step {r['ddp_step_s'] * 1e3:.2f} ms"
        )
    if len(backends) == 2:
        g, n = reports["gloo"], reports["nccl"]
        print(
            f"gloo / nccl time: all_reduce {g['all_reduce_s'] / n['all_reduce_s']:.1f}x, "
            f"DDP step {g['ddp_step_s'] / n['ddp_step_s']:.2f}x"
        )
    leftovers = assert_no_children()
    print("leftover processes:", leftovers or "none")
    return 1 if leftovers else 0


if __name__ == "__main__":
    sys.exit(main())
