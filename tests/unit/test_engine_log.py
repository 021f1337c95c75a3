"""The engines' last words read from their shared log file (nbdist.launch.engine_log)."""

from __future__ import annotations

from nbdist.launch.engine_log import EngineLastWords

_HEAD = "2026-12-02 08:53:40.948 "


def _append(path, text: str) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)


def test_each_engine_gets_its_last_critical_line_and_nothing_else(tmp_path):
    log = tmp_path / "engines.log"
    words = EngineLastWords(str(log))
    assert words.of(1) == ""  # no file yet
    _append(
        log,
        f"{_HEAD}[IPEngine] CRITICAL | before registration: no engine id\n"
        f"{_HEAD}[IPEngine.1] WARNING | No heartbeat in the last 550 ms (1 time(s) in a row).\n"
        f"{_HEAD}[IPEngine.12] CRITICAL | received signal 15, stopping\n"
        f"{_HEAD}[IPEngine.2] ERROR | Got bad msg\n",
    )
    assert [words.of(i) for i in (1, 2, 12)] == ["", "", "received signal 15, stopping"]
    # Read on from where the last read ended; a line whose end is not written yet waits.
    _append(log, f"{_HEAD}[IPEngine.1] CRITICAL | Maximum number of heartbeats")
    assert words.of(1) == ""
    _append(log, " misses reached (50 times 550 ms), shutting down.\n")
    assert (
        words.of(1)
        == "Maximum number of heartbeats misses reached (50 times 550 ms), shutting down."
    )
    _append(log, f"{_HEAD}[IPEngine.12] CRITICAL | Failed to stop kernel\n")
    assert words.of(12) == "Failed to stop kernel"


def test_a_new_shorter_file_at_the_path_is_read_from_its_start(tmp_path):
    log = tmp_path / "engines.log"
    _append(log, f"{_HEAD}[IPEngine.0] INFO | Completed registration with id 0\n" * 20)
    words = EngineLastWords(str(log))
    assert words.of(0) == ""
    log.write_text(f"{_HEAD}[IPEngine.0] CRITICAL | received signal 15, stopping\n")
    assert words.of(0) == "received signal 15, stopping"


def test_a_character_split_between_two_reads_and_a_long_line(tmp_path):
    log = tmp_path / "engines.log"
    words = EngineLastWords(str(log))
    line = f"{_HEAD}[IPEngine.3] CRITICAL | Fehler: Größe\n".encode()
    cut = line.index("ö".encode()) + 1  # inside the two bytes of "ö"
    with open(log, "ab") as f:
        f.write(line[:cut])
    assert words.of(3) == ""
    with open(log, "ab") as f:
        f.write(line[cut:])
    assert words.of(3) == "Fehler: Größe"
    _append(log, f"{_HEAD}[IPEngine.3] CRITICAL | {'x' * 1000}\n")
    assert len(words.of(3)) == 300 and words.of(3).endswith("...")
