"""Lightning, accelerate, HF Trainer and multiprocessing launchers on 2 real CPU ranks.

The libraries run unchanged on nbdist's ranks (each rank a process they take as
torchrun's); launchers that would start ranks of their own fail at once, saying
what to call instead, and leave the group working.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch.utils.data.distributed import DistributedSampler

import nbdist
from nbdist.errors import RankError

pytest.importorskip("lightning")
pytest.importorskip("accelerate")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def session():
    with nbdist.DistSession(2, cpu=True, timeout=120) as s:
        yield s


def _group_works(session) -> None:
    session.run("_t = torch.ones(1) * (rank + 1); dist.all_reduce(_t)")
    assert [t.item() for t in session.pull("_t")] == [3.0, 3.0]


def _refused(session, code: str) -> tuple[str, float]:
    """Run ``code``; it must fail on every rank. (message, seconds the cell took)"""
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        session.run(code)
    took = time.monotonic() - start
    assert info.value.ranks == [0, 1]
    return "\n".join(f"{f.ename}: {f.evalue}" for f in info.value.failures), took


LIGHTNING_SETUP = """
import lightning as L
import torch.nn as nn

class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 1)
    def training_step(self, batch, i):
        x, y = batch
        return nn.functional.mse_loss(self.layer(x), y)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

X = torch.linspace(-1, 1, 256).reshape(64, 4)
Y = X @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=8)
quiet = dict(max_epochs=1, enable_progress_bar=False, logger=False,
             enable_checkpointing=False, enable_model_summary=False)
"""


def _reference_weights() -> torch.Tensor:
    """One process, the global batch at each step (what each rank's DistributedSampler
    gives it; Lightning shuffles training data with seed 0): what DDP must equal."""
    X = torch.linspace(-1, 1, 256).reshape(64, 4)
    Y = X @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    shards = [
        list(DistributedSampler(range(64), num_replicas=2, rank=r, shuffle=True, seed=0))
        for r in (0, 1)
    ]
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    for step in range(4):
        batch = shards[0][8 * step : 8 * step + 8] + shards[1][8 * step : 8 * step + 8]
        opt.zero_grad()
        torch.nn.functional.mse_loss(layer(X[batch]), Y[batch]).backward()
        opt.step()
    return torch.cat([layer.weight.detach().flatten(), layer.bias.detach()])


def test_lightning_ddp_fits_on_the_ranks_and_matches_one_process(session):
    session.run(LIGHTNING_SETUP)
    session.run(
        "world = dist.group.WORLD\n"
        "torch.manual_seed(0)\n"
        "model = Regression()\n"
        "trainer = L.Trainer(strategy='ddp', devices=2, accelerator='cpu', **quiet)\n"
        "trainer.fit(model, loader)\n"
        "facts = (trainer.world_size, trainer.global_rank, type(trainer.strategy).__name__,\n"
        "         type(trainer.strategy.cluster_environment).__name__,\n"
        "         dist.group.WORLD is world, trainer.global_step)\n"
        "weights = torch.cat([model.layer.weight.detach().flatten(), model.layer.bias.detach()])"
    )
    assert session.pull("facts") == [
        (2, 0, "DDPStrategy", "TorchElasticEnvironment", True, 4),
        (2, 1, "DDPStrategy", "TorchElasticEnvironment", True, 4),
    ]
    w0, w1 = session.pull("weights")
    torch.testing.assert_close(w0, w1, rtol=0, atol=0)
    torch.testing.assert_close(w0, _reference_weights())
    # "auto" with devices=N picks DDP on the ranks as well.
    session.run(
        "auto = L.Trainer(strategy='auto', devices=2, accelerator='cpu', **quiet)\n"
        "auto_facts = (type(auto.strategy).__name__, auto.world_size)"
    )
    assert session.pull("auto_facts") == [("DDPStrategy", 2)] * 2
    _group_works(session)


def test_lightning_with_one_device_per_rank_as_on_gpu_ranks(session):
    """GPU ranks each see one GPU: nbdist's kwargs make each rank a node of one device."""
    session.run(LIGHTNING_SETUP)
    session.run(
        "import nbdist.integrations\n"
        "kwargs = nbdist.integrations.lightning_trainer_kwargs(one_device_per_rank=True)\n"
        "torch.manual_seed(0)\n"
        "model = Regression()\n"
        "trainer = L.Trainer(strategy='ddp', **kwargs, **quiet)\n"
        "trainer.fit(model, loader)\n"
        "facts = (kwargs['devices'], kwargs['num_nodes'], trainer.world_size,\n"
        "         trainer.global_rank, trainer.local_rank)\n"
        "weights = torch.cat([model.layer.weight.detach().flatten(), model.layer.bias.detach()])\n"
        "plain = nbdist.integrations.lightning_trainer_kwargs()"
    )
    assert session.pull("facts") == [(1, 2, 2, 0, 0), (1, 2, 2, 1, 0)]
    w0, w1 = session.pull("weights")
    torch.testing.assert_close(w0, w1, rtol=0, atol=0)
    torch.testing.assert_close(w0, _reference_weights())
    assert session.pull("plain") == [{"accelerator": "cpu", "devices": 2, "num_nodes": 1}] * 2


