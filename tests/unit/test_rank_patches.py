"""The registry of rank-side patches (nbdist/engine/patches.py): complete, the one installer, idempotent."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

from nbdist.engine import patches

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ROOT / "nbdist" / "engine"


def _defines_install(path: Path) -> bool:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return any(isinstance(n, ast.FunctionDef) and n.name == "install" for n in tree.body)


def test_every_module_with_an_install_is_in_the_registry():
    """A new patch (an ``install`` in engine/) cannot be left out of the list."""
    with_install = {p.stem for p in ENGINE.glob("*.py") if _defines_install(p)}
    listed = {patch.name.partition(".")[0] for patch in patches.PATCHES}
    assert with_install, "no engine module defines install(): the scan is broken"
    assert with_install <= listed, f"not in nbdist.engine.patches.PATCHES: {with_install - listed}"


def test_every_entry_names_a_function_and_says_why_and_how_to_turn_it_off():
    import importlib

    names = [patch.name for patch in patches.PATCHES]
    assert len(names) == len(set(names)), names
    for patch in patches.PATCHES:
        module, _, function = patch.name.partition(".")
        found = getattr(importlib.import_module(f"nbdist.engine.{module}"), function or "install")
        assert callable(found), patch.name
        assert patch.stage in ("group", "rank", "kernel"), patch
        assert patch.wraps and patch.why and patch.turn_off, patch


def test_only_the_registry_installs_patches():
    """bootstrap and standalone go through nbdist.engine.patches, never an install() of their own."""
    patch_modules = {patch.name.partition(".")[0] for patch in patches.PATCHES}
    calls = []
    for path in sorted((ROOT / "nbdist").rglob("*.py")):
        if path == ENGINE / "patches.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            func = node.func if isinstance(node, ast.Call) else None
            if (
                isinstance(func, ast.Attribute)
                and func.attr in ("install", "track_subgroups")
                and isinstance(func.value, ast.Name)
                and func.value.id in patch_modules
            ):
                calls.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not calls, f"patches installed outside nbdist/engine/patches.py: {calls}"


def test_installing_twice_wraps_nothing_twice():
    """In a fresh process (the patches change torch for good): each wrapper wraps torch's own."""
    code = """
import multiprocessing.context as context
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.distributed.launcher.api as launcher_api
import torch.multiprocessing as tmp
from nbdist.engine import patches

def patched():
    return (
        dist.all_reduce, dist.send, dist.isend, c10d.isend, dist.init_process_group,
        dist.destroy_process_group, c10d._new_process_group_helper, tmp.spawn,
        tmp.start_processes, launcher_api.launch_agent, context.SpawnProcess._Popen,
    )

patches.install_on_group(stage_p2p=True)
patches.install_on_rank()
first = patched()
patches.install_on_group(stage_p2p=True)
patches.install_on_rank()
assert patched() == first, "a second install replaced functions again"
for fn in first:
    inner = getattr(fn, "nbdist_original", None) or getattr(fn, "nbdist_plain", None)
    assert inner is not None, fn
    assert not hasattr(getattr(inner, "nbdist_original", None), "nbdist_original"), fn
# The collectives wrapper counts the staged send: tracked(staged(torch's send)), each once.
assert dist.send.nbdist_original.nbdist_plain is c10d.send
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
