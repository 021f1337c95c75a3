"""Rank side: sharded checkpoints of a model and its optimizer, on ``torch.distributed.checkpoint``.

Every rank calls :func:`save` (and :func:`load`) together, like a collective:
each rank writes only its own shards (an FSDP2 ``fully_shard`` model's DTensor
shards; a DDP model's replicated weights once, not once per rank), so a
checkpoint costs each rank its share of the bytes. The state dicts come from
``torch.distributed.checkpoint.state_dict.get_state_dict``, which unwraps DDP
(no ``module.`` prefix) and keys optimizer state by parameter name: a
checkpoint saved under DDP loads into FSDP2, into another world size, or into
a plain model in one process (no process group), e.g. for evaluation.
Before writing, :func:`save` sends the points the rank logged with
``nbdist.log`` so far: a rank that dies after the checkpoint leaves no hole in
the run's history (training resumes from the checkpoint and logs the later
steps again; reading the run keeps the latest value of each step).

Layout of a checkpoint directory::

    step_20/
      __0_0.distcp  __1_0.distcp ...   tensors, one file per writing rank
      .metadata                         torch.distributed.checkpoint's index
      nbdist.json                       {"step": 20, "extra": {...}} written last

``nbdist.json`` is written by rank 0 only after every rank finished writing,
so a save interrupted by a dead rank leaves a directory without it, which
:func:`load` refuses and :func:`latest` skips. Plain ``extra`` values
(numbers, strings, lists, dicts) go to that JSON file; objects with
``state_dict()`` (an LR scheduler, a GradScaler) and tensors go with the shards. A
tensor is each rank's own (a per-rank RNG state comes back to the rank that saved
it; a rank beyond those that saved it gets None, and a warning); a DTensor is one
tensor, sharded. An object's state must be the same on every rank: one rank's is kept.

Example (in ``%%on_all_ranks`` cells)::

    ckpt = nbdist.checkpoint
    for step in range(start, 100):
        loss = train_step()
        nbdist.log(step=step, loss=loss)
        if step % 10 == 9:
            ckpt.save(f"ckpt/step_{step + 1}", model=model, optimizer=opt, step=step + 1)

    # after %dist_restart: rebuild model and optimizer, then
    info = ckpt.load(ckpt.latest("ckpt"), model=model, optimizer=opt)
    start = info["step"]

    # or, in one call that also starts afresh when there is no checkpoint yet:
    start = ckpt.resume("ckpt", model=model, optimizer=opt)

Checkpoints hold pickled metadata (torch's format): load only checkpoints you
or your job wrote.
"""

from __future__ import annotations

import json
import os
import re

__all__ = ["CheckpointError", "latest", "load", "resume", "save"]

_INFO = "nbdist.json"
_STEP_DIR = re.compile(r"(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or read as asked; the message says why and the fix."""


def _path(path) -> str:
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise CheckpointError(
            f"checkpoint path {path!r}: give a directory path, e.g. 'ckpt/step_100'"
        )
    # "~/ckpt" means the home directory, as in a shell (not a directory named "~").
    return os.path.abspath(os.path.expanduser(os.fspath(path)))


def _check_objects(model, optimizer) -> None:
    """Refuse, on every rank alike and before anything is written, what is no model or optimizer."""
    import torch

    for name, value in (("model", model), ("optimizer", optimizer)):
        if value is None:
            continue
        if isinstance(value, dict):
            raise CheckpointError(
                f"{name}= takes the {name} itself, not its state_dict(): "
                f"pass {name}={name}, e.g. save(path, model=model, optimizer=opt)"
            )
        if isinstance(value, type):
            raise CheckpointError(
                f"{name}={value.__name__} is a class: pass the {name} you built, "
                f"e.g. {name}={value.__name__}(...)"
            )
    if model is not None and not isinstance(model, torch.nn.Module):
        raise CheckpointError(
            f"model= must be a torch.nn.Module (plain, DDP or FSDP2), got {type(model).__name__}"
        )


def _grouped() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _dist():
    """(rank, world_size, barrier) of the default group, or of one process without one."""
    import torch.distributed as dist

    if _grouped():
        return dist.get_rank(), dist.get_world_size(), dist.barrier
    return 0, 1, lambda: None


def _dcp(fn, state: dict, path: str) -> None:
    """``dcp.save``/``dcp.load``; without a process group, one process, said quietly."""
    import warnings

    with warnings.catch_warnings():
        if not _grouped():
            # Loading a checkpoint in one process (evaluation, the kernel) is intended.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        fn(state, checkpoint_id=path)


def _stateful(value) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None)
    )