def test_an_interrupted_lightning_fit_shuts_down_gracefully_and_keeps_the_group(session, tmp_path):
    """Ctrl-C during ``trainer.fit``, every rank in Python code: Lightning catches the
    KeyboardInterrupt, runs its callbacks' ``on_exception`` (here a checkpoint that takes
    a second) and its teardown, then exits the fit with ``SystemExit(1)``. All of it runs
    to its end on every rank, the group stays as it was (no re-forming, so the DDP model
    need not be made again), and training goes on in the next cell. Before, the ranks were
    released 0.5 s after the interrupt: the group was formed again under Lightning's
    shutdown."""
    import _thread
    import os
    import threading

    from nbdist.errors import RanksInterrupted

    began, saved = tmp_path / "began", tmp_path / "saved"
    began.mkdir()
    saved.mkdir()
    session.run(LIGHTNING_SETUP)
    session.run(
        "import os, time\n"
        "class SaveOnCtrlC(L.Callback):\n"
        "    def on_train_batch_start(self, trainer, module, batch, i):\n"
        f"        open(os.path.join({str(began)!r}, str(rank)), 'w').close()\n"
        # The Ctrl-C finds every rank in Python code (a slow batch), not one waiting in
        # DDP's all-reduce for a rank the interrupt already stopped: such a rank is
        # released, as in any interrupted cell, and the group formed again.
        "        time.sleep(60)\n"
        "    def on_exception(self, trainer, module, exc):\n"
        "        time.sleep(1.0)\n"
        f"        torch.save(module.state_dict(), os.path.join({str(saved)!r}, f'{{rank}}.pt'))\n"
        "torch.manual_seed(0)\n"
        "model = Regression()\n"
        "long = dict(quiet, max_epochs=100_000)\n"
        "trainer = L.Trainer(strategy='ddp', devices=2, accelerator='cpu',\n"
        "                    callbacks=[SaveOnCtrlC()], **long)"
    )

    def interrupt_once_training():
        deadline = time.monotonic() + 120
        while len(os.listdir(began)) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        _thread.interrupt_main()

    threading.Thread(target=interrupt_once_training, daemon=True).start()
    with pytest.raises(RanksInterrupted) as caught:
        session.run("trainer.fit(model, loader)")
    assert sorted(os.listdir(saved)) == ["0.pt", "1.pt"], "on_exception was cut short"
    stopped = caught.value.stopped
    assert stopped is not None and stopped.ranks == [0, 1], repr(caught.value)
    assert {(f.ename, f.evalue) for f in stopped.failures} == {("SystemExit", "1")}
    shown = "\n".join(caught.value._render_traceback_())
    assert "formed again" not in shown and "released" not in shown, shown
    session.run(
        "trainer = L.Trainer(strategy='ddp', devices=2, accelerator='cpu', **quiet)\n"
        "trainer.fit(model, loader)\n"
        "steps = trainer.global_step"
    )
    assert session.pull("steps") == [4, 4]
    _group_works(session)


