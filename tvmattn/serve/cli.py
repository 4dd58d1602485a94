"""`python -m tvmattn serve` (the OpenAI-compatible server) and `python -m tvmattn chat` (an
interactive multi-turn session), both on the continuous-batching engine.

`add_commands(subparsers)` registers them with the top-level parser of tvmattn/__main__.py;
the returned dict maps each command to its handler (args -> exit status). Errors end as one
line `error: ...` with exit status 2.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

DEFAULT_PORT = 8000
DRAIN_GRACE_S = 30.0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port from 0 to 65535, got {text!r}")
    return value


def _memory(text: str) -> str:
    from .runner import _parse_memory

    try:
        value = _parse_memory(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected bytes ('2GiB', '512MB', 1e9) or a fraction in (0, 1], "
                                         f"got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive amount, got {text!r}")
    return text


def _gemma3_path():
    from ..weights import gemma3_path

    return gemma3_path()  # raises WeightError with the install command where it is absent


# --model -> (the served model's name, its weights: None for the main job's default, SmolLM2)
PACKAGED_MODELS = {"smollm2": ("smollm2-135m", None), "smollm2-135m": ("smollm2-135m", None),
                   "gemma3": ("gemma3-270m", _gemma3_path), "gemma3-270m": ("gemma3-270m", _gemma3_path)}


def _engine_options(command: argparse.ArgumentParser) -> None:
    source = command.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", choices=tuple(PACKAGED_MODELS),
                        help="a packaged model, compiled once and cached as its main job does: SmolLM2-135M-Instruct "
                             "(`python -m tvmattn smollm2`) or Gemma 3 270M (`python -m tvmattn gemma3`)")
    source.add_argument("--lib", metavar="OUT.so", help="a library bundle made by `python -m tvmattn compile`")
    command.add_argument("--target", default="auto", help="with --model: auto, llvm, cuda or cuda:sm_XY")
    command.add_argument("--max-batched-tokens", type=_positive_int, default=None,
                         help="tokens per engine step: decode tokens and prompt chunks (default: the library's "
                              "prefill chunk, at most 512)")
    pool = command.add_mutually_exclusive_group()
    pool.add_argument("--kv-cache-memory", type=_memory, default=None,
                      help="KV-cache pages: bytes ('2GiB') or a fraction of the free device memory (0.5)")
    pool.add_argument("--max-total-tokens", type=_positive_int, default=None,
                      help="KV-cache pages for this many tokens (default: max batch size x context window)")
    command.add_argument("--max-num-seqs", type=_positive_int, default=None,
                         help="most requests running at once, each with its cache sequence (default: the library's "
                              "max batch size, `compile --max-batch-size`)")
    command.add_argument("--prefix-cache", choices=("radix", "off"), default="radix",
                         help="reuse cached prompt prefixes (a radix tree of page-aligned blocks)")
    command.add_argument("--sampling", choices=("auto", "device", "host"), default="auto",
                         help="who picks the tokens: the library's sampling kernels (device: only token ids come "
                              "back; grammar and logprobs rows still go to the host), the host (logits rows copied "
                              "back), or auto: device where the library has the kernels. Same tokens either way")
    command.add_argument("--lookahead", choices=tuple(LOOKAHEAD_MODES), default="auto",
                         help="launch each steady decode step before reading the previous step's tokens, fed its "
                              "sampled ids on the device (on: needs device sampling; auto: on where the device runs "
                              "asynchronously, off on the CPU). Same tokens either way")


def add_commands(commands) -> dict:
    serve = commands.add_parser("serve", help="an OpenAI-compatible HTTP server on the continuous-batching engine",
                                description="Serve /v1/chat/completions, /v1/completions, /v1/models, /health "
                                            "and /metrics on the continuous-batching engine.")
    _engine_options(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (another address exposes the server)")
    serve.add_argument("--port", type=_port, default=DEFAULT_PORT, help="port to bind")
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on /v1/* and /metrics")
    serve.add_argument("--max-queue", type=_positive_int, default=256,
                       help="waiting requests beyond which new ones get 429")
    serve.add_argument("--served-model-name", default=None, help="the model id clients name (default: the "
                                                                  "library's file stem)")
    serve.add_argument("--drain-grace", type=float, default=DRAIN_GRACE_S,
                       help="seconds SIGTERM gives running requests to finish before cancelling them")

    chat = commands.add_parser("chat", help="an interactive multi-turn chat on the engine (/reset, /exit)",
                               description="Chat with a model; /reset forgets the conversation, /exit ends.")
    _engine_options(chat)
    chat.add_argument("--max-tokens", type=_positive_int, default=512, help="most tokens per answer")
    chat.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    chat.add_argument("--system", default=None, help="a system message opening the conversation")
    return {"serve": serve_command, "chat": chat_command}


# --lookahead -> Engine(lookahead=)
LOOKAHEAD_MODES = {"auto": None, "on": True, "off": False}


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def build_engine(args, max_queue: int = 256):
    """(engine, model name) from the command's options; raises ValueError subclasses."""
    from ..build import BuildError
    from ..quickstart import cached_library
    from .engine import Engine
    from .runner import ModelRunner

    if args.model:
        name, weights = PACKAGED_MODELS[args.model]
        library = cached_library(args.target, log=lambda m: print(m, file=sys.stderr),
                                 weights=None if weights is None else weights())
    else:
        library = Path(args.lib)
        if not library.is_file():
            raise BuildError(f"--lib {args.lib!r}: no such file")
        name = library.stem
    runner = ModelRunner(library, max_total_tokens=args.max_total_tokens, kv_cache_memory=args.kv_cache_memory)
    chunk = runner.prefill_chunk
    if args.max_batched_tokens is not None and args.max_batched_tokens > chunk:
        raise BuildError(f"--max-batched-tokens {args.max_batched_tokens} exceeds the library's prefill chunk "
                         f"{chunk}")
    if args.max_num_seqs is not None and args.max_num_seqs > runner.max_batch_size:
        raise BuildError(f"--max-num-seqs {args.max_num_seqs} exceeds the library's max batch size "
                         f"{runner.max_batch_size} (compile it with a larger --max-batch-size)")
    engine = Engine(runner, max_batched_tokens=args.max_batched_tokens, max_running=args.max_num_seqs,
                    max_queue=max_queue, prefix_cache=args.prefix_cache, sampling=args.sampling,
                    lookahead=LOOKAHEAD_MODES[args.lookahead])
    return engine, name


