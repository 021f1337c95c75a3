"""Kernel side: an engine's own last words, read from the log file the engines share.

ipyparallel's engine logs a CRITICAL line before it ends itself ("received signal 15,
stopping" on a ``kill`` from outside nbdist, "Maximum number of heartbeats misses
reached ...", "Error completing registration ..."), prefixed with its engine id once it
has registered (``[IPEngine.3]``). Its process then merely "exited with code 1": that
line is what says why, so a dead rank's cause quotes it
(:class:`nbdist.driver.rank_deaths.RankMonitor`).

The engines a zygote forks write one log file (:mod:`nbdist.launch.local_engines`);
at 256 ranks it holds megabytes, and several ranks can die at once. So the file is read
on from where the last read ended, and only the last such line per engine is kept.

Example::

    words = EngineLastWords(launcher.output_file)
    words.of(3)   # 'received signal 15, stopping', or '' when engine 3 logged none
"""

from __future__ import annotations

import codecs
import os
import re
import threading

__all__ = ["EngineLastWords"]

# "2026-12-02 08:53:40.948 [IPEngine.1] CRITICAL | received signal 15, stopping"
_CRITICAL = re.compile(r"\[IPEngine\.(\d+)\] CRITICAL \| (.*)")
_MAX_CHARS = 300  # a line, not a traceback: a dead rank's cause is one line of a table


class EngineLastWords:
    """The last CRITICAL line each engine wrote to the log file at ``path``."""

    def __init__(self, path: str) -> None:
        """Nothing read yet; the file need not exist yet."""
        self._path = path
        self._offset = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._partial = ""  # a line whose end is not written yet
        self._words: dict[int, str] = {}
        # The rank monitor's thread reads it as ranks die; a status call could too.
        self._lock = threading.Lock()

    def of(self, engine_id: int) -> str:
        """Engine ``engine_id``'s last CRITICAL line, '' when it wrote none (or there is no log)."""
        with self._lock:
            self._read_on()
            return self._words.get(engine_id, "")

    def _read_on(self) -> None:
        try:
            with open(self._path, "rb") as f:
                if os.fstat(f.fileno()).st_size < self._offset:
                    # A new file at the same path (engines started again): from its start.
                    self._offset, self._partial = 0, ""
                    self._decoder.reset()
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return
        self._offset += len(data)
        lines = (self._partial + self._decoder.decode(data)).split("\n")
        self._partial = lines.pop()
        for line in lines:
            if "CRITICAL" not in line:  # most lines: no regular expression for them
                continue
            match = _CRITICAL.search(line)
            if match is not None:
                words = match.group(2).strip()
                if len(words) > _MAX_CHARS:
                    words = words[: _MAX_CHARS - 3] + "..."
                self._words[int(match.group(1))] = words
