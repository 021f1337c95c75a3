"""accelerate, Lightning, HF Trainer, DeepSpeed and a torchrun script on ONE GPU, against one process.

As test_strategies_gpu.py: each test runs with two ranks sharing GPU 0 over gloo with
CUDA tensors and with one NCCL rank on it (``one_gpu``). A library that is not
installed skips its test and says which (``pip install nbdist[integrations]`` or
``nbdist[deepspeed]``); nothing of nbdist is asked whether it would work.

References: the same training in this process on the CPU, float32; the tolerance is
test_strategies_gpu.py's ``GPU_TOL`` (GPU kernels sum in another order than the CPU's).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch.utils.data.distributed import DistributedSampler

from nbdist.driver.sinks import ListSink

GPU_TOL = dict(rtol=1e-5, atol=5e-5)
COMMON = """
import os
torch.set_float32_matmul_precision("highest")  # float32 stays float32 (no TF32)
# accelerate (also under HF Trainer) hands DDP device_ids=[LOCAL_RANK], wrong where ranks
# share a GPU (LOCAL_RANK 1, one GPU): this lets DDP use the model's device (examples 20, 22).
os.environ.setdefault("ACCELERATE_BYPASS_DEVICE_MAP", "true")
X = torch.linspace(-1, 1, 256).reshape(64, 4)
Y = X @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
"""


def _needs(module: str, extra: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed here (pip install 'nbdist[{extra}]')")


def run(session, code: str) -> None:
    session.run(code, sink=ListSink())


def _data():
    X = torch.linspace(-1, 1, 256).reshape(64, 4)
    return X, X @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])


def _linear_reference(batches) -> torch.Tensor:
    """nn.Linear(4, 1) (seed 0), SGD lr 0.1 over ``batches`` (index lists): weight then bias."""
    X, Y = _data()
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    for batch in batches:
        opt.zero_grad()
        torch.nn.functional.mse_loss(layer(X[batch]), Y[batch]).backward()
        opt.step()
    return torch.cat([layer.weight.detach().flatten(), layer.bias.detach()])


@pytest.mark.example(21)
def test_lightning_ddp_on_one_gpu_trains_like_one_process(one_gpu):
    """``Trainer(strategy="ddp", **lightning_trainer_kwargs())`` on GPU ranks, one epoch.

    Reference: one process taking at each step the union of what each rank's
    DistributedSampler gives it (Lightning shuffles with seed 0), 8 samples a rank."""
    _needs("lightning", "integrations")
    run(
        one_gpu,
        """
import lightning as L
import nbdist.integrations
class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
    def training_step(self, batch, i):
        x, y = batch
        self.trained_on = x.device.type  # Lightning moves the model back to the CPU after fit
        return torch.nn.functional.mse_loss(self.layer(x), y)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=8)
torch.manual_seed(0)
model = Regression()
trainer = L.Trainer(strategy="ddp", max_epochs=1, enable_progress_bar=False, logger=False,
                    enable_checkpointing=False, enable_model_summary=False,
                    **nbdist.integrations.lightning_trainer_kwargs())
trainer.fit(model, loader)
pl_facts = (trainer.world_size, trainer.global_rank, model.trained_on)
pl_weights = torch.cat([model.layer.weight.detach().flatten(), model.layer.bias.detach()]).cpu()
""",
    )
    world = one_gpu.world_size
    shards = [
        list(DistributedSampler(range(64), num_replicas=world, rank=r, shuffle=True, seed=0))
        for r in range(world)
    ]
    steps = len(shards[0]) // 8
    want = _linear_reference(
        [sum((s[8 * i : 8 * i + 8] for s in shards), []) for i in range(steps)]
    )
    for got in one_gpu.pull("pl_weights"):
        torch.testing.assert_close(got, want, **GPU_TOL)
    assert one_gpu.pull("pl_facts") == [(world, r, "cuda") for r in range(world)]


@pytest.mark.example(20)
def test_accelerate_prepare_on_one_gpu_trains_like_one_process(one_gpu):
    """``Accelerator()`` + ``prepare`` on GPU ranks: each rank takes every world_size-th batch
    of 8 (no shuffling), so each step is one process's step on 8 x world_size samples."""
    _needs("accelerate", "integrations")
    run(
        one_gpu,
        """
from accelerate import Accelerator
accelerator = Accelerator(cpu=device.type == "cpu")  # as example 20 (CPU ranks for a dry run)
torch.manual_seed(0)
net = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(net.parameters(), lr=0.1)
dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=8)
net, opt, dl = accelerator.prepare(net, opt, dl)
for x, y in dl:
    accelerator.backward(torch.nn.functional.mse_loss(net(x), y))
    opt.step()
    opt.zero_grad()
acc_facts = (accelerator.num_processes, accelerator.process_index, accelerator.device.type)
inner = accelerator.unwrap_model(net)
acc_weights = torch.cat([inner.weight.detach().flatten(), inner.bias.detach()]).cpu()
""",
    )
    world = one_gpu.world_size
    per_step = 8 * world
    want = _linear_reference([list(range(i, i + per_step)) for i in range(0, 64, per_step)])
    for got in one_gpu.pull("acc_weights"):
        torch.testing.assert_close(got, want, **GPU_TOL)
    assert one_gpu.pull("acc_facts") == [(world, r, "cuda") for r in range(world)]


