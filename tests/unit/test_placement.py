"""Unit tests for nbdist.launch.placement: where each rank runs, checked before any engine starts."""

from __future__ import annotations

import pytest

from nbdist.engine.devices import choose_backend, gpus_from_mask
from nbdist.errors import PlacementError
from nbdist.launch.options import parse_gpu_list
from nbdist.launch.placement import (
    EngineInfo,
    default_threads,
    parse_ranks,
    plan_attached,
    plan_local,
)

SHARED_GPU_ENV = "NCCL_MULTI_RANK_GPU_ENABLE"


@pytest.fixture(autouse=True)
def no_shared_gpu_env(monkeypatch):
    """The shared-GPU switch is read from the environment; keep the caller's out of the tests."""
    monkeypatch.delenv(SHARED_GPU_ENV, raising=False)


# --------------------------------------------------------------------------- plan_local


def test_one_rank_per_visible_gpu_by_default():
    p = plan_local(None, gpus_visible=[0, 1, 2, 3], cores=32)
    assert p.world_size == 4
    assert p.backend == "nccl"
    assert [s.gpu for s in p.slots] == [0, 1, 2, 3]
    assert [s.rank for s in p.slots] == [0, 1, 2, 3]
    assert [s.local_rank for s in p.slots] == [0, 1, 2, 3]
    assert {s.local_world_size for s in p.slots} == {4}
    # As under torchrun: every rank sees the same GPUs and takes cuda:<local rank>.
    assert [s.device for s in p.slots] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert p.visible_mask("localhost") == "0,1,2,3"
    assert p.uses_gpus


def test_gpus_subset_picks_the_named_gpu():
    p = plan_local(None, gpus_visible=[0, 1], cores=8, gpus=[1])
    assert p.world_size == 1
    assert p.slots[0].gpu == 1
    # The ranks see only the GPUs asked for (as CUDA_VISIBLE_DEVICES=1 torchrun would).
    assert (p.visible_mask("localhost"), p.slots[0].device) == ("1", "cuda:0")
    assert p.slots[0].rank == 0
    assert p.backend == "nccl"


def test_explicit_n_below_gpu_count_uses_the_first_gpus():
    p = plan_local(2, gpus_visible=[0, 1, 2, 3], cores=8)
    assert [s.gpu for s in p.slots] == [0, 1]


def test_no_gpu_gives_two_cpu_ranks_on_gloo():
    p = plan_local(None, gpus_visible=[], cores=2)
    assert p.world_size == 2
    assert p.backend == "gloo"
    assert [s.gpu for s in p.slots] == [None, None]
    assert [s.device for s in p.slots] == ["cpu", "cpu"]
    assert not p.uses_gpus


def test_explicit_cpu_rank_count_without_gpus():
    p = plan_local(5, gpus_visible=[], cores=10)
    assert p.world_size == 5
    assert [s.rank for s in p.slots] == [0, 1, 2, 3, 4]
    assert {s.local_world_size for s in p.slots} == {5}


def test_cpu_flag_ignores_visible_gpus():
    p = plan_local(None, gpus_visible=[0, 1, 2, 3], cores=8, cpu=True)
    assert p.backend == "gloo"
    assert not p.uses_gpus
    assert all(s.gpu is None and s.device == "cpu" for s in p.slots)


def test_cpu_flag_with_explicit_n_and_gpus_visible():
    p = plan_local(3, gpus_visible=[0, 1], cores=8, cpu=True)
    assert p.world_size == 3
    assert p.backend == "gloo"
    assert all(s.gpu is None for s in p.slots)


NCCL_230 = (2, 30, 7)
NCCL_229 = (2, 29, 3)


def _never_asked():
    raise AssertionError("NCCL's version must not be asked when no GPU is shared")


def test_one_rank_per_gpu_never_asks_nccl():
    p = plan_local(None, gpus_visible=[0, 1], cores=8, nccl=_never_asked)
    assert [s.gpu for s in p.slots] == [0, 1]
    assert p.shared_gpus == {}
    assert p.sharing_note() == ""


