"""nbdist.driver.store_connects: ranks held up connecting to rank 0's store, and why, in one note.

The note's rules on given connect times; whether a name lookup is answered, on this machine's
own resolver. A whole session behind a resolver that never answers:
tests/dist/test_slow_store_connects.py.
"""

from __future__ import annotations

import doctest

import nbdist.driver.store_connects
from nbdist.driver.store_connects import asks_the_resolver, slow_connects_note


def _not_found(address: str) -> bool:
    return True


def _found(address: str) -> bool:
    return False


def test_the_modules_examples_hold():
    failed, tried = doctest.testmod(nbdist.driver.store_connects)
    assert tried >= 1 and failed == 0


def test_the_ranks_held_up_are_named_with_the_address_and_the_line_that_ends_it():
    seconds = {0: 5.1, 1: 0.02, 2: 5.01, 3: 0.11, 4: 5.04}
    note = slow_connects_note(seconds, "127.0.0.1", asks=_not_found)
    assert note.startswith("ranks 2,4 waited up to 5.0 s to connect to rank 0's store")
    # Rank 0 serves the store and waits for every rank: its time is not the others' bound.
    assert "(the others 0.11 s at most)" in note
    assert "::ffff:127.0.0.1" in note
    assert note.endswith("Add '::ffff:127.0.0.1 localhost' to /etc/hosts to skip it")


def test_every_rank_held_up_reads_without_the_others():
    note = slow_connects_note({0: 3.1, 1: 3.0, 2: 3.02}, "127.0.0.1", asks=_not_found)
    assert note.startswith("ranks 1-2 waited up to 3.0 s to connect to rank 0's store: ")


def test_no_note_where_connects_were_quick_or_only_rank_0_waited():
    assert slow_connects_note({0: 0.1, 1: 0.05, 2: 2.4}, "127.0.0.1", asks=_not_found) == ""
    assert slow_connects_note({0: 9.0, 1: 0.05}, "127.0.0.1", asks=_not_found) == ""


def test_no_note_where_the_name_is_found_on_this_machine():
    # Then the lookup is not what held them; the note would send the user the wrong way.
    assert slow_connects_note({0: 5.0, 1: 5.0}, "127.0.0.1", asks=_found) == ""


def test_no_note_for_a_rendezvous_beyond_loopback():
    # Ranks on other hosts look the name up in their own /etc/hosts, not the kernel's.
    assert slow_connects_note({0: 5.0, 1: 5.0}, "10.1.0.5", asks=_not_found) == ""
    assert slow_connects_note({0: 5.0, 1: 5.0}, "node1", asks=_not_found) == ""


def test_an_address_listed_in_etc_hosts_is_found_here():
    # 127.0.0.1 is in every /etc/hosts this suite meets ('localhost'); the lookup asks no resolver.
    assert asks_the_resolver("127.0.0.1") is False


def test_many_ranks_held_up_are_counted_not_listed():
    seconds = {0: 11.0, **{r: (10.6 if r % 3 else 0.4) for r in range(1, 256)}}
    note = slow_connects_note(seconds, "127.0.0.1", asks=_not_found)
    assert note.startswith("170 of 255 ranks waited up to 10.6 s to connect to rank 0's store "), (
        note
    )
    assert "(the others 0.40 s at most)" in note