@pytest.mark.example(22)
def test_hf_trainer_two_steps_on_one_gpu(one_gpu):
    """HF ``Trainer`` with a tiny random BERT on GPU ranks: DDP when there are two ranks, the
    model on CUDA, and every rank ends with the same weights."""
    _needs("transformers", "integrations")
    run(
        one_gpu,
        """
import tempfile
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments
config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                    intermediate_size=32, max_position_embeddings=16)
torch.manual_seed(0)
hf_model = BertForSequenceClassification(config)
g = torch.Generator().manual_seed(rank)
data = [{"input_ids": torch.randint(0, 64, (8,), generator=g), "labels": i % 2} for i in range(32)]
args = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=2, per_device_train_batch_size=4,
                         report_to=[], save_strategy="no", disable_tqdm=True,
                         use_cpu=device.type == "cpu")
hf_trainer = Trainer(model=hf_model, args=args, train_dataset=data)
hf_trainer.train()
hf_facts = (args.world_size, args.process_index, hf_trainer.state.global_step, hf_model.device.type)
hf_weights = torch.cat([p.detach().flatten() for p in hf_model.parameters()]).cpu()
""",
    )
    world = one_gpu.world_size
    weights = one_gpu.pull("hf_weights")
    for got in weights[1:]:
        assert torch.equal(got, weights[0])
    assert one_gpu.pull("hf_facts") == [(world, r, 2, "cuda") for r in range(world)]


DEEPSPEED = """
import deepspeed
from torch import nn
from nbdist.strategies.parallel.deepspeed_zero import apply_deepspeed
def ds_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
g = torch.Generator().manual_seed(1)
DX, DY = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
engine, ds_opt = apply_deepspeed(ds_net().to(device), stage=ds_stage, lr=0.01,
                                 micro_batch_size=16 // world_size)
x, y = DX[rank::world_size].to(device), DY[rank::world_size].to(device)
for _ in range(3):
    loss = nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()
params = list(engine.module.parameters())
ds_device = params[0].device.type
with deepspeed.zero.GatheredParameters(params, enabled=ds_stage == 3):
    ds_state = {k: v.detach().float().cpu() for k, v in engine.module.state_dict().items()}
"""


@pytest.mark.example(30)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_deepspeed_zero_stage_on_one_gpu_trains_like_one_process_adam(one_gpu, stage):
    """``apply_deepspeed`` (DeepSpeed's CUDA accelerator, torch's Adam) at each ZeRO stage:
    3 steps give the weights of one process's Adam on the whole batch."""
    _needs("deepspeed", "deepspeed")
    one_gpu.push({"ds_stage": stage})
    run(one_gpu, DEEPSPEED)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    g = torch.Generator().manual_seed(1)
    X, Y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
    world = one_gpu.world_size
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    for _ in range(3):
        opt.zero_grad()
        loss = sum(
            torch.nn.functional.mse_loss(net(X[r::world]), Y[r::world]) for r in range(world)
        )
        (loss / world).backward()
        opt.step()
    want = net.state_dict()
    for r, state in enumerate(one_gpu.pull("ds_state")):
        assert state.keys() == want.keys()
        for name, value in state.items():
            torch.testing.assert_close(
                value, want[name], **GPU_TOL, msg=lambda m, n=name, r=r: f"rank {r} {n}: {m}"
            )
    assert one_gpu.pull("ds_device") == ["cuda"] * world


SCRIPT = """
import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=3)
args = parser.parse_args()
local_rank = int(os.environ["LOCAL_RANK"])
if torch.cuda.is_available():
    # torchrun shows every GPU; a rank that sees fewer uses the one at its index modulo.
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
else:
    device = torch.device("cpu")
dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = DDP(torch.nn.Linear(4, 1).to(device))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
X = torch.linspace(-1, 1, 256).reshape(64, 4)
Y = X @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
for step in range(args.steps):
    batch = list(range(16 * step + rank, 16 * step + 16, world))
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(X[batch].to(device)), Y[batch].to(device)).backward()
    opt.step()
w = torch.cat([model.module.weight.detach().flatten(), model.module.bias.detach()]).cpu()
print("WEIGHTS", " ".join(f"{v:.9e}" for v in w.tolist()))
dist.destroy_process_group()
"""


@pytest.mark.example(23)
def test_a_torchrun_script_runs_through_dist_run_on_one_gpu(one_gpu, tmp_path):
    """A torchrun script (argparse, its own ``init_process_group("nccl")`` and destroy) run by
    ``%dist_run``'s API on the ranks: the weights of one process on the same 16-sample steps,
    and the group still works after its destroy."""
    script = tmp_path / "train_script.py"
    script.write_text(SCRIPT)
    one_gpu.push({"script_path": str(script)})
    run(
        one_gpu,
        """
import contextlib, io
from nbdist.engine.scripts import run_script
out = io.StringIO()
with contextlib.redirect_stdout(out):
    run_script(script_path, ["--steps", "3"], get_ipython().user_ns)
script_out = out.getvalue()
after = torch.ones(1, device=device)
dist.all_reduce(after)
after = after.item()
""",
    )
    want = _linear_reference([list(range(16 * s, 16 * s + 16)) for s in range(3)])
    for text in one_gpu.pull("script_out"):
        line = next(x for x in text.splitlines() if x.startswith("WEIGHTS "))
        got = torch.tensor([float(v) for v in line.split()[1:]])
        torch.testing.assert_close(got, want, **GPU_TOL)
    assert one_gpu.pull("after") == [float(one_gpu.world_size)] * one_gpu.world_size
