"""Command line:
- `python -m tvmattn smollm2 [--prompt TEXT ...] [--target auto|llvm|cuda] [generation options]`:
  compile SmolLM2-135M-Instruct once (cached) and answer the prompts (the main job);
- `python -m tvmattn generate --lib OUT.so --prompt TEXT [--prompt TEXT ...] [--max-new-tokens N]
  [--temperature T] [--top-p P] [--seed S] [--no-chat]`: run a library from scripts/compile.py;
- `python -m tvmattn demo [--dtype ...] [--page-size ...] [--target ...]`: the kernel smoke run.

A thin argparse layer over `tvmattn.quickstart`, `tvmattn.generate.Generator` and
`tvmattn.demo.run_demo`.
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
    generate = commands.add_parser("generate", help="generate text with a library built by scripts/compile.py")
    generate.add_argument("--lib", required=True, help="OUT.so (with OUT.params.npz and OUT.runtime.json beside it)")
    generate.add_argument("--prompt", action="append", required=True,
                          help="prompt text; repeat for a batch (batch_prefill / batch_decode)")
    smollm2 = commands.add_parser("smollm2", help="compile SmolLM2-135M-Instruct (once, cached) and answer prompts")
    smollm2.add_argument("--prompt", action="append", default=None,
                         help="prompt text; repeat for a batch (default: 'What is the capital of France?')")
    smollm2.add_argument("--target", default="auto", choices=["auto", "llvm", "cuda"],
                         help="auto (default): CUDA where a GPU is present, else the CPU")
    for command in (generate, smollm2):
        command.add_argument("--max-new-tokens", type=int, default=64)
        command.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
        command.add_argument("--top-p", type=float, default=1.0)
        command.add_argument("--seed", type=int, default=0)
        command.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    return parser


def _smollm2(args) -> int:
    from .build import BuildError
    from .quickstart import DEFAULT_PROMPT, cached_library
    from .weights import WeightError

    try:
        args.lib = cached_library(args.target, log=lambda m: print(m, file=sys.stderr))
    except (BuildError, WeightError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    args.prompt = args.prompt or [DEFAULT_PROMPT]
    for prompt in args.prompt:
        print(f"> {prompt}", file=sys.stderr)
    return _generate(args)


def _generate(args) -> int:
    from .generate import GenerateError, Generator

    def out(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    try:
        generator = Generator(args.lib)
        result = generator.generate(args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                    top_p=args.top_p, seed=args.seed, chat=not args.no_chat, stream=out)
    except GenerateError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if len(args.prompt) == 1:
        out("\n")
    else:
        for index, (prompt, text) in enumerate(zip(args.prompt, result.texts)):
            out(f"[{index}] {prompt}\n{text}\n\n")
    print(f"prefill: {sum(result.prompt_tokens)} tokens in {result.prefill_s:.3f} s "
          f"({result.prefill_tokens_per_s:.1f} tokens/s); decode: {result.decode_steps} steps in "
          f"{result.decode_s:.3f} s ({result.decode_tokens_per_s:.1f} tokens/s)", file=sys.stderr)
    return 0


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
    if args.command == "generate":
        return _generate(args)
    if args.command == "smollm2":
        return _smollm2(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
