"""Unit tests for nbdist.errors."""

from __future__ import annotations

import pickle

import pytest

from nbdist.errors import (
    ClusterNotRunning,
    NbdistError,
    PlacementError,
    RankError,
    RankFailure,
    RanksInterrupted,
)

RED, RESET = "\x1b[0;31m", "\x1b[0m"


def zero_division(rank: int, engine_id: int) -> RankFailure:
    """A ZeroDivisionError as ipyparallel reports it, with this rank's noise."""
    traceback = (
        f"[{engine_id}:execute]\n"
        f"{RED}---------------------------------------------------------------------------{RESET}\n"
        f"{RED}ZeroDivisionError{RESET}  Traceback (most recent call last)  [Engine {engine_id}]\n"
        f"Cell {RED}In[7], line 2{RESET}\n"
        f"      1 print('[rank {rank}] dividing')\n"
        f"----> 2 1 / 0\n"
        f"{RED}ZeroDivisionError{RESET}: division by zero"
    )
    return RankFailure(rank, "ZeroDivisionError", "division by zero", traceback)


def value_error(rank: int, message: str = "bad shape") -> RankFailure:
    return RankFailure(rank, "ValueError", message, f"Traceback\n  check()\nValueError: {message}")


def test_identical_failures_are_grouped_despite_engine_ids_and_colours():
    failures = [zero_division(rank, engine_id=rank + 10) for rank in (3, 0, 2, 1)]
    error = RankError(failures, world_ranks=range(4))
    groups = error.groups()
    assert len(groups) == 1
    ranks, representative = groups[0]
    assert ranks == [0, 1, 2, 3]
    assert representative == zero_division(0, engine_id=10)


def test_noise_normalisation_covers_engine_rank_pid_and_address_forms():
    def failure(rank, pid, address):
        traceback = (
            f"engine {rank}: File /tmp/ipykernel_{pid}/3141.py\n"
            f"[rank {rank}] <Model object at {address}>\nRuntimeError: boom"
        )
        return RankFailure(rank, "RuntimeError", "boom", traceback)

    error = RankError([failure(0, 4100, "0x7f00aa11bb22"), failure(1, 4200, "0x7f00cc33dd44")])
    assert [ranks for ranks, _ in error.groups()] == [[0, 1]]


def test_gloos_peer_addresses_do_not_split_groups():
    """Each rank a release ends names another peer in gloo's error: one group all the same."""

    def released(rank, peer):
        traceback = (
            "Traceback\n  dist.all_reduce(t)\nRuntimeError: [third_party/gloo/gloo/transport/"
            f"tcp/pair.cc:553] Connection closed by peer {peer}. This is typically caused by a "
            "remote worker crashing."
        )
        return RankFailure(rank, "CollectiveMismatch", "waited in all_reduce #1", traceback)

    peers = ["[127.0.0.1]:10629", "[10.0.3.17]:21430", "[::1]:40007", "[fe80::1%eth0]:5"]
    error = RankError([released(rank, peer) for rank, peer in enumerate(peers)])
    assert [ranks for ranks, _ in error.groups()] == [[0, 1, 2, 3]]
    assert str(error) == "ranks 0-3: CollectiveMismatch: waited in all_reduce #1"


def test_colour_codes_do_not_split_groups():
    coloured = zero_division(0, engine_id=0)
    plain = RankFailure(
        1, coloured.ename, coloured.evalue, coloured.traceback.replace(RED, "").replace(RESET, "")
    )
    assert RankError([coloured, plain]).groups() == [([0, 1], coloured)]


def test_distinct_failures_stay_separate_and_are_ordered_by_lowest_rank():
    failures = [
        zero_division(1, 11),
        value_error(2),
        zero_division(3, 13),
        value_error(0, "other message"),
        RankFailure(
            4, "ValueError", "bad shape", "Traceback\n  different_call()\nValueError: bad shape"
        ),
    ]
    error = RankError(failures)
    assert [(ranks, f.ename, f.evalue) for ranks, f in error.groups()] == [
        ([0], "ValueError", "other message"),
        ([1, 3], "ZeroDivisionError", "division by zero"),
        ([2], "ValueError", "bad shape"),
        ([4], "ValueError", "bad shape"),
    ]