def test_more_ranks_than_gpus_share_them_round_robin_over_nccl_230():
    p = plan_local(5, gpus_visible=[0, 1], cores=10, nccl=lambda: NCCL_230)
    assert p.world_size == 5
    assert [s.gpu for s in p.slots] == [0, 1, 0, 1, 0]
    assert [s.device for s in p.slots] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1", "cuda:0"]
    assert p.backend == "nccl"
    assert p.shared_gpus == {("localhost", 0): [0, 2, 4], ("localhost", 1): [1, 3]}
    note = p.sharing_note()
    assert "ranks 0,2,4 share GPU 0; ranks 1,3 share GPU 1" in note
    assert "NCCL 2.30.7" in note and SHARED_GPU_ENV in note


def test_one_gpu_two_ranks_share_over_gloo_when_nccl_is_older():
    p = plan_local(2, gpus_visible=[0], cores=4, nccl=lambda: NCCL_229)
    assert [s.gpu for s in p.slots] == [0, 0]
    assert p.backend == "gloo"
    note = p.sharing_note()
    assert note.startswith("ranks 0,1 share GPU 0 · gloo with CUDA tensors")
    assert "NCCL 2.29.3 cannot put two ranks on one GPU" in note


def test_sharing_without_nccl_at_all_uses_gloo():
    p = plan_local(3, gpus_visible=[2], cores=3, nccl=lambda: None)
    assert [s.gpu for s in p.slots] == [2, 2, 2]
    assert p.backend == "gloo"
    assert "NCCL none" in p.sharing_note()


def test_explicit_nccl_on_a_shared_gpu_with_old_nccl_is_refused_with_the_fixes():
    with pytest.raises(PlacementError) as info:
        plan_local(4, gpus_visible=[0, 1], cores=8, backend="nccl", nccl=lambda: NCCL_229)
    message = str(info.value)
    assert "4 ranks on 2 GPU(s)" in message
    assert "2.29.3" in message
    assert "at most 2 ranks" in message and "--cpu" in message and ">= 2.30" in message


def test_explicit_gloo_on_a_shared_gpu_is_kept_even_with_new_nccl():
    p = plan_local(2, gpus_visible=[0], cores=4, backend="gloo", nccl=lambda: NCCL_230)
    assert p.backend == "gloo"


def test_user_set_sharing_switch_is_trusted_with_an_older_nccl(monkeypatch):
    monkeypatch.setenv(SHARED_GPU_ENV, "1")
    p = plan_local(3, gpus_visible=[2], cores=3, nccl=lambda: NCCL_229)
    assert [s.gpu for s in p.slots] == [2, 2, 2]
    assert p.backend == "nccl"


def test_cpu_flag_never_shares_gpus():
    p = plan_local(4, gpus_visible=[0], cores=4, cpu=True, nccl=_never_asked)
    assert p.backend == "gloo" and not p.uses_gpus and p.sharing_note() == ""


@pytest.mark.parametrize("n", [0, -1, True, 2.0, "2"])
def test_bad_rank_count_is_refused_naming_the_value(n):
    with pytest.raises(PlacementError) as info:
        plan_local(n, gpus_visible=[], cores=4)
    assert repr(n) in str(info.value)


@pytest.mark.parametrize("threads", [0, -3, 1.5])
def test_bad_threads_is_refused_naming_the_value(threads):
    with pytest.raises(PlacementError) as info:
        plan_local(2, gpus_visible=[], cores=4, threads=threads)
    message = str(info.value)
    assert "--threads" in message
    assert repr(threads) in message


def test_nccl_without_gpus_is_refused_pointing_to_gloo():
    with pytest.raises(PlacementError) as info:
        plan_local(2, gpus_visible=[], cores=4, backend="nccl")
    message = str(info.value)
    assert "nccl" in message
    assert "gloo" in message