def _whole_step(step) -> int:
    """``step`` as an int (a NumPy integer too), or refused."""
    import operator

    try:
        value = None if isinstance(step, bool) else operator.index(step)
    except TypeError:
        value = None
    if value is None or value < 0:
        raise CheckpointError(f"step={step!r}: give a whole number >= 0, or leave it out")
    return value


def _plain(value):
    """A NumPy scalar (``np.float32(0.3)``) as the Python number it holds; anything else as is."""
    if type(value).__module__ == "numpy" and callable(getattr(value, "item", None)):
        if getattr(value, "ndim", None) == 0:
            return value.item()
    return value


def _split_extra(extra: dict) -> tuple[dict, dict, dict]:
    """(JSON values, stateful objects, tensors) of the extra keyword arguments."""
    import torch

    plain, stateful, tensors = {}, {}, {}
    for name, value in extra.items():
        if _stateful(value):
            stateful[name] = value
        elif isinstance(value, torch.Tensor):
            tensors[name] = value
        else:
            value = _plain(value)
            try:
                json.dumps(value)
            except (TypeError, ValueError):
                raise CheckpointError(
                    f"extra value {name}={type(value).__name__}: give a number, string, list or "
                    "dict, a tensor, or an object with state_dict()/load_state_dict()"
                ) from None
            key = _key_not_text(value)
            if key is not None:
                raise CheckpointError(
                    f"extra value {name}: its key {key!r} ({type(key).__name__}) would load as "
                    f"{json.dumps({key: 0})[1:-4]} (the checkpoint's values are JSON, whose keys "
                    "are text): use string keys, or save it as a list of pairs"
                )
            plain[name] = value
    return plain, stateful, tensors


def _key_not_text(value):
    """The first dict key in ``value`` that is no string (JSON would turn it into one), or None."""
    if isinstance(value, dict):
        for key, inner in value.items():
            if not isinstance(key, str):
                return key
            found = _key_not_text(inner)
            if found is not None:
                return found
    elif isinstance(value, (list, tuple)):
        for inner in value:
            found = _key_not_text(inner)
            if found is not None:
                return found
    return None