def test_str_is_one_line_per_group_plus_note():
    failures = [zero_division(r, r) for r in (0, 1, 3)] + [value_error(2)]
    error = RankError(failures, world_ranks=[0, 1, 2, 3], note="rank 4 was still running")
    assert str(error) == (
        "ranks 0-1,3: ZeroDivisionError: division by zero\n"
        "rank 2: ValueError: bad shape\n"
        "rank 4 was still running"
    )


def test_str_without_message_or_note():
    error = RankError([RankFailure(0, "KeyboardInterrupt", "", "")])
    assert str(error) == "rank 0: KeyboardInterrupt"


def test_render_traceback_shows_each_group_once_with_colours():
    failures = [zero_division(r, r + 20) for r in (0, 1)] + [value_error(3)]
    error = RankError(failures, world_ranks=range(4), note="see logs")
    assert error._render_traceback_() == [
        "[ranks 0-1] ZeroDivisionError: division by zero",
        *zero_division(0, 20).traceback.splitlines(),
        "",
        "[rank 3] ValueError: bad shape",
        "Traceback",
        "  check()",
        "ValueError: bad shape",
        "",
        "3 of 4 ranks failed",
        "see logs",
    ]
    assert RED in "\n".join(error._render_traceback_())


def test_summary_without_world_ranks():
    assert RankError([value_error(2)])._render_traceback_()[-1] == "1 rank failed"
    assert RankError([value_error(1), value_error(2)])._render_traceback_()[-1] == "2 ranks failed"
    assert (
        RankError([value_error(0)], world_ranks=[0])._render_traceback_()[-1]
        == "1 of 1 rank failed"
    )


WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo".split()


def test_more_than_eight_groups_are_summarised():
    failures = [value_error(rank, f"problem {WORDS[rank]}") for rank in range(11)]
    rendered = RankError(failures, world_ranks=range(12))._render_traceback_()
    full = []
    for rank in range(8):
        full += [
            f"[rank {rank}] ValueError: problem {WORDS[rank]}",
            "Traceback",
            "  check()",
            f"ValueError: problem {WORDS[rank]}",
            "",
        ]
    assert rendered == [
        *full,
        "3 more distinct failures (tracebacks omitted):",
        "[rank 8] ValueError: problem india",
        "[rank 9] ValueError: problem juliet",
        "[rank 10] ValueError: problem kilo",
        "11 of 12 ranks failed",
    ]


def test_256_ranks_whose_messages_differ_in_numbers_are_one_entry_with_ranges():
    """An error whose message names the rank or a per-rank value, on every rank: one headline
    with each number's range and one traceback, not 8 tracebacks and 248 lines."""
    failures = [
        value_error(rank, f"bad batch on rank {rank}: loss={rank * 1.5}") for rank in range(256)
    ]
    error = RankError(failures, world_ranks=range(256))
    assert len(error.groups()) == 256  # the exact groups are still there
    assert error._render_traceback_() == [
        "[ranks 0-255] ValueError: bad batch on rank 0–255: loss=0.0–382.5",
        "(one error, its numbers differing between the ranks; the traceback is rank 0's; "
        "%dist_last_error --full shows each rank's)",
        "Traceback",
        "  check()",
        "ValueError: bad batch on rank 0: loss=0.0",
        "",
        "256 of 256 ranks failed",
    ]
    assert str(error) == "ranks 0-255: ValueError: bad batch on rank 0–255: loss=0.0–382.5"