def test_nccl_with_cpu_flag_is_refused():
    with pytest.raises(PlacementError, match="nccl"):
        plan_local(2, gpus_visible=[0, 1], cores=4, backend="nccl", cpu=True)


def test_unknown_backend_is_refused_listing_choices():
    with pytest.raises(PlacementError) as info:
        plan_local(None, gpus_visible=[0, 1], cores=4, backend="mpi")
    message = str(info.value)
    assert "'mpi'" in message
    assert "nccl" in message and "gloo" in message


def test_gloo_on_gpus_is_allowed():
    p = plan_local(None, gpus_visible=[0, 1], cores=4, backend="gloo")
    assert p.backend == "gloo"
    assert [s.gpu for s in p.slots] == [0, 1]


def test_backend_name_is_case_insensitive():
    assert plan_local(None, gpus_visible=[0], cores=4, backend="NCCL").backend == "nccl"


def test_gpus_naming_an_invisible_gpu_lists_the_visible_ones():
    with pytest.raises(PlacementError) as info:
        plan_local(None, gpus_visible=[0, 1], cores=4, gpus=[1, 5])
    message = str(info.value)
    assert "GPU 5" in message
    assert "0,1" in message


def test_gpus_without_any_visible_gpu_says_none():
    with pytest.raises(PlacementError, match="none"):
        plan_local(None, gpus_visible=[], cores=4, gpus=[0])


def test_cpu_and_gpus_contradict():
    with pytest.raises(PlacementError) as info:
        plan_local(None, gpus_visible=[0, 1], cores=4, cpu=True, gpus=[0])
    message = str(info.value)
    assert "--cpu" in message and "--gpus" in message


@pytest.mark.parametrize(
    ("cores", "n", "expected"),
    [(2, 4, 1), (32, 4, 8), (7, 2, 3), (1, 1, 1)],
)
def test_default_threads_share_the_cores(cores, n, expected):
    p = plan_local(n, gpus_visible=[], cores=cores)
    assert p.threads == {"localhost": expected}
    assert all(p.threads_for(s) == expected for s in p.slots)


def test_explicit_threads_are_kept():
    p = plan_local(4, gpus_visible=[], cores=2, threads=6)
    assert p.threads == {"localhost": 6}


def test_host_name_is_used_for_slots_and_threads():
    p = plan_local(2, gpus_visible=[], cores=4, host="node7")
    assert {s.host for s in p.slots} == {"node7"}
    assert p.threads == {"node7": 2}


def test_default_threads_function():
    assert default_threads(2, 4) == 1
    assert default_threads(32, 4) == 8
    assert default_threads(8, 0) == 8
    assert default_threads(0, 4) == 1


# --------------------------------------------------------------------------- choose_backend


def test_choose_backend_defaults():
    assert choose_backend(None, uses_gpus=True) == "nccl"
    assert choose_backend(None, uses_gpus=False) == "gloo"
    assert choose_backend("gloo", uses_gpus=True) == "gloo"
    assert choose_backend("Gloo", uses_gpus=False) == "gloo"


# --------------------------------------------------------------------------- plan_attached


def _engines(*pairs, gpus=0):
    return [EngineInfo(eid, host, f"10.0.0.{ord(host[-1])}", gpus) for eid, host in pairs]


def test_attached_ranks_are_numbered_host_by_host():
    engines = _engines((0, "A"), (1, "B"), (2, "A"), (3, "B"), gpus=2)
    placement, by_engine = plan_attached(engines, cores={"A": 8, "B": 8})
    assert placement.world_size == 4
    assert placement.backend == "nccl"
    a0, b1, a2, b3 = (by_engine[i] for i in range(4))
    assert (a0.host, a0.rank, a0.local_rank) == ("A", 0, 0)
    assert (a2.host, a2.rank, a2.local_rank) == ("A", 1, 1)
    assert (b1.host, b1.rank, b1.local_rank) == ("B", 2, 0)
    assert (b3.host, b3.rank, b3.local_rank) == ("B", 3, 1)
    assert {s.local_world_size for s in placement.slots} == {2}
    # GPU hosts: each engine's GPU is its local rank.
    assert all(s.gpu == s.local_rank for s in placement.slots)
    assert [s.rank for s in placement.slots] == [0, 1, 2, 3]


