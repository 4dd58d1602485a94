"""Command line: `python -m tvmattn demo [--dtype ...] [--page-size ...] [--target ...]`.

A thin argparse layer over `tvmattn.demo.run_demo`.
"""

from __future__ import annotations

import argparse
import sys

from . import __version__


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tvmattn", description="TVM-native paged attention.")
    parser.add_argument("--version", action="version", version=f"tvmattn {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo", help="build paged prefill and decode, run them on a small batch and check them against numpy"
    )
    demo.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    demo.add_argument("--page-size", type=int, default=16)
    demo.add_argument("--target", default="llvm", help='"llvm" (CPU, default), "cuda" or "cuda:sm_XX"')
    demo.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "demo":
        from .demo import format_report, run_demo

        try:
            report = run_demo(dtype=args.dtype, page_size=args.page_size, target=args.target, seed=args.seed)
        except ValueError as err:  # invalid configuration: a clear message, not a traceback
            print(f"error: {err}", file=sys.stderr)
            return 2
        print(format_report(report))
        return 0 if report["passed"] else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