def test_a_few_messages_differing_in_numbers_each_keep_their_line_over_one_traceback():
    failures = [
        value_error(0, "expected 4 got 3"),
        value_error(1, "expected 4 got 5"),
        value_error(2, "expected 4 got 3"),
    ]
    rendered = RankError(failures)._render_traceback_()
    assert rendered[:3] == [
        "[ranks 0,2] ValueError: expected 4 got 3",
        "[rank 1] ValueError: expected 4 got 5",
        "(one error, its numbers differing between the ranks; the traceback is rank 0's; "
        "%dist_last_error --full shows each rank's)",
    ]
    assert rendered.count("Traceback") == 1
    assert str(RankError(failures)) == (
        "ranks 0,2: ValueError: expected 4 got 3\nrank 1: ValueError: expected 4 got 5"
    )


def test_the_same_message_from_other_code_stays_apart():
    """Alike messages raised at another place are another error: each keeps its traceback."""
    here = [value_error(rank, f"step {rank} failed") for rank in range(4)]
    elsewhere = [
        RankFailure(
            rank,
            "ValueError",
            f"step {rank} failed",
            f"Traceback\n  other()\nValueError: step {rank} failed",
        )
        for rank in range(4, 8)
    ]
    error = RankError(here + elsewhere)
    assert str(error) == (
        "ranks 0-3: ValueError: step 0–3 failed\nranks 4-7: ValueError: step 4–7 failed"
    )
    assert error._render_traceback_().count("Traceback") == 2


@pytest.mark.parametrize(
    "numbers, ranged",
    [
        (["9", "10", "2", "3"], "2–10"),  # by value, not as text
        (["10.0.0.9", "10.0.0.10", "10.0.0.2", "10.0.0.3"], "10.0.0.2–10.0.0.10"),  # by part
        (["0x1f", "0xa", "0x3", "0x2"], "0x2–0x1f"),
        (["1e-05", "0.5", "0.25", "0.125"], "1e-05–0.5"),
        (["7", "7", "7", "7"], "7"),
    ],
)
def test_numbers_are_ranged_by_their_value(numbers, ranged):
    # Four messages or more, each number another (or all one), so that one line gives the ranges.
    messages = [f"at {numbers[i]} now, attempt {i}" for i in range(4)]
    failures = [value_error(rank, message) for rank, message in enumerate(messages)]
    assert str(RankError(failures)) == f"ranks 0-3: ValueError: at {ranged} now, attempt 0–3"


def _checks_message(rank: int, shape: int, peer: int, peer_shape: int) -> str:
    """torch's collective check (TORCH_DISTRIBUTED_DEBUG=DETAIL) as 2.13 words it on gloo."""

    def fingerprint(shape: int) -> str:
        return (
            f"CollectiveFingerPrint(SequenceNumber=1, OpType=ALLREDUCE, TensorShape=[{shape}], "
            "TensorDtypes=Float, TensorDeviceTypes=TensorOptions(dtype=float (default), "
            "device=cpu, layout=Strided (default), requires_grad=false (default), "
            "pinned_memory=false (default), memory_format=(nullopt)))"
        )

    return (
        f"Detected mismatch between collectives on ranks. Rank {rank} is running collective: "
        f"{fingerprint(shape)}, but Rank {peer} is running collective: "
        f"{fingerprint(peer_shape)}.Collectives differ in the following aspects:   "
        f"Tensor Tensor shapes: {shape}vs {peer_shape}"
    )


def _short_fingerprint(shape: int) -> str:
    return (
        f"CollectiveFingerPrint(SequenceNumber=1, OpType=ALLREDUCE, TensorShape=[{shape}], "
        "TensorDtypes=Float, TensorDeviceTypes=TensorOptions(device=cpu))"
    )


