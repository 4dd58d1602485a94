"""The shared bits of the benchmark scripts' `--json PATH` rows (shared/docs/bench-format.md).

Each row is a flat dict; a run's rows end with the same `device`, `date` and `commit` (`run_meta`)
and are written as one JSON list (`write_rows`). Importing this module imports neither torch nor
TVM (scripts/bench_kernels.py prints its tables without them); `device_name` imports torch only
when asked about a GPU.

A script loads it with its own folder on sys.path (as `python scripts/X.py` has it):

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_rows
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def git_commit(repo: str = REPO) -> str:
    """`git rev-parse --short HEAD` of the repository, "unknown" when git cannot say."""
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True,
                              timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else "unknown"


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


def write_json(rows: list[dict], path: str) -> None:
    """The rows as a JSON list, one field per line, into `path` (replaced)."""
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
        f.write("\n")


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