def _model_state(model, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if model is None:
        if optimizer is not None:
            raise CheckpointError(
                "optimizer= needs model= too: optimizer state is keyed by the model's "
                "parameter names"
            )
        return {}
    # get_state_dict creates the optimizer's lazy state (e.g. Adam's moments) when it
    # has not stepped yet, so a fresh optimizer has the keys a saved one has.
    model_sd, optim_sd = get_state_dict(model, optimizer if optimizer is not None else [])
    state = {"model": model_sd}
    if optimizer is not None:
        state["optimizer"] = optim_sd
    return state


def save(path, *, model=None, optimizer=None, step: int | None = None, **extra) -> str:
    """Write a sharded checkpoint to the directory ``path``; every rank must call it.

    ``model`` (plain, DDP or FSDP2), ``optimizer``, ``step`` and any ``extra``
    keyword values (JSON-able values: a tuple loads as a list, a dict's keys must be strings;
    tensors; objects with ``state_dict()``).
    Returns the absolute path. Example::

        nbdist.checkpoint.save(f"ckpt/step_{step}", model=model, optimizer=opt, step=step,
                               scheduler=sched, best_loss=0.31)
    """
    import torch.distributed.checkpoint as dcp

    path = _path(path)
    if step is not None:
        step = _whole_step(step)
    _check_objects(model, optimizer)
    plain, stateful, tensors = _split_extra(extra)
    state = _model_state(model, optimizer)
    if not state and not stateful and not tensors and step is None and not plain:
        raise CheckpointError("nothing to save: pass model=, optimizer=, step= or extra values")
    state.update({f"extra.{name}": obj.state_dict() for name, obj in stateful.items()})
    rank, world_size, barrier = _dist()
    own = sorted(name for name, tensor in tensors.items() if not _is_dtensor(tensor))
    if tensors:
        # A key every rank has is written once, by one of them: each rank's own tensor goes
        # under a key of its rank's. A DTensor is one tensor in shards, under one key.
        state["tensors"] = {
            name: {str(rank): tensor} if name in own else tensor for name, tensor in tensors.items()
        }
    # Points logged up to here reach the kernel now, not at the next timed flush: if
    # the rank dies after this checkpoint, training resumes from it and re-logs only
    # later steps, so earlier points still on the rank would be a hole in the run.
    # Sent is not arrived: a rank killed a few steps after its saves on a loaded machine
    # had lost two flushes' points (example 19), so the save waits for the collector's
    # word (a round trip, under a millisecond here; 2 s at most).
    from nbdist.metrics.log import flush

    flush(wait_s=2.0)
    _same_path_everywhere(path)
    problem = _prepare_directory(path) if rank == 0 else None
    # Every rank learns whether rank 0 could make the directory: a failure there
    # raises on all ranks instead of leaving the others waiting in a collective.
    problem = _from_rank0(problem)
    if problem:
        raise CheckpointError(problem)
    _dcp(dcp.save, state, path)
    if rank == 0:
        info = {
            "step": step,
            "extra": plain,
            "stateful": sorted(stateful),
            "tensors": sorted(tensors),
            "tensors_per_rank": own,
            "model": model is not None,
            "optimizer": optimizer is not None,
            "world_size": world_size,
        }
        tmp = os.path.join(path, f".{_INFO}.tmp")
        with open(tmp, "w") as f:
            json.dump(info, f)
        os.replace(tmp, os.path.join(path, _INFO))
    # Nobody returns before the checkpoint is complete: a rank killed right after
    # save() must not leave the others believing in a checkpoint without marker.
    barrier()
    return path


def _prepare_directory(path: str) -> str | None:
    """Make ``path`` ready to write (rank 0); what went wrong, as a message, or None."""
    try:
        os.makedirs(path, exist_ok=True)
        if not os.access(path, os.W_OK):
            raise PermissionError(13, "Permission denied")
        # Overwriting: the old marker goes first, so a save cut short is never
        # mistaken for a complete one.
        try:
            os.remove(os.path.join(path, _INFO))
        except FileNotFoundError:
            pass
    except OSError as exc:
        reason = exc.strerror or str(exc)
        if os.path.exists(path) and not os.path.isdir(path):
            reason = "a file of that name exists"
        return (
            f"checkpoint {path!r} cannot be written ({reason}): give a directory path "
            "you can write to (it is created if missing), e.g. 'ckpt/step_100'"
        )
    return None


def _same_path_everywhere(path: str) -> None:
    """Refuse, on every rank alike, a save whose ranks name different directories."""
    import torch.distributed as dist

    if not _grouped():
        return
    paths = [None] * dist.get_world_size()
    dist.all_gather_object(paths, path)
    if len(set(paths)) > 1:
        other = next(r for r, p in enumerate(paths) if p != paths[0])
        raise CheckpointError(
            f"every rank must save to the same directory (each writes its shards into it), "
            f"but rank 0 gave {paths[0]!r} and rank {other} {paths[other]!r}: pass one path, "
            "e.g. save(f'ckpt/step_{step}', ...) without the rank in it"
        )


def _from_rank0(value):
    """``value`` as rank 0 has it, on every rank (itself without a process group)."""
    import torch.distributed as dist

    if not _grouped():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _read_info(path: str) -> dict:
    info_file = os.path.join(path, _INFO)
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path!r} does not exist: check the path, or save first")
    if not os.path.exists(info_file):
        raise CheckpointError(
            f"checkpoint {path!r} is incomplete (no {_INFO}: its save did not finish, e.g. a rank "
            "died): load an earlier one, e.g. nbdist.checkpoint.latest(<its parent directory>)"
        )
    with open(info_file) as f:
        return json.load(f)


