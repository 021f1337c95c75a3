"""Security properties that hold for the code itself (sockets and files: test_two_notebooks.py).

nbdist ends only the processes it started, by PID: nowhere does it find
processes by name or command line (pkill, killall, pgrep, psutil.process_iter)
to signal them, which could end another user's or another notebook's job. The
one scan of the process table allowed reads parent PIDs only (``process_iter(["ppid"])``):
walking down from PIDs nbdist started is picking by PID, as ``Process.children``
does.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbdist

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = Path(nbdist.__file__).resolve().parent

# Ways to pick processes by name/pattern instead of by a PID one started.
NAME_PATTERN_KILLING = re.compile(
    r"\b(pkill|killall|pgrep|pidof)\b"
    r"|process_iter\s*\((?!\s*\[\s*[\"']ppid[\"']\s*\]\s*\))"
    r"|\bfuser\b[^\n]*-k"
    r"|kill\s+[^\n]*\$\(\s*(ps|pgrep|pidof)\b"
)


def _sources(root: Path):
    for path in sorted(root.rglob("*")):
        if path.suffix in {".py", ".sh", ".ts", ".js"} and "node_modules" not in path.parts:
            yield path


def test_the_pattern_finds_name_based_killing():
    # The check below is only as good as this pattern: it must catch each form.
    for line in [
        "subprocess.run(['pkill', '-f', 'ipengine'])",
        "os.system('killall python')",
        "pids = subprocess.check_output(['pgrep', '-f', 'ipcontroller'])",
        "for p in psutil.process_iter(['name']):",
        "for p in psutil.process_iter():",
        "for p in psutil.process_iter(['ppid', 'cmdline']):",
        "fuser -k 29500/tcp",
        "kill -9 $(ps aux | grep ipengine | awk '{print $2}')",
        "pidof ipengine",
    ]:
        assert NAME_PATTERN_KILLING.search(line), line
    for line in [
        "os.kill(pid, signal.SIGTERM)",
        "proc.send_signal(signal.SIGKILL)",
        "skill = 3",
        'for proc in psutil.process_iter(["ppid"]):',  # parentage below PIDs nbdist started
    ]:
        assert not NAME_PATTERN_KILLING.search(line), line


def test_no_process_is_found_by_name_to_be_killed():
    roots = [PACKAGE, ROOT / "scripts", ROOT / "bench", ROOT / "labextension" / "src"]
    checked, found = 0, []
    for root in roots:
        if not root.is_dir():
            continue
        for path in _sources(root):
            checked += 1
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if NAME_PATTERN_KILLING.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert checked > 20, f"only {checked} files were checked: wrong root?"
    assert found == [], "processes found by name or pattern:\n" + "\n".join(found)


def test_security_notes_exist_and_are_linked():
    text = (ROOT / "SECURITY.md").read_text()
    for topic in ("127.0.0.1", "0600", "HMAC", "unpickle", "PID", "--ip"):
        assert topic in text, f"SECURITY.md does not cover {topic!r}"
    assert "SECURITY.md" in (ROOT / "README.md").read_text()
