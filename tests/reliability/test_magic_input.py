"""Property tests over the magics' argument strings, in a real IPython shell.

Every malformed line is an IPython ``UsageError`` (never a traceback from
inside nbdist) and changes nothing: no cluster starts or stops, no process is
started, no ipyparallel profile is created, the ranks run nothing.
Malformed inputs are built so that none of them is valid: bad values for each
option, unknown options (never an abbreviation of a real one), stray words.
"""

from __future__ import annotations

import os
import re
import string

import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

SETTINGS = settings(
    max_examples=60,
    deadline=None,
    database=None,  # nothing written into the repository
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# Any text a user could type on a magic's line (quotes, unicode digits, control characters...),
# but the word --help: a line with it asks for the magic's help, which is printed and nothing
# else happens (tests/magics/test_magic_arguments.py).
ANY_TEXT = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00\n\r"), max_size=30
).filter(lambda t: "--help" not in t.split())
WORD = st.text(
    st.characters(blacklist_categories=("Cs", "Z", "Cc"), blacklist_characters="\x00"),
    min_size=1,
    max_size=12,
).filter(lambda w: w != "--help")


def _not_whole_number(text: str, at_least: int = 1) -> bool:
    return not (text.isascii() and text.isdigit() and int(text) >= at_least)


def _quote(value: str) -> str:
    """``value`` as one shell-like word, as a user would quote it."""
    if value and not any(c.isspace() or c in "'\"" for c in value):
        return value
    return '"' + value.replace('"', "") + '"'


BAD_COUNT = WORD.filter(_not_whole_number).filter(lambda t: not t.startswith("-"))
BAD_SECONDS = st.one_of(
    st.sampled_from(["0", "-1", "-0.5", "nan", "inf", "-inf", "1e400", "NaN", "five", "1,5", ""]),
    WORD.filter(lambda t: not _is_positive_finite(t)),
)
# Never a list of GPU indices (that could be valid on a machine with GPUs).
BAD_GPUS = st.one_of(
    st.sampled_from(["a,b", "0,0", "-1", ",", "0-", "1.5", ""]),
    WORD.filter(lambda t: not re.fullmatch(r"[0-9,]+", t)),
)
BAD_BACKEND = WORD.filter(lambda t: t.strip().lower() not in ("gloo",))
BAD_IP = st.one_of(
    st.sampled_from(["", "999.1.1.1", "1.2.3", "127.0.0.1/8", "::g", "local host", "10.0.0.300"]),
    WORD.filter(lambda t: any(c in t for c in "/!@#$%^&*()=+[]{};'\",<>?\\|`~ ")),
)
# Out of range for 2 ranks, or not rank numbers at all ("00" or "0, 1" could be valid).
BAD_RANKS = st.one_of(
    st.sampled_from(["", "5", "0-9", "a", "1-0", "0,,1", "-1", "2", "0-2"]),
    WORD.filter(lambda t: not re.fullmatch(r"[0-9,\s-]*", t)),
)
NOT_A_RANK = WORD.filter(lambda t: not (t.isascii() and t.isdigit()) or int(t) >= 2)


def _is_positive_finite(text: str) -> bool:
    try:
        value = float(text)
    except ValueError:
        return False
    return 0 < value < float("inf")


def _unknown_option(known: list[str]):
    """``--name`` that is not an option of the magic nor an abbreviation argparse would accept."""
    names = st.text(string.ascii_lowercase + "-_", min_size=1, max_size=10)
    return names.map(lambda n: "--" + n.strip("-") + "x").filter(
        lambda opt: not any(k.startswith(opt) for k in known)
    )


def _magics(shell):
    return shell.magics_manager.registry["DistMagics"]


def _profiles() -> set[str]:
    root = os.environ["IPYTHONDIR"]
    return (
        {n for n in os.listdir(root) if n.startswith("profile_")} if os.path.isdir(root) else set()
    )


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


class _Unchanged:
    """What a refused line must leave as it was."""

    def __init__(self, shell):
        self.shell = shell
        magics = _magics(shell)
        self.session = magics.session
        self.world = magics.session.world_size if magics.session and magics.session.running else 0
        self.children = _children()
        self.profiles = _profiles()
        self.names = set(shell.user_ns)

    def check(self):
        magics = _magics(self.shell)
        assert magics.session is self.session
        running = self.session is not None and self.session.running
        assert (self.session.world_size if running else 0) == self.world
        assert _children() <= self.children, "a refused line started a process"
        assert _profiles() == self.profiles, "a refused line created an ipyparallel profile"
        assert set(self.shell.user_ns) - self.names <= {"_", "__", "___"}


def refused(shell, magic: str, line: str, cell: str | None = None) -> str:
    """Run the magic; insist on a UsageError and on nothing having changed."""
    before = _Unchanged(shell)
    with pytest.raises(UsageError) as info:
        if cell is None:
            shell.run_line_magic(magic, line)
        else:
            shell.run_cell_magic(magic, line, cell)
    before.check()
    message = str(info.value)
    assert message.strip(), f"%{magic} {line!r}: an empty error message"
    return message


@pytest.fixture(scope="module")
def shell():
    sh = InteractiveShell.instance()
    sh.run_line_magic("load_ext", "nbdist")
    if _magics(sh).session is not None and _magics(sh).session.running:
        sh.run_line_magic("dist_stop", "")
    yield sh
    sh.run_line_magic("dist_stop", "")


START_OPTIONS = [
    "--backend",
    "--cpu",
    "--gpus",
    "--threads",
    "--timeout",
    "--launcher",
    "--profile",
    "--connect",
    "--attach",
    "--ip",
    "--spawn",
    "--help",
]