def load(path, *, model=None, optimizer=None, **extra) -> dict:
    """Read the checkpoint at ``path`` into ``model``/``optimizer``/``extra`` objects; every rank calls it.

    Restores in place (the model and optimizer must be built, and wrapped in
    DDP/FSDP2, as for training); a model whose parameter names or shapes differ
    from the saved one is refused before anything is loaded. Returns ``{"step": ..., **plain extra values}``.
    Tensors saved as extra values are in the result too. Example::

        info = nbdist.checkpoint.load("ckpt/step_20", model=model, optimizer=opt, scheduler=sched)
        start = info["step"]
    """
    import torch.distributed.checkpoint as dcp

    path = _path(path)
    _check_objects(model, optimizer)
    info = _read_info(path)
    if optimizer is not None and not info.get("optimizer"):
        raise CheckpointError(
            f"checkpoint {path!r} has no optimizer state: load without optimizer=, "
            "or save with optimizer= next time"
        )
    if model is not None and not info.get("model"):
        raise CheckpointError(f"checkpoint {path!r} has no model state: load without model=")
    missing = [name for name in extra if name not in info.get("stateful", [])]
    if missing:
        raise CheckpointError(
            f"checkpoint {path!r} has no state for {missing[0]!r} (it has: "
            f"{', '.join(info.get('stateful', [])) or 'none'}): save it with "
            f"{missing[0]}=... or leave it out here"
        )
    bad = [name for name, obj in extra.items() if not _stateful(obj)]
    if bad:
        raise CheckpointError(
            f"{bad[0]}= must be an object with state_dict()/load_state_dict() to load into"
        )
    state = _model_state(model, optimizer)
    state.update({f"extra.{name}": obj.state_dict() for name, obj in extra.items()})
    if model is not None:
        _check_same_model(path, state["model"])
    templates = _tensor_templates(path, info) if info.get("tensors") else {}
    if templates:
        state["tensors"] = templates
    # Decided alike on every rank (a rank beyond those that saved its tensors may have
    # nothing to read, and still takes part in the load's collectives).
    if state or info.get("tensors"):
        _dcp(dcp.load, state, path)
    if model is not None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            model,
            optimizer if optimizer is not None else [],
            model_state_dict=state["model"],
            optim_state_dict=state.get("optimizer", {}),
        )
    for name, obj in extra.items():
        obj.load_state_dict(state[f"extra.{name}"])
    result = {"step": info.get("step"), **info.get("extra", {})}
    for name in info.get("tensors", []):
        saved = templates.get(name)
        result[name] = next(iter(saved.values())) if isinstance(saved, dict) else saved
    return result


def _check_same_model(path: str, model_state: dict) -> None:
    """Refuse a model whose parameter names or shapes differ from the checkpoint's.

    Every rank reads the same index and sees the same global shapes (a DTensor's
    ``shape`` is its whole tensor's), so all ranks refuse alike, before loading.
    """
    import torch
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(path).read_metadata().state_dict_metadata
    saved_model = {
        key[len("model.") :]: getattr(meta, "size", None)
        for key, meta in saved.items()
        if key.startswith("model.")
    }
    here = {k: v for k, v in model_state.items() if isinstance(v, torch.Tensor)}
    problems = [
        f"{name!r} is {list(saved_model[name])} there and {list(value.shape)} here"
        for name, value in here.items()
        if name in saved_model
        and saved_model[name] is not None
        and tuple(saved_model[name]) != tuple(value.shape)
    ]
    missing = [name for name in here if name not in saved_model]
    unused = [name for name in saved_model if name not in model_state]
    if missing:
        problems.append(f"{_few(missing)} not in the checkpoint")
    if unused:
        problems.append(f"{_few(unused)} in the checkpoint but not in this model")
    if problems:
        raise CheckpointError(
            f"checkpoint {path!r} holds another model than model=: {'; '.join(problems)}. "
            "Build the model as it was when saved (same layers and sizes) before loading"
        )


