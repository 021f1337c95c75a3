"""Which torch.distributed, DTensor and FSDP2 operations work on gloo with CUDA tensors: plain torch.

Two processes share GPU 0 over gloo (what nbdist's ranks do when they share a GPU and
NCCL is older than 2.30), one fresh pair per operation, with faulthandler on, so an
operation that kills the process (a segmentation fault) is named with its Python stack
and cannot break the next one. Mode ``plain`` is torch alone; ``nbdist`` adds the patches
nbdist installs when such a group forms (``nbdist.engine.patches.install_on_group``).
Needs a GPU; run on the GPU machine from the checkout:

    PYTHONPATH=$PWD python scripts/gloo_cuda_ops.py [CASES,...] [plain,nbdist]

(``GLOO_OPS_DEVICE=cpu`` runs the cases on CPU tensors, where all pass: to try the script.)

On 2026-11-29 (1 x H200, torch 2.11.0+cu130, NCCL 2.28.9) every case passed in both
modes except the functional all-gather and what calls it (``funcol_ag``,
``dtensor_full``, ``fsdp2_state``): both ranks died of SIGSEGV, with torch alone too.
nbdist now serves that operator itself (:mod:`nbdist.engine.functional_gather`).
"""

import faulthandler
import os
import subprocess
import sys
import time

# GLOO_OPS_DEVICE=cpu runs the same cases on CPU tensors (to try the script without a GPU).
DEV = os.environ.get("GLOO_OPS_DEVICE", "cuda")


def c_ag(dist, torch, r):
    """c10d all_gather_into_tensor, async."""
    out = torch.empty(4, device=DEV)
    dist.all_gather_into_tensor(out, torch.full((2,), float(r), device=DEV), async_op=True).wait()
    assert out.tolist() == [0, 0, 1, 1], out


def c_ag_stream(dist, torch, r):
    """The same, issued on a side stream (as FSDP2 does)."""
    if DEV != "cuda":
        return
    s = torch.cuda.Stream()
    out = torch.empty(4, device=DEV)
    with torch.cuda.stream(s):
        src = torch.full((2,), float(r), device=DEV)
        dist.all_gather_into_tensor(out, src, async_op=True).wait()
    _sync(torch)
    assert out.tolist() == [0, 0, 1, 1], out


def c_rs(dist, torch, r):
    """c10d reduce_scatter_tensor, async."""
    out = torch.empty(2, device=DEV)
    dist.reduce_scatter_tensor(out, torch.ones(4, device=DEV), async_op=True).wait()
    assert out.tolist() == [2, 2], out


def c_funcol_ag(dist, torch, r):
    """The functional all-gather (DTensor's)."""
    import torch.distributed._functional_collectives as fc

    y = fc.all_gather_tensor(torch.full((2,), float(r), device=DEV), 0, dist.group.WORLD)
    y = fc.wait_tensor(y)
    assert y.tolist() == [0, 0, 1, 1], y


def c_funcol_ar(dist, torch, r):
    """The functional all-reduce."""
    import torch.distributed._functional_collectives as fc

    y = fc.all_reduce(torch.ones(2, device=DEV), "sum", dist.group.WORLD)
    y = fc.wait_tensor(y)
    assert y.tolist() == [2, 2], y


def c_funcol_rs(dist, torch, r):
    """The functional reduce-scatter."""
    import torch.distributed._functional_collectives as fc

    y = fc.reduce_scatter_tensor(torch.ones(4, device=DEV), "sum", 0, dist.group.WORLD)
    y = fc.wait_tensor(y)
    assert y.tolist() == [2, 2], y


def c_funcol_a2a(dist, torch, r):
    """The functional all-to-all (DTensor's Shard(i) -> Shard(j))."""
    import torch.distributed._functional_collectives as fc

    y = fc.all_to_all_single(torch.full((2,), float(r), device=DEV), None, None, dist.group.WORLD)
    y = fc.wait_tensor(y)
    assert y.tolist() == [0, 1], y


def c_funcol_bcast(dist, torch, r):
    """The functional broadcast."""
    import torch.distributed._functional_collectives as fc

    y = fc.wait_tensor(fc.broadcast(torch.full((2,), float(r), device=DEV), 0, dist.group.WORLD))
    assert y.tolist() == [0, 0], y


