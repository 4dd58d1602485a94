"""The shared bits of the benchmark scripts' `--json PATH` rows (docs/bench-format.md).

Each row is a flat dict; a run's rows end with the same `device`, `date` and `commit` (`run_meta`)
and are written as one JSON list, one row a line (`write_rows`). `config_key` says which
configuration a row measures and `latest_rows` keeps the latest row of each (what docs/bench
holds; scripts/bench_latest.py applies it). Importing this module imports neither torch nor TVM
(scripts/bench_kernels.py prints its tables without them); `device_name` imports torch only when
asked about a GPU.

A script loads it with its own folder on sys.path (as `python scripts/X.py` has it):

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_rows
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def git_commit(repo: str = REPO) -> str:
    """`git rev-parse --short HEAD` of the repository, with "-dirty" appended where tracked files
    differ from it (the code that ran is then not that commit's), "unknown" when git cannot say."""
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True,
                              timeout=10, check=False)
        if done.returncode != 0 or not done.stdout.strip():
            return "unknown"
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                                 capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return done.stdout.strip() + ("-dirty" if changed.returncode != 0 or changed.stdout.strip() else "")


def now_iso() -> str:
    """The current time in UTC, ISO 8601 to the second: 2026-01-01T12:00:00+00:00."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def cpu_name() -> str:
    return platform.processor() or "cpu"


def device_name(gpu: bool = True) -> str:
    """The GPU's name (torch.cuda.get_device_name(), else TVM's name for cuda(0)) for a GPU run;
    the processor (platform.processor(), else "cpu") for a CPU run or where neither names a GPU."""
    if gpu:
        try:
            import torch

            if torch.cuda.is_available():
                return torch.cuda.get_device_name()
        except Exception:  # noqa: BLE001 - no torch, or a torch without a working CUDA
            pass
        try:
            import tvm

            device = tvm.cuda(0)
            if device.exist and device.device_name:
                return str(device.device_name)
        except Exception:  # noqa: BLE001
            pass
    return cpu_name()


def run_meta(gpu: bool = True) -> dict:
    """{"device", "date", "commit"} of a run, to end each of its rows with."""
    return {"device": device_name(gpu), "date": now_iso(), "commit": git_commit()}


def dumps_rows(rows: list[dict]) -> str:
    """The rows as a JSON list, one compact row a line (a run's diff is its lines)."""
    if not rows:
        return "[]\n"
    return "[\n" + ",\n".join(json.dumps(row, separators=(",", ":")) for row in rows) + "\n]\n"


SIGNIFICANT_DIGITS = 5


# A decode row whose schedules came from tir_kernels/decode_table.json spells out the whole table;
# the table at the row's commit says the same, so docs/bench keeps the word alone.
TABLE_VARIANT = re.compile(r"\btable: .*$")


# Free-text notes some runs added (the command line, the tree a patched run measured): docs/bench
# leaves them out; docs/performance.md gives each table's command.
NOTE_FIELDS = ("code", "command")


def stored(row: dict, digits: int = SIGNIFICANT_DIGITS) -> dict:
    """The row as docs/bench stores it: floats to `digits` significant digits (run-to-run noise is
    far above the 5th digit), a decode-table variant as "table" (TABLE_VARIANT), no NOTE_FIELDS."""
    row = {k: float(f"{v:.{digits}g}") if isinstance(v, float) else v for k, v in row.items()
           if k not in NOTE_FIELDS}
    if isinstance(row.get("variant"), str):
        row["variant"] = TABLE_VARIANT.sub("table", row["variant"])
    return row


def write_json(rows: list[dict], path: str) -> None:
    """The rows as a JSON list, one row a line, into `path` (replaced)."""
    with open(path, "w") as f:
        f.write(dumps_rows(rows))


def output_path_problem(path: str | None) -> str | None:
    """Why `path` cannot be written (its folder does not exist), checked before a long run; None if it can."""
    folder = os.path.dirname(os.path.abspath(path)) if path else None
    if folder and not os.path.isdir(folder):
        return f"the folder of {path!r} does not exist"
    return None


def write_rows(rows: list[dict], path: str) -> None:
    """write_json, then say so on stdout: `wrote N rows to PATH`."""
    write_json(rows, path)
    print(f"wrote {len(rows)} rows to {path}")


def finish(rows: list[dict], path: str | None, failures: list[str], heading: str, sep: str = ", ") -> int:
    """A benchmark's ending: its rows written to path (when given), then its failed checks
    printed as heading + sep-joined failures -> the exit status (1 when any failed)."""
    if path:
        write_rows(rows, path)
    if failures:
        print(heading + sep.join(failures))
        return 1
    return 0


# --------------------------------------------------------------------------------------------
# Configurations and runs: which rows supersede which
# --------------------------------------------------------------------------------------------
# The fields that say what a row measures (docs/bench-format.md). Rates, times, checks, memory,
# run settings (reps, steps, warm-up) and provenance (device, date, commit) are not among them.
CONFIG_FIELDS = ("bench", "model", "kernel", "impl", "dtype", "head_dim", "v_head_dim", "latent_dim", "rope_dim",
                 "num_qo_heads", "num_kv_heads", "num_layers", "page_size", "part", "causal", "threads", "target",
                 "fused_layers", "dependent_launch", "tensor_core_matmul", "decode_append", "fused_batch_layers")
# The points a run measures within its configuration: a later run of the configuration replaces
# all of them, also the points it left out (a run with other shapes, or without CUDA-graph rows).
POINT_FIELDS = ("batch", "seq_len", "qo_len", "tree", "history", "prompt", "new_tokens")
# Benchmarks whose `variant` names the configuration (quantization, target/dtype, speculative mode);
# elsewhere it describes the schedule that ran (and "cuda-graph ..." a replay of the same calls).
VARIANT_NAMES_CONFIG = ("cpu", "e2e", "cache", "speculative")
GRAPH_PREFIX = "cuda-graph"  # the variant of a row timed as a CUDA-graph replay
# Rows of schedule sweeps (tune_decode.py, --*-variants: the impl names a schedule) and of our
# fallback kernels forced where the dispatch picks another (CUDA cores where tensor cores run):
# tuning data (the choice lands in tir_kernels/decode_table.json and the schedule choosers), not
# configurations docs/bench keeps.
SWEEP_IMPL = re.compile(r"^tvmattn(-tc-.*|\[.*\]|-table|-dup|-cuda-core|-simt)$")


def machine(row: dict) -> str:
    """The machine kind a row was measured on: the GPU's name (an H100 run does not replace an
    H200 run), or "cpu" (a CPU run's `device` names the load it saw, which is no configuration)."""
    device = str(row.get("device", ""))
    return device if device.startswith("NVIDIA") else "cpu"


def config_key(row: dict) -> tuple:
    """What `row` measures, up to its point (POINT_FIELDS): CONFIG_FIELDS, and the variant where it
    names the configuration."""
    key = tuple((field, row[field]) for field in CONFIG_FIELDS if field in row) + (("machine", machine(row)),)
    if row.get("bench") in VARIANT_NAMES_CONFIG:
        key += (("variant", str(row.get("variant", ""))),)
    return key


def run_id(row: dict) -> tuple:
    """The run a row comes from: a run's rows share `date`, `commit` and `device` (run_meta; a CPU
    run's device names the load it saw, which tells apart runs of one day)."""
    return (str(row.get("date", "")), str(row.get("commit", "")), str(row.get("device", "")))


def is_sweep(row: dict) -> bool:
    return bool(SWEEP_IMPL.match(str(row.get("impl", ""))))


def latest_rows(files: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """Each file's rows of the latest run of each configuration (in any of the files), without
    sweep rows. Latest = the run of the configuration's latest row: a later `date` (ISO 8601 strings
    compare in time order), on equal dates later in file order (files in the order given)."""
    newest: dict[tuple, tuple] = {}
    for findex, rows in enumerate(files.values()):
        for rindex, row in enumerate(rows):
            if is_sweep(row):
                continue
            stamp = (str(row.get("date", "")), findex, rindex)
            key = config_key(row)
            if key not in newest or newest[key][0] < stamp:
                newest[key] = (stamp, run_id(row))
    return {name: [row for row in rows if not is_sweep(row) and newest[config_key(row)][1] == run_id(row)]
            for name, rows in files.items()}