def test_attached_numbering_does_not_depend_on_registration_order():
    engines = _engines((3, "B"), (2, "A"), (1, "B"), (0, "A"), gpus=2)
    _, by_engine = plan_attached(engines, cores={})
    assert {eid: (s.host, s.rank) for eid, s in by_engine.items()} == {
        0: ("A", 0),
        2: ("A", 1),
        1: ("B", 2),
        3: ("B", 3),
    }


def test_attached_host_order_follows_lowest_engine_id():
    engines = _engines((5, "A"), (0, "B"), (1, "B"))
    _, by_engine = plan_attached(engines, cores={})
    assert by_engine[0].rank == 0
    assert by_engine[1].rank == 1
    assert by_engine[5].rank == 2
    assert by_engine[5].local_world_size == 1


def test_attached_cpu_hosts_use_gloo_and_no_gpus():
    engines = _engines((0, "A"), (1, "A"))
    placement, _ = plan_attached(engines, cores={"A": 4})
    assert placement.backend == "gloo"
    assert all(s.gpu is None for s in placement.slots)


def test_attached_cpu_flag_on_gpu_hosts():
    engines = _engines((0, "A"), (1, "A"), gpus=2)
    placement, _ = plan_attached(engines, cores={"A": 4}, cpu=True)
    assert placement.backend == "gloo"
    assert not placement.uses_gpus


def test_attached_host_with_more_engines_than_gpus_shares_them_naming_the_host():
    engines = _engines((0, "A"), (1, "A"), gpus=4) + _engines(
        (2, "gpu-node-2"), (3, "gpu-node-2"), (4, "gpu-node-2"), gpus=2
    )
    placement, _ = plan_attached(engines, cores={}, nccl=lambda: NCCL_230)
    assert [s.gpu for s in placement.slots] == [0, 1, 0, 1, 0]
    assert placement.backend == "nccl"
    assert placement.shared_gpus == {("gpu-node-2", 0): [2, 4]}
    assert "ranks 2,4 share GPU 0 on gpu-node-2" in placement.sharing_note()


def test_attached_shared_gpus_with_old_nccl_use_gloo():
    engines = _engines((0, "A"), (1, "A"), (2, "A"), gpus=2)
    placement, _ = plan_attached(engines, cores={}, nccl=lambda: NCCL_229)
    assert [s.gpu for s in placement.slots] == [0, 1, 0]
    assert placement.backend == "gloo"


def test_attached_without_engines_is_refused():
    with pytest.raises(PlacementError, match="no engines"):
        plan_attached([], cores={})


def test_attached_nccl_on_cpu_hosts_is_refused():
    with pytest.raises(PlacementError, match="gloo"):
        plan_attached(_engines((0, "A")), cores={"A": 2}, backend="nccl")


def test_attached_threads_come_from_each_hosts_cores():
    engines = _engines((0, "A"), (1, "A"), (2, "B"), (3, "B"), (4, "B"), (5, "B"))
    placement, by_engine = plan_attached(engines, cores={"A": 16, "B": 8})
    assert placement.threads == {"A": 8, "B": 2}
    assert placement.threads_for(by_engine[0]) == 8
    assert placement.threads_for(by_engine[5]) == 2


def test_attached_unknown_cores_default_to_one_thread():
    placement, _ = plan_attached(_engines((0, "A"), (1, "A")), cores={})
    assert placement.threads == {"A": 1}


def test_attached_explicit_threads_apply_to_every_host():
    engines = _engines((0, "A"), (1, "B"))
    placement, _ = plan_attached(engines, cores={"A": 16, "B": 2}, threads=3)
    assert placement.threads == {"A": 3, "B": 3}