def c_dtensor_reshard(dist, torch, r):
    """A DTensor from Shard(0) to Shard(1)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(0)
    x = torch.randn(4, 4, device=DEV)
    d = distribute_tensor(x, _mesh(), [Shard(0)]).redistribute(placements=[Shard(1)])
    assert torch.equal(d.to_local(), x[:, 2 * r : 2 * r + 2])


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(DEV, (2,))


def c_dtensor_full(dist, torch, r):
    """A sharded DTensor's full_tensor()."""
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(0)
    x = torch.randn(4, 4, device=DEV)
    d = distribute_tensor(x, _mesh(), [Shard(0)])
    assert torch.equal(d.full_tensor(), x)


def c_dtensor_partial(dist, torch, r):
    """Partial -> Replicate (an all-reduce)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    d = DTensor.from_local(torch.ones(4, device=DEV), _mesh(), [Partial()])
    assert d.redistribute(placements=[Replicate()]).to_local().tolist() == [2.0] * 4


def c_tp(dist, torch, r):
    """Colwise then rowwise tensor parallel, forward and backward."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8)).to(DEV)
    parallelize_module(m, _mesh(), {"0": ColwiseParallel(), "2": RowwiseParallel()})
    m(torch.randn(4, 8, device=DEV)).sum().backward()
    _sync(torch)


def c_fsdp2(dist, torch, r):
    """FSDP2 (fully_shard), two SGD steps."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8)).to(DEV)
    fully_shard(m, mesh=_mesh())
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for _ in range(2):
        m(torch.randn(4, 8, device=DEV)).sum().backward()
        opt.step()
        opt.zero_grad()
    _sync(torch)


def c_fsdp2_state(dist, torch, r):
    """An FSDP2 model's full state dict (get_model_state_dict)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)).to(DEV)
    fully_shard(m, mesh=_mesh())
    sd = get_model_state_dict(m, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    assert len(sd) == (4 if r == 0 else 0)  # with cpu_offload, rank 0 alone holds it


def _sync(torch):
    if DEV == "cuda":
        torch.cuda.synchronize()


CASES = {k[2:]: v for k, v in dict(globals()).items() if k.startswith("c_")}


def worker(case, rank, port, mode):
    """One rank of one case."""
    faulthandler.enable(all_threads=True)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2"
    )
    import torch
    import torch.distributed as dist

    if DEV == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    if mode == "nbdist":
        from nbdist.engine import patches

        patches.install_on_group(stage_p2p=True)
    CASES[case](dist, torch, rank)
    _sync(torch)
    dist.barrier()
    print("OK", case, rank, flush=True)
    dist.destroy_process_group()


def main():
    """Every case (or those named) in every mode (or those named), a pair each, side by side."""
    only = sys.argv[1].split(",") if len(sys.argv) > 1 else list(CASES)
    modes = sys.argv[2].split(",") if len(sys.argv) > 2 else ["plain", "nbdist"]
    procs = []
    port = 29600
    for mode in modes:
        for case in only:
            port += 1
            pair = [
                subprocess.Popen(
                    [sys.executable, __file__, "--worker", case, str(r), str(port), mode],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
                for r in range(2)
            ]
            procs.append((mode, case, pair))
    t0 = time.time()
    for mode, case, pair in procs:
        outs, rcs = [], []
        for p in pair:
            try:
                out, _ = p.communicate(timeout=max(5, 150 - (time.time() - t0)))
            except subprocess.TimeoutExpired:
                p.kill()
                out, _ = p.communicate()
                out += "\nTIMEOUT"
            outs.append(out)
            rcs.append(p.returncode)
        ok = rcs == [0, 0]
        print(f"== {mode:6} {case:16} {'ok' if ok else 'FAIL'} rc={rcs}", flush=True)
        if not ok:
            for r, out in enumerate(outs):
                lines = [ln for ln in out.splitlines() if "Warning" not in ln]
                print(f"   rank {r}:\n      " + "\n      ".join(lines[-22:]))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
    else:
        main()