def test_the_rank_whose_shape_differs_keeps_its_line_among_256():
    """torch's check on 256 ranks, rank 3's tensor another size: ranged whole, the line read
    "Rank 0–255 ... TensorShape=[1–4]", which no longer said which rank had which shape (and
    each message was 700 characters, three quarters of them torch's default options)."""
    failures = [
        RankFailure(
            rank,
            "RuntimeError",
            _checks_message(rank, 1, 0, 4) if rank == 3 else _checks_message(rank, 4, 3, 1),
            "Traceback\n  dist.all_reduce(t)\nRuntimeError: Detected mismatch",
        )
        for rank in range(256)
    ]
    assert str(RankError(failures)).splitlines() == [
        "ranks 0-2,4-255: RuntimeError: Detected mismatch between collectives on ranks. "
        f"Rank 0–255 is running collective: {_short_fingerprint(4)}, but Rank 3 is running "
        f"collective: {_short_fingerprint(1)}.Collectives differ in the following aspects:   "
        "Tensor Tensor shapes: 4vs 1",
        "rank 3: RuntimeError: Detected mismatch between collectives on ranks. Rank 3 is running "
        f"collective: {_short_fingerprint(1)}, but Rank 0 is running collective: "
        f"{_short_fingerprint(4)}.Collectives differ in the following aspects:   "
        "Tensor Tensor shapes: 1vs 4",
    ]


def test_torchs_default_options_are_left_out_of_the_headline_only():
    message = _checks_message(0, 4, 1, 1)
    error = RankError([RankFailure(0, "RuntimeError", message, f"Traceback\n{message}")])
    assert str(error) == (
        "rank 0: RuntimeError: Detected mismatch between collectives on ranks. Rank 0 is "
        f"running collective: {_short_fingerprint(4)}, but Rank 1 is running collective: "
        f"{_short_fingerprint(1)}.Collectives differ in the following aspects:   "
        "Tensor Tensor shapes: 4vs 1"
    )
    # The traceback under it, and the failure %dist_last_error --full prints, keep it whole.
    assert error._render_traceback_()[2] == message
    assert error.failures[0].evalue == message


def test_signs_and_words_are_not_numbers_to_range():
    """A message whose text around the numbers differs (a sign, a word) is another message."""
    messages = ["loss -1.5 at step 3", "loss 2.5 at step 3", "loss nan at step 3"]
    error = RankError([value_error(rank, message) for rank, message in enumerate(messages)])
    assert error._render_traceback_().count("Traceback") == 3
    assert "one error" not in "\n".join(error._render_traceback_())


def test_failures_are_sorted_and_ranks_property():
    error = RankError([value_error(5), zero_division(1, 1), value_error(3)])
    assert [f.rank for f in error.failures] == [1, 3, 5]
    assert isinstance(error.failures, tuple)
    assert error.ranks == [1, 3, 5]


def test_rank_error_needs_a_failure():
    with pytest.raises(ValueError):
        RankError([])


def test_rank_error_survives_pickling():
    error = RankError([value_error(1)], world_ranks=[0, 1], note="n")
    clone = pickle.loads(pickle.dumps(error))
    assert clone.failures == error.failures
    assert clone.world_ranks == (0, 1)
    assert str(clone) == str(error)


def test_exception_hierarchy_and_messages():
    assert issubclass(RankError, NbdistError)
    assert issubclass(ClusterNotRunning, NbdistError)
    assert issubclass(PlacementError, NbdistError)
    assert issubclass(PlacementError, ValueError)
    assert str(ClusterNotRunning()) == (
        "no nbdist cluster is running: start one with %dist_start (or DistSession().start())"
    )
    assert str(ClusterNotRunning("custom")) == "custom"
    assert str(PlacementError("2 ranks on 1 GPU")) == "2 ranks on 1 GPU"


def _name_error(rank: int, name: str) -> RankFailure:
    return RankFailure(rank, "NameError", f"name '{name}' is not defined", "")