def test_attached_bad_threads_is_refused():
    with pytest.raises(PlacementError, match="0"):
        plan_attached(_engines((0, "A")), cores={}, threads=0)


# --------------------------------------------------------------------------- parse_ranks


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0,2", [0, 2]),
        ("0-3", [0, 1, 2, 3]),
        (" 1 ", [1]),
        ("3, 0-1", [0, 1, 3]),
        ("1 - 2", [1, 2]),
        ("2,2,1", [1, 2]),
        ([2, 0], [0, 2]),
        ((3,), [3]),
        (1, [1]),
        (None, [0, 1, 2, 3]),
    ],
)
def test_parse_ranks(text, expected):
    assert parse_ranks(text, 4) == expected


def test_parse_ranks_backwards_range_suggests_the_fix():
    with pytest.raises(PlacementError) as info:
        parse_ranks("3-1", 4)
    message = str(info.value)
    assert "'3-1'" in message
    assert "1-3" in message


@pytest.mark.parametrize("text", ["a", "0,,1", "1;2", "-1", "0-", ""])
def test_parse_ranks_rejects_garbage_naming_it(text):
    with pytest.raises(PlacementError) as info:
        parse_ranks(text, 4)
    message = str(info.value)
    assert repr(text) in message
    assert "0..3" in message


@pytest.mark.parametrize(("text", "bad"), [("4", 4), ("0-5", 4), ([0, 7], 7), (-1, -1)])
def test_parse_ranks_out_of_range_names_rank_and_valid_range(text, bad):
    with pytest.raises(PlacementError) as info:
        parse_ranks(text, 4)
    message = str(info.value)
    assert f"rank {bad}" in message
    assert "0..3" in message


def test_parse_ranks_empty_selection_is_refused():
    with pytest.raises(PlacementError, match="no ranks"):
        parse_ranks([], 4)


# --------------------------------------------------------------------------- parse_gpu_list


def test_parse_gpu_list():
    assert parse_gpu_list("0,1,3") == [0, 1, 3]
    assert parse_gpu_list(" 2 , 0 ") == [2, 0]
    assert parse_gpu_list("7") == [7]


@pytest.mark.parametrize("text", ["0,,1", "x", "", "0-2", "-1", "1.0"])
def test_parse_gpu_list_rejects_non_indices(text):
    with pytest.raises(PlacementError) as info:
        parse_gpu_list(text)
    message = str(info.value)
    assert repr(text) in message
    assert "--gpus 0,1,2" in message


def test_parse_gpu_list_rejects_duplicates():
    with pytest.raises(PlacementError) as info:
        parse_gpu_list("0,1,0")
    assert "twice" in str(info.value)


# --------------------------------------------------------------------------- gpus_from_mask


@pytest.mark.parametrize(
    ("mask", "count", "already_masked", "expected"),
    [
        (None, 4, False, [0, 1, 2, 3]),
        (None, 0, False, []),
        ("2,3", 4, False, [2, 3]),
        ("3, 1", 4, False, [3, 1]),
        ("", 4, False, []),
        ("5", 4, False, []),
        ("1,5", 4, False, [1]),
        ("2,3", 2, True, [2, 3]),
        ("2,3,5", 2, True, [2, 3]),
        ("GPU-8f6e2b1c-1234-5678-9abc-def012345678", 4, False, []),
        ("0,GPU-8f6e2b1c", 4, False, [0]),  # CUDA stops at the first unusable entry
        ("1,5,2", 4, False, [1]),
        ("-1", 4, False, []),
    ],
)
def test_gpus_from_mask(mask, count, already_masked, expected):
    assert gpus_from_mask(mask, count, already_masked=already_masked) == expected


# --------------------------------------------------------------------------- several hosts