def _few(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:3])
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return f"{shown}{more} {'is' if len(names) == 1 else 'are'}"


def _tensor_templates(path: str, info: dict) -> dict:
    """Empty tensors shaped as the saved ones (this rank's), for dcp.load to fill."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(path).read_metadata().state_dict_metadata
    rank, world_size, _ = _dist()
    own = set(info.get("tensors_per_rank") or ())  # saved before 2026-11-30: none
    saved_world = info.get("world_size", 1)
    # Every rank looks at every rank's keys (one index for all): a tensor some rank did not
    # save is refused on all ranks alike, none left waiting in the load's collective.
    missing = [
        f"{name!r} of rank {r}"
        for name in sorted(own)
        for r in range(min(world_size, saved_world))
        if f"tensors.{name}.{r}" not in metadata
    ]
    if missing:
        raise CheckpointError(
            f"checkpoint {path!r} holds no tensor {missing[0]} (not every rank saved it): "
            "save the same extra values on every rank"
        )
    out = {}
    for name in info["tensors"]:
        if name in own and rank >= saved_world:
            continue  # nothing of its own: None in the result
        meta = metadata[f"tensors.{name}.{rank}" if name in own else f"tensors.{name}"]
        empty = torch.empty(meta.size, dtype=meta.properties.dtype)
        out[name] = {str(rank): empty} if name in own else empty
    none = sorted(own - set(out))
    if none:
        import warnings

        warnings.warn(
            f"checkpoint {path!r} was saved by {saved_world} rank(s): rank {rank} has no "
            f"{', '.join(none)} of its own (None in what load returns)",
            stacklevel=3,
        )
    return out


def _is_dtensor(tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without DTensor: none is one
        return False
    return isinstance(tensor, DTensor)


def latest(directory) -> str | None:
    """The newest complete checkpoint under ``directory`` (highest step), or None.

    Looks at the subdirectories that have a finished ``nbdist.json``; a
    checkpoint whose save was cut short is skipped. Example::

        path = nbdist.checkpoint.latest("ckpt")   # e.g. '/home/me/ckpt/step_20'
    """
    directory = _path(directory)
    if os.path.isfile(directory):
        raise CheckpointError(
            f"{directory!r} is a file: give the directory that holds the checkpoints, e.g. 'ckpt'"
        )
    if os.path.isfile(os.path.join(directory, _INFO)):
        raise CheckpointError(
            f"{directory!r} is one checkpoint, not a directory of them: pass its parent "
            f"({os.path.dirname(directory)!r}) to latest()/resume(), or load it with "
            "nbdist.checkpoint.load(path, ...)"
        )
    if not os.path.isdir(directory):
        return None
    best: tuple[int, float, str] | None = None
    for name in os.listdir(directory):
        candidate = os.path.join(directory, name)
        info_file = os.path.join(candidate, _INFO)
        if not os.path.isfile(info_file):
            continue
        try:
            with open(info_file) as f:
                step = json.load(f).get("step")
        except (OSError, ValueError):
            continue
        if not isinstance(step, int):
            match = _STEP_DIR.search(name)
            step = int(match.group(1)) if match else -1
        key = (step, os.path.getmtime(info_file), candidate)
        if best is None or key > best:
            best = key
    return best[2] if best else None


def resume(directory, *, model=None, optimizer=None, **extra) -> int:
    """Load the newest complete checkpoint under ``directory``; the step to go on from (0 if none).

    Every rank calls it, after building (and wrapping) the model and optimizer
    as for training: the one call a loop that may be killed and restarted
    needs. A checkpoint saved without ``step=`` resumes at 0. Example::

        start = nbdist.checkpoint.resume("ckpt", model=model, optimizer=opt)
        for step in range(start, 1000):
            ...
            if (step + 1) % 50 == 0:
                nbdist.checkpoint.save(f"ckpt/step_{step + 1}", model=model,
                                       optimizer=opt, step=step + 1)
    """
    path = latest(directory)
    if path is None:
        return 0
    info = load(path, model=model, optimizer=optimizer, **extra)
    return int(info.get("step") or 0)