@st.composite
def bad_start_lines(draw):
    """A %dist_start line with at least one malformed part (and maybe valid ones around it)."""
    bad = draw(
        st.one_of(
            BAD_COUNT.map(_quote),
            BAD_SECONDS.map(lambda v: f"--timeout {_quote(v)}"),
            BAD_COUNT.map(lambda v: f"--threads {_quote(v)}"),
            BAD_GPUS.map(lambda v: f"--gpus {_quote(v)}"),
            BAD_BACKEND.map(lambda v: f"--backend {_quote(v)}"),
            BAD_IP.map(lambda v: f"--ip {_quote(v)}"),
            WORD.map(lambda v: f"--connect {_quote('/nonexistent/' + v)}"),
            WORD.filter(lambda v: "." not in v).map(lambda v: f"--launcher {_quote(v + 'zz')}"),
            WORD.map(lambda v: f"--profile {_quote('nbdist-missing-' + v)}"),
            _unknown_option(START_OPTIONS),
            # Malformed whatever comes around them (no option left waiting for a value).
            st.sampled_from(["2 3", "'", '"2', "--cpu=1", "2 -"]),
        )
    )
    # Valid parts around it; none sets a value the bad part sets (argparse keeps the last).
    valid = draw(st.lists(st.sampled_from(["2", "--cpu", "--spawn"]), max_size=2))
    parts = [*valid, bad]
    draw(st.randoms()).shuffle(parts)
    return " ".join(parts)


def test_bad_dist_start_lines_are_usage_errors(shell):
    @SETTINGS
    @given(bad_start_lines())
    def check(line):
        refused(shell, "dist_start", line)

    check()


def test_any_line_before_dist_start_is_a_usage_error(shell):
    """Without a cluster every magic that needs one refuses any line, and the rest refuse junk."""
    session = _magics(shell).session  # None, or one stopped by an earlier test module
    assert session is None or not session.running

    @SETTINGS
    @given(
        st.sampled_from(["dist_restart", "dist_status", "dist_pull", "dist_push", "dist_where"]),
        ANY_TEXT,
    )
    def line_magics(magic, line):
        refused(shell, magic, line)

    @SETTINGS
    @given(st.sampled_from(["on_all_ranks", "on_rank"]), ANY_TEXT)
    def cell_magics(magic, line):
        refused(shell, magic, line, "x = 1")

    @SETTINGS
    @given(ANY_TEXT.filter(lambda t: t.strip() != ""))
    def stop_with_arguments(line):
        refused(shell, "dist_stop", line)

    @SETTINGS
    @given(ANY_TEXT.filter(lambda t: _not_whole_number(t.strip(), at_least=0)))
    def dashboard_junk(line):
        if line.strip():
            refused(shell, "dist_dashboard", line)

    for prop in (line_magics, cell_magics, stop_with_arguments, dashboard_junk):
        prop()


def test_dashboard_of_a_run_that_does_not_exist(shell):
    for line in ("99999", "99999999999999999999999999", "0"):
        assert "not in the history" in refused(shell, "dist_dashboard", line)


@pytest.fixture(scope="module")
def started(shell):
    shell.run_line_magic("dist_start", "2 --cpu")
    shell.run_cell_magic("on_all_ranks", "", "hits = 0")  # also a cell %dist_export would write
    yield shell
    shell.run_line_magic("dist_stop", "")


CELL_OPTIONS = ["--ranks", "--noblock", "--timeout", "--no-export", "--help"]


@st.composite
def bad_cell_lines(draw):
    return draw(
        st.one_of(
            BAD_RANKS.map(lambda v: f"--ranks {_quote(v)}"),
            BAD_SECONDS.map(lambda v: f"--timeout {_quote(v)}"),
            _unknown_option(CELL_OPTIONS),
            WORD.filter(lambda w: not w.startswith("-")),  # a stray positional word
        )
    )


def test_bad_lines_with_a_cluster_running_change_nothing(started):
    shell = started
    cell = "hits += 1"  # runs only if a malformed line were accepted

    @SETTINGS
    @given(bad_cell_lines())
    def on_all_ranks(line):
        refused(shell, "on_all_ranks", line, cell)

    @SETTINGS
    @given(NOT_A_RANK)
    def on_rank(line):
        refused(shell, "on_rank", _quote(line), cell)

    @SETTINGS
    @given(
        st.one_of(
            WORD.filter(lambda w: not w.isidentifier() and not w.startswith("-")).map(_quote),
            NOT_A_RANK.map(lambda r: f"hits --rank {_quote(r)}"),
            _unknown_option(["--rank", "--help"]).map(lambda o: f"hits {o}"),
        )
    )
    def dist_pull(line):
        refused(shell, "dist_pull", line)

    @SETTINGS
    @given(st.sampled_from(["dist_restart", "dist_status", "dist_stop"]), WORD)
    def no_argument_magics(magic, word):
        refused(shell, magic, _quote(word))

    @SETTINGS
    @given(st.one_of(ANY_TEXT, bad_start_lines()))
    def start_while_running(line):
        refused(shell, "dist_start", line)

    @SETTINGS
    @given(
        st.one_of(
            WORD.map(lambda w: _quote(f"/nonexistent-nbdist-dir/{w}.py")),
            WORD.filter(lambda w: not w.endswith(".py") and not w.startswith("-")).map(_quote),
            _unknown_option(["--backend", "--help"]).map(lambda o: f"train.py {o}"),
            st.just(""),
        )
    )
    def dist_export(line):
        refused(shell, "dist_export", line)

    for prop in (
        on_all_ranks,
        on_rank,
        dist_pull,
        no_argument_magics,
        start_while_running,
        dist_export,
    ):
        prop()
    # No refused line reached the ranks, and the same ranks still answer.
    assert shell.run_line_magic("dist_pull", "hits") == [0, 0]
