"""The zygote imports what building a DDP model imports, where many ranks start
(nbdist/launch/zygote_imports.py, ``dynamo_pays``): a rank forked from it builds one
without importing a module of its own, and the zygote can still fork."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_CHECK = """
import gc, json, os, sys
gc.disable()  # as the zygote imports
from nbdist.launch import zygote, zygote_imports
zygote_imports.import_all(int(sys.argv[1]))
unsafe = zygote.fork_unsafe_reason()
gc.enable()
import torch, torch.distributed as dist
dist.init_process_group("gloo", rank=0, world_size=1, init_method="file://" + sys.argv[2])
before = set(sys.modules)
torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
dist.destroy_process_group()
print(json.dumps({"unsafe": unsafe, "imported": len(set(sys.modules) - before)}))
"""


@pytest.mark.parametrize("forks", [8, 2])
def test_a_rank_builds_ddp_without_imports_of_its_own_where_many_ranks_start(forks, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")  # the zygote's setting: no thread at torch's import
    out = subprocess.run(
        [sys.executable, "-c", _CHECK, str(forks), str(tmp_path / "store")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["unsafe"] is None  # the import started no thread: the zygote forks
    if forks == 8:
        assert found["imported"] == 0
    else:  # few ranks: not imported at the start, so the first DDP pays (hundreds of modules)
        assert found["imported"] > 100


@pytest.mark.parametrize(("forks", "pays"), [(7, False), (8, True), (256, True)])
def test_the_zygote_imports_dynamo_only_where_many_ranks_start(forks, pays):
    from nbdist.launch import zygote_imports

    assert zygote_imports.dynamo_pays(forks) is pays