@pytest.mark.parametrize("strategy", ["ddp_notebook", "ddp_spawn"])
def test_lightning_process_launching_strategies_say_use_ddp(session, strategy):
    session.run(LIGHTNING_SETUP)
    text, took = _refused(
        session,
        f"trainer = L.Trainer(strategy={strategy!r}, devices=2, accelerator='cpu', **quiet)\n"
        "trainer.fit(Regression(), loader)",
    )
    assert "LaunchInsideRank" in text
    assert "Use strategy='ddp'" in text and "ddp_notebook" in text
    assert "already are the processes" in text
    assert took < 30, f"the refusal took {took:.1f} s"
    session.run("import multiprocessing\nchildren = len(multiprocessing.active_children())")
    assert session.pull("children") == [0, 0]
    _group_works(session)


def test_accelerate_prepare_and_train_gives_equal_weights(session):
    session.run(
        "from accelerate import Accelerator\n"
        "accelerator = Accelerator(cpu=True)\n"
        "torch.manual_seed(0)\n"
        "net = torch.nn.Linear(4, 1)\n"
        "before = net.weight.detach().clone()\n"
        "opt = torch.optim.SGD(net.parameters(), lr=0.1)\n"
        "X = torch.randn(64, 4, generator=torch.Generator().manual_seed(rank))\n"
        "ds = torch.utils.data.TensorDataset(X, X.sum(1, keepdim=True))\n"
        "dl = torch.utils.data.DataLoader(ds, batch_size=8, shuffle=True)\n"
        "net, opt, dl = accelerator.prepare(net, opt, dl)\n"
        "for x, y in dl:\n"
        "    accelerator.backward(torch.nn.functional.mse_loss(net(x), y))\n"
        "    opt.step(); opt.zero_grad()\n"
        "after = accelerator.unwrap_model(net).weight.detach().clone()\n"
        "acc_facts = (accelerator.num_processes, accelerator.process_index,\n"
        "             accelerator.distributed_type.name, bool((after != before).any()))"
    )
    assert session.pull("acc_facts") == [
        (2, 0, "MULTI_CPU", True),
        (2, 1, "MULTI_CPU", True),
    ]
    w0, w1 = session.pull("after")
    torch.testing.assert_close(w0, w1, rtol=0, atol=0)


def test_accelerate_and_hf_trainer_as_written_for_a_gpu_find_the_group_on_cpu_ranks(session):
    # Accelerator() and TrainingArguments() without cpu=/use_cpu=: accelerate counts a
    # CPU job as distributed only when told (accelerate launch --cpu). Before, on CPU ranks
    # each was one process of one, every rank training alone on all its data, silently.
    session.run(
        "import os, tempfile\n"
        "from accelerate import Accelerator\n"
        "from accelerate.state import AcceleratorState\n"
        "from transformers import TrainingArguments\n"
        "AcceleratorState._reset_state(True)  # what an earlier test's Accelerator left\n"
        "plain = Accelerator()\n"
        "plain_facts = (os.environ.get('ACCELERATE_USE_CPU'), plain.num_processes,\n"
        "               plain.process_index, plain.distributed_type.name)\n"
        "AcceleratorState._reset_state(True)\n"
        "hf_args = TrainingArguments(output_dir=tempfile.mkdtemp(), report_to=[])\n"
        "hf_plain = (hf_args.world_size, hf_args.process_index)\n"
        "AcceleratorState._reset_state(True)"
    )
    assert session.pull("plain_facts") == [
        ("True", 2, 0, "MULTI_CPU"),
        ("True", 2, 1, "MULTI_CPU"),
    ]
    assert session.pull("hf_plain") == [(2, 0), (2, 1)]
    _group_works(session)


def test_accelerate_notebook_launcher_is_refused(session):
    text, took = _refused(
        session,
        "from accelerate import notebook_launcher\n"
        "def train(steps):\n"
        "    pass\n"
        "notebook_launcher(train, args=(2,), num_processes=2)",
    )
    assert "accelerate's notebook_launcher would start 2 processes" in text
    assert "train(*args)" in text
    assert took < 30
    _group_works(session)