def test_hosts_sharing_a_hostname_are_told_apart_by_address():
    # Containers or network namespaces often share a hostname: the address separates them.
    engines = [
        EngineInfo(0, "node", "10.0.0.2", 0),
        EngineInfo(1, "node", "10.0.0.3", 0),
        EngineInfo(2, "node", "10.0.0.2", 0),
        EngineInfo(3, "node", "10.0.0.3", 0),
    ]
    placement, by_engine = plan_attached(engines, cores={"node": 4})
    assert placement.hosts == ["node@10.0.0.2", "node@10.0.0.3"]
    assert [(by_engine[e].rank, by_engine[e].local_rank) for e in range(4)] == [
        (0, 0),
        (2, 0),
        (1, 1),
        (3, 1),
    ]
    assert {s.local_world_size for s in placement.slots} == {2}
    # Cores come per hostname; each host splits them among its own ranks.
    assert placement.threads == {"node@10.0.0.2": 2, "node@10.0.0.3": 2}


def test_master_addr_is_rank_zeros_host_address():
    engines = [EngineInfo(4, "b", "10.0.0.9", 0), EngineInfo(7, "a", "10.0.0.5", 0)]
    placement, by_engine = plan_attached(engines, cores={})
    assert by_engine[4].rank == 0
    assert placement.master_addr == "10.0.0.9"
    # Distinct hostnames keep their plain names.
    assert placement.hosts == ["b", "a"]


def test_local_placement_rendezvous_stays_on_loopback():
    assert plan_local(2, gpus_visible=[], cores=2).master_addr == "127.0.0.1"


def _gpus_per_host(placement) -> dict:
    out: dict = {}
    for slot in placement.slots:
        out.setdefault(slot.host, []).append(slot.gpu)
    return out


def test_gpus_are_assigned_per_host_by_local_rank():
    engines = _engines((0, "A"), (1, "B"), (2, "A"), (3, "B"), (4, "A"), gpus=4)
    placement, _ = plan_attached(engines, cores={})
    assert _gpus_per_host(placement) == {"A": [0, 1, 2], "B": [0, 1]}
    assert [s.local_world_size for s in placement.slots] == [3, 3, 3, 2, 2]


def test_one_host_without_gpus_puts_every_host_on_cpu():
    # Mixed GPU and CPU hosts cannot share NCCL: everything falls back to gloo on CPU.
    engines = [EngineInfo(0, "gpu", "10.0.0.1", 2), EngineInfo(1, "cpu", "10.0.0.2", 0)]
    placement, _ = plan_attached(engines, cores={})
    assert placement.backend == "gloo"
    assert _gpus_per_host(placement) == {"gpu": [None], "cpu": [None]}


def test_threads_beyond_the_cores_are_noted_and_the_default_share_is_not():
    asked = plan_local(4, gpus_visible=[], cores=2, cpu=True, threads=8)
    assert asked.threads_note() == (
        "--threads 8: 4 ranks × 8 torch threads on the 2 cores take turns, so each step "
        "waits on the others; leave --threads out (cores / ranks: 1)"
    )
    # The default share, one thread per rank where ranks outnumber cores, and a count
    # that fits are what the user asked for: no note.
    assert plan_local(4, gpus_visible=[], cores=2, cpu=True).threads_note() == ""
    assert plan_local(256, gpus_visible=[], cores=2, cpu=True, threads=1).threads_note() == ""
    assert plan_local(2, gpus_visible=[], cores=16, cpu=True, threads=8).threads_note() == ""


def test_threads_note_names_the_host_whose_cores_are_short():
    engines = [EngineInfo(0, "big", "10.0.0.1", 0), EngineInfo(1, "small", "10.0.0.2", 0)]
    placement, _ = plan_attached(engines, cores={"big": 64, "small": 2}, threads=4)
    assert placement.threads_note() == (
        "--threads 4: 1 rank × 4 torch threads on the 2 cores of small take turns, so each "
        "step waits on the others; leave --threads out (cores / ranks: 2)"
    )
