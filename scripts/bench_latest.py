"""Keep the latest row of each configuration in docs/bench (docs/bench-format.md).

A benchmark run writes its rows with `--json NEW.json`; to record it, add them to the file of their
area and drop what they supersede:

    python scripts/bench_latest.py --add NEW.json --into docs/bench/decode-h200.json
    python scripts/perf_tables.py            # regenerate the tables of docs/performance.md and README.md

Without --add it only prunes. A row is superseded by a later row of the same configuration
(`bench_rows.config_key`) in any file of the folder; rows of schedule sweeps (`bench_rows.is_sweep`)
are dropped. Files are rewritten one row a line; a file left empty is removed. --check changes
nothing and exits with status 1 when something would change.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_rows  # noqa: E402

BENCH_DIR = os.path.join(bench_rows.REPO, "docs", "bench")


def load_folder(folder: str) -> dict[str, list[dict]]:
    """{file path: rows} of every *.json in the folder, in name order."""
    files = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".json"):
            path = os.path.join(folder, name)
            with open(path) as f:
                files[path] = json.load(f)
    return files


def plan(folder: str, add: str | None = None, into: str | None = None) -> dict[str, list[dict]]:
    """The folder's files as they should be: {path: rows} (an empty list: remove the file)."""
    files = load_folder(folder)
    if add is not None:
        with open(add) as f:
            new = json.load(f)
        if not isinstance(new, list) or not all(isinstance(row, dict) for row in new):
            raise SystemExit(f"error: {add} is not a JSON list of rows")
        into = os.path.join(folder, os.path.basename(into)) if into else None
        if into is None:
            raise SystemExit("error: --add needs --into FILE (the docs/bench file of the rows' area)")
        files[into] = files.get(into, []) + new
    return bench_rows.latest_rows(files)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", nargs="?", default=BENCH_DIR, help="the rows' folder (default: docs/bench)")
    parser.add_argument("--add", metavar="NEW.json", help="rows of a new run to add")
    parser.add_argument("--into", metavar="FILE", help="the file (in the folder) that takes --add's rows")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 when something would change")
    args = parser.parse_args(argv)
    changed = []
    for path, rows in plan(args.folder, args.add, args.into).items():
        text = bench_rows.dumps_rows([bench_rows.stored(row) for row in rows]) if rows else None
        old = open(path).read() if os.path.exists(path) else None
        if text == old:
            continue
        changed.append(path)
        if args.check:
            continue
        if text is None:
            os.remove(path)
            print(f"removed {path} (no rows left)")
        else:
            with open(path, "w") as f:
                f.write(text)
            print(f"wrote {len(rows)} rows to {path}")
    if args.check and changed:
        print("not current: " + ", ".join(changed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
