"""The README's table of the default tier's slowest tests, from a pytest run's own output.

Run the default tier as CI does, with pytest's duration report, and hand its output to this script:

    python -m pytest -q -n 2 --dist loadfile --durations=20 2>&1 | tee /tmp/durations.log
    python scripts/durations_table.py /tmp/durations.log

The table (seconds, phase, test) and the run's summary line go between the markers
`<!-- durations -->` and `<!-- /durations -->` of README.md, which are added at the end of its
"## Tests" section the first time; the rest of the file is left alone. A `setup` row is a
fixture's first build (a library compiled once per session and shared by the modules and workers
that use it), paid by the first test that asks for it. No TVM, no torch.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
BEGIN, END = "<!-- durations -->", "<!-- /durations -->"
COMMAND = "python -m pytest -q -n 2 --dist loadfile --durations=20"
ROW = re.compile(r"^\s*([0-9.]+)s (setup|call|teardown)\s+(\S.*?)\s*$")
SUMMARY = re.compile(r"^=*\s*(\d+ (passed|failed).* in [0-9.]+s.*?)\s*=*\s*$")


def parse(text: str) -> tuple[list[tuple[float, str, str]], str]:
    """(rows (seconds, phase, test id), the summary line) of pytest's output; ValueError when it
    has no duration report or no summary line."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if re.search(r"slowest (\d+ )?durations", line)), None)
    if start is None:
        raise ValueError("no 'slowest durations' report in the log: run pytest with --durations=20")
    rows = []
    for line in lines[start + 1:]:
        match = ROW.match(line)
        if not match:
            if rows:
                break
            continue
        rows.append((float(match.group(1)), match.group(2), match.group(3)))
    summaries = [m.group(1) for m in map(SUMMARY.match, lines) if m]
    if not rows or not summaries:
        raise ValueError("the log has no duration rows or no summary line (an interrupted run?)")
    return rows, summaries[-1]


def render(rows: list[tuple[float, str, str]], summary: str, top: int = 20) -> str:
    """The Markdown between the markers: the `top` slowest rows."""
    table = ["| seconds | phase | test |", "|---|---|---|"]
    table += [f"| {seconds:.1f} | {phase} | `{test}` |" for seconds, phase, test in sorted(rows, reverse=True)[:top]]
    return (f"The slowest tests of the default tier, `{COMMAND}`\n(the run: `{summary}`).\n"
            "A `setup` row is a shared fixture's first build, such as a model library compiled once per\n"
            "session, paid by the first test that asks for it.\n\n" + "\n".join(table))


def replace(readme: str, body: str) -> str:
    """readme with the block between the markers replaced by body (added at the end of the
    "## Tests" section where there is none yet)."""
    block = f"{BEGIN}\n{body}\n{END}"
    if BEGIN in readme:
        return re.sub(re.escape(BEGIN) + r".*?" + re.escape(END), lambda _m: block, readme, count=1, flags=re.S)
    match = re.search(r"^## Tests\n.*?(?=^## )", readme, flags=re.S | re.M)
    if match is None:
        raise ValueError("README.md has no '## Tests' section followed by another section")
    return readme[:match.end()].rstrip("\n") + "\n\n" + block + "\n\n" + readme[match.end():]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("log", help="pytest's output of the default tier with --durations=20")
    p.add_argument("--readme", default=README, help="the file to update (default: the repository's README.md)")
    args = p.parse_args(argv)
    with open(args.log, encoding="utf-8", errors="replace") as f:
        try:
            rows, summary = parse(f.read())
        except ValueError as err:
            print(f"error: {args.log}: {err}", file=sys.stderr)
            return 2
    with open(args.readme, encoding="utf-8") as f:
        text = f.read()
    with open(args.readme, "w", encoding="utf-8") as f:
        f.write(replace(text, render(rows, summary)))
    print(f"wrote the {min(len(rows), 20)} slowest of {len(rows)} rows to {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