def serve_command(args) -> int:
    import uvicorn

    from ..session import GenerateError
    from .server import create_app

    try:
        engine, name = build_engine(args, args.max_queue)
    except (GenerateError, ValueError) as err:
        return _fail(str(err))
    if args.drain_grace < 0:
        return _fail(f"--drain-grace must be >= 0, got {args.drain_grace}")
    engine.start()
    app = create_app(engine, args.served_model_name or name, args.api_key, drain_grace_s=args.drain_grace)

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame):  # SIGTERM / SIGINT: refuse new requests at once
            engine.stop_accepting()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=max(args.drain_grace, 0.1), lifespan="off")
    server = DrainingServer(config)
    # uvicorn raises the captured signal again once it has shut down; this handler takes it, so
    # that a drained server exits with status 0
    signal.signal(signal.SIGTERM, lambda *_: None)
    print(f"serving {args.served_model_name or name} on http://{args.host}:{args.port} "
          f"({engine.runner.num_pages} KV pages of {engine.page_size} tokens, sampling on the {engine.sampling})",
          file=sys.stderr, flush=True)
    try:
        server.run()
    finally:
        engine.drain(grace_s=0.0)
    return 0


def chat_command(args) -> int:
    from ..session import GenerateError
    from ..sampling import SamplingError, SamplingOptions
    from .engine import RequestError
    from .prompts import render_messages

    try:
        engine, _ = build_engine(args)
        options = SamplingOptions(temperature=args.temperature, max_tokens=args.max_tokens)
    except (GenerateError, SamplingError, ValueError) as err:
        return _fail(str(err))
    tokenizer = engine.runner.tokenizer
    if tokenizer is None:
        return _fail("the library bundle has no tokenizer (compile from a .gguf file)")
    template = engine.runner.session.runtime.get("chat_template")
    engine.start()
    opening = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(opening)
    print("chat: /reset forgets the conversation, /exit (or end of input) ends it", file=sys.stderr)
    try:
        while True:
            try:
                line = input("> ")
            except EOFError:
                print()
                break
            text = line.strip()
            if text == "/exit":
                break
            if text == "/reset":
                messages = list(opening)
                print("(conversation reset)")
                continue
            if not text:
                continue
            messages.append({"role": "user", "content": text})
            tokens = tokenizer.encode(render_messages(template, messages), add_special_tokens=False).ids
            room = min(engine.runner.context_window, engine.runner.total_tokens) - len(tokens)
            if room < 1:
                print("error: the conversation fills the context window; /reset to start again", file=sys.stderr)
                messages.pop()
                continue
            try:
                request = engine.submit(tokens, SamplingOptions(
                    temperature=options.temperature, max_tokens=min(options.max_tokens, room)))
            except RequestError as err:
                print(f"error: {err}", file=sys.stderr)
                messages.pop()
                continue
            try:
                for event in request.stream:
                    print(event.text, end="", flush=True)
            except KeyboardInterrupt:
                engine.cancel(request)
                request.stream.result()
            print()
            messages.append({"role": "assistant", "content": request.stream.output.text})
    finally:
        engine.drain(grace_s=0.0)
    return 0