@pytest.mark.parametrize(
    "failures, name",
    [
        ([_name_error(0, "loss"), _name_error(1, "loss")], "loss"),
        ([_name_error(1, "loss")], "loss"),
        # Two names, or a NameError beside another failure: a rank's error, not one slip.
        ([_name_error(0, "loss"), _name_error(1, "step")], None),
        ([_name_error(0, "loss"), value_error(1)], None),
        ([RankFailure(0, "NameError", "free variable 'x' referenced before assignment", "")], None),
    ],
)
def test_undefined_name_is_the_one_name_every_rank_lacked(failures, name):
    assert RankError(failures).undefined_name() == name


def test_an_interrupt_names_the_ranks_that_ran_the_cell_to_its_end_all_the_same():
    """Ranks whose reply says the cell ran whole are not "stopped": the interrupt came too
    late there (at many ranks on a loaded machine some begin after every SIGINT)."""
    stopped = RankError(
        [RankFailure(0, "KeyboardInterrupt", "", ""), RankFailure(1, "KeyboardInterrupt", "", "")]
    )
    assert str(RanksInterrupted(stopped)) == "interrupted; every rank stopped"
    partly = RanksInterrupted(stopped, finished=[2, 3, 5])
    assert str(partly) == "interrupted; ranks 2-3,5 ran the cell to its end all the same"
    assert partly._render_traceback_()[-1] == str(partly)
    late = RanksInterrupted(None, finished=[0, 1])
    assert str(late) == "interrupted, but every rank had run the cell to its end"
    assert late._render_traceback_() == [
        "KeyboardInterrupt: the cell was interrupted too late on every rank",
        str(late),
    ]
    assert partly._render_traceback_()[0] == (
        "KeyboardInterrupt: the cell was interrupted on every rank"
    )
    # Ranks that never replied are said first: they are the ones to act on.
    assert "did not stop" in str(RanksInterrupted(None, [4], finished=[0]))


def test_an_interrupt_names_the_ranks_whose_own_code_caught_it():
    """Ranks whose code caught the KeyboardInterrupt (a checkpoint saved on Ctrl-C) are named
    as such: not as ranks that ran the cell to its end, nor as ranks that did not stop."""
    stopped = RankError([RankFailure(0, "KeyboardInterrupt", "", "")])
    handled = RanksInterrupted(stopped, caught=[0, 1])
    assert str(handled) == (
        "interrupted; every rank stopped (ranks 0-1 first ran their own code that caught the "
        "KeyboardInterrupt)"
    )
    assert handled._render_traceback_()[-1] == str(handled)
    # A rank that caught it and ended the cell well: the interrupt did not come too late.
    returned = RanksInterrupted(None, caught=[1])
    assert returned._render_traceback_()[0] == (
        "KeyboardInterrupt: the cell was interrupted on every rank"
    )
    assert str(returned) == (
        "interrupted; every rank stopped (rank 1 first ran its own code that caught the "
        "KeyboardInterrupt)"
    )
    # Still running when the kernel stopped waiting: which ones handle it, which are stuck.
    both = RanksInterrupted(None, [2, 3], caught=[3])
    assert str(both) == (
        "rank 2 did not stop after the interrupt (blocked in a collective or in native code?); "
        "rank 3 caught the KeyboardInterrupt and still runs its handling code (the next cell "
        "runs there after it); interrupt again, or %dist_restart"
    )
    # A stopped process takes no signal: named with what lets it go on, not as blocked;
    # "interrupt again" is said only while a rank it could reach still runs.
    held = "the process here of rank 2 (pid 7) is stopped (...): `kill -CONT 7` lets it go on"
    suspended = RanksInterrupted(None, [2], suspended=[2], suspended_words=held)
    assert str(suspended) == (
        f"rank 2 cannot take the interrupt until continued: {held}; or %dist_restart"
    )
    beside = RanksInterrupted(None, [2, 3], suspended=[2], suspended_words=held)
    assert str(beside) == (
        f"rank 2 cannot take the interrupt until continued: {held}; rank 3 did not stop after "
        "the interrupt (blocked in a collective or in native code?); interrupt again, or "
        "%dist_restart"
    )