def test_hf_trainer_two_steps_with_a_tiny_random_model(session):
    session.run(
        "import tempfile\n"
        "from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments\n"
        "config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,\n"
        "                    num_attention_heads=2, intermediate_size=32, max_position_embeddings=16)\n"
        "torch.manual_seed(0)\n"
        "hf_model = BertForSequenceClassification(config)\n"
        "g = torch.Generator().manual_seed(rank)\n"
        "data = [{'input_ids': torch.randint(0, 64, (8,), generator=g), 'labels': i % 2}\n"
        "        for i in range(32)]\n"
        "args = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=2,\n"
        "                         per_device_train_batch_size=4, report_to=[], use_cpu=True,\n"
        "                         save_strategy='no', disable_tqdm=True)\n"
        "hf_trainer = Trainer(model=hf_model, args=args, train_dataset=data)\n"
        "hf_trainer.train()\n"
        "hf_facts = (args.world_size, args.process_index, hf_trainer.state.global_step,\n"
        "            type(hf_trainer.model_wrapped).__name__)\n"
        "hf_weights = torch.cat([p.detach().flatten() for p in hf_model.parameters()])"
    )
    assert session.pull("hf_facts") == [
        (2, 0, 2, "DistributedDataParallel"),
        (2, 1, 2, "DistributedDataParallel"),
    ]
    w0, w1 = session.pull("hf_weights")
    torch.testing.assert_close(w0, w1, rtol=0, atol=0)


def test_mp_spawn_fails_at_once_naming_what_to_call(session):
    session.run("import torch.multiprocessing as mp\ndef worker(i, scale):\n    return i * scale")
    text, took = _refused(session, "mp.spawn(worker, args=(10,), nprocs=2)")
    assert "LaunchInsideRank: torch.multiprocessing.spawn (mp.spawn) would start 2" in text
    assert "already are the processes it would start" in text
    assert "worker(rank, *args)" in text
    assert took < 30
    text, _ = _refused(session, "mp.start_processes(worker, args=(10,), nprocs=2)")
    assert "torch.multiprocessing.start_processes (start_method='spawn') would start 2" in text
    # What the message says to do instead works.
    session.run("result = worker(rank, 10)")
    assert session.pull("result") == [0, 10]
    _group_works(session)


def test_multiprocessing_with_a_cell_function(session):
    session.run(
        "import multiprocessing\n"
        "def square_into(q, x):\n"
        "    q.put(x * x)\n"
        "fork = multiprocessing.get_context('fork')\n"
        "q = fork.Queue()\n"
        "p = fork.Process(target=square_into, args=(q, rank + 2))\n"
        "p.start(); got = q.get(timeout=60); p.join(60)\n"
        "fork_result = (got, p.exitcode)"
    )
    assert session.pull("fork_result") == [(4, 0), (9, 0)]
    # A "spawn" child cannot see cell definitions: refused before it starts.
    text, took = _refused(
        session,
        "ctx = multiprocessing.get_context('spawn')\n"
        "ctx.Process(target=square_into, args=(ctx.Queue(), 3)).start()",
    )
    assert "CellFunctionInChild" in text and "square_into was defined in a cell" in text
    assert "get_context('fork')" in text
    assert took < 30
    # Helpers that join no group may use torch's launcher when asked for explicitly.
    session.run(
        "import torch.multiprocessing as mp\n"
        "from nbdist.engine.launcher_refusal import allow_launchers\n"
        "def helper(i, q):\n"
        "    q.put(i)\n"
        "q = fork.Queue()\n"
        "with allow_launchers():\n"
        "    mp.start_processes(helper, args=(q,), nprocs=2, start_method='fork')\n"
        "helpers = sorted(q.get(timeout=60) for _ in range(2))"
    )
    assert session.pull("helpers") == [[0, 1], [0, 1]]
    _group_works(session)
