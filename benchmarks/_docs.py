"""`--record`: a benchmark run that also writes its figures into docs/benchmarks.md.

    python benchmarks/NAME.py [args] --record

runs the benchmark as usual (in a child process, so figures printed by its own subprocesses are
seen too), echoes its output, and replaces the text between `<!-- bench:NAME:start -->` and
`<!-- bench:NAME:end -->` in docs/benchmarks.md with a table of every `name: value unit` line,
headed by the date, the machine and the command. Nothing outside the markers changes.
"""

from __future__ import annotations

import datetime
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
FIGURE = re.compile(r"^([A-Za-z0-9_.+\-]+): ([-+]?(?:[0-9][^ ]*|nan|inf))(?: (.+))?$")  # value: a number


def figures(text: str) -> list[tuple[str, str, str]]:
    """(name, value, unit) of every figure line a benchmark printed, in order."""
    out = []
    for line in text.splitlines():
        m = FIGURE.match(line.strip())
        if m:
            out.append((m.group(1), m.group(2), m.group(3) or ""))
    return out


def table(rows: list[tuple[str, str, str]], command: str, when: datetime.datetime) -> str:
    head = (f"Recorded {when:%Y-%m-%d %H:%M} UTC on {os.cpu_count()} cores, Python {platform.python_version()}: "
            f"`{command}`\n\n| figure | value | unit |\n|---|---|---|")
    return "\n".join([head, *(f"| `{n}` | {v} | {u} |" for n, v, u in rows)])


def replace_section(doc: str, name: str, body: str) -> str:
    """`doc` with the text between NAME's markers replaced by `body` (markers kept)."""
    start, end = f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"
    i, j = doc.find(start), doc.find(end)
    if i < 0 or j < i:
        raise ValueError(f"{DOCS.name} has no '{start}' ... '{end}' section")
    return doc[:i + len(start)] + "\n" + body + "\n" + doc[j:]


def record_if_asked(name: str) -> None:
    """With `--record` on the command line: run the benchmark without it, echo its output,
    write its table, and exit with its status. Otherwise return at once."""
    if "--record" not in sys.argv:
        return
    args = [a for a in sys.argv[1:] if a != "--record"]
    proc = subprocess.Popen([sys.executable, sys.argv[0], *args], stdout=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stdout:  # echoed as it comes: long benchmarks show their progress
        sys.stdout.write(line)
        seen.append(line)
    rc = proc.wait()
    if rc == 0:
        command = " ".join(["python", f"benchmarks/{Path(sys.argv[0]).name}", *args])
        body = table(figures("".join(seen)), command, datetime.datetime.now(datetime.timezone.utc))
        DOCS.write_text(replace_section(DOCS.read_text(encoding="utf-8"), name, body), encoding="utf-8")
        print(f"recorded {len(figures(''.join(seen)))} figures in {DOCS}", file=sys.stderr)
    sys.exit(rc)
