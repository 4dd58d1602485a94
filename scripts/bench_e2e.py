"""End-to-end model speed: a model on the tvmattn cache vs TVM's stock paged KV cache.

The model: SmolLM2-135M (the default), a GGUF, or a Hugging Face config.json with random weights
(`scripts/llama-3.2-1b-config.json`: the Llama-3.2-1B shape, 16 layers, hidden 2048, 32/8 heads
of 64, FFN 8192, vocabulary 128,256, tied embeddings, Llama-3 RoPE scaling). Every library comes
from the same `compile_model` call (same model, dtype, page size and build flags; only
`--kv-cache` differs) and runs the same weights on the same inputs in one process:
- prefill: one sequence of --prompt-len tokens through `prefill` (begin_forward, embed,
  prefill, end_forward, synchronized), median of --reps runs -> tokens/s;
- decode at each batch size: every sequence first prefilled with --prompt-len tokens, then
  greedy `decode` (batch 1) / `batch_decode` steps with the argmax taken on the GPU (torch
  via DLPack where present; with CUDA graphs, where the library has sampling kernels, its
  `sample` as the graph's last kernel, the ids fed to the next step by its `feed_tokens`: a step
  is then one graph), timed over --steps steps after 3 warm-up steps -> tokens/s; with
  --rounds N, N such timings per library in rounds that alternate the libraries, the median
  round reported (the host's speed drifts between runs by more than the caches differ).
  Our cache's steps run back to back (its plan uploads are ordered on the kernels' stream); TVM's
  stock cache waits for the previous step before each one (`Runner.ordered_uploads`: its C++
  runtime uploads the next plan on a separate stream into the buffer the running step reads,
  which run ahead corrupts K/V or faults), so its step times include its host time.
Both phases run with Python's cyclic garbage collector off, as Generator runs them.
The two caches must agree: the prefill logits and the first decode step's logits are compared
(max |diff| printed; a large difference is reported as a failure).

Weights: OUT.params.npz beside a library when present (a build from the GGUF, or from random
blocks, below), otherwise seeded random weights with the model's shapes (speed does not depend on
the values); the report says which. Libraries are built into --libs when missing (needs a TVM
with its compiler), named --name (default: the model's: "smollm2", a file's stem; with
--keep-format its block type added); a library built elsewhere by `scripts/compile.py --target
cuda` (cubins embedded) is used as it is.

    python scripts/bench_e2e.py [--model smollm2-135m] [--libs build/e2e] [--batches 1,16,64] [--json e2e.json]
    python scripts/bench_e2e.py --model scripts/llama-3.2-1b-config.json --quantization keep --keep-format Q4_0

--quantization keep adds a library: our cache with the model's block-quantized weights kept
(compile --quantization keep: fused dequantize + matmul kernels, float16 activations), with CUDA
graphs as 'graph' and on its own weights (its params file). --model is then a GGUF (where the real
file cannot travel, `python -m tvmattn.weights.random_gguf` writes one of its shapes and block
types with random values), or a config.json with --keep-format Q4_0|Q4_1|Q8_0: every library is
then built from one set of random weights drawn as blocks of that type (compile --random-weights
SEED --random-format TYPE: kept in the quantized library, dequantized in the float ones), so
nothing but the config travels. Its logits are checked against the stock cache's like the
others' (the same blocks, dequantized to float16 there), and a line per phase gives its time
against the float16 graph run's.

--no-dependent-launch builds every library without programmatic dependent launch (the default
build, on sm_90 and newer, launches each kernel so that its launch overlaps the end of the one
before: tvmattn/compiler/dependent_launch.py), and --no-tensor-core-matmul with decode_step's
projections on CUDA cores at every batch (the default build runs them on tensor cores from batch
16 on: tvmattn/compiler/tensor_core_matmul.py), and --no-decode-append with the K/V append in a
kernel of its own (the default appends inside the tensor-core decode kernel:
tir_kernels.paged_decode_append). Such libraries are named NAME-nopdl-*.so, NAME-cc-*.so,
NAME-noda-*.so (or combinations: NAME-nopdl-cc-*.so), so that the ordinary libraries of --libs are
never taken for them; their rows carry `dependent_launch: false` / `tensor_core_matmul: false` /
`decode_append: false`, configurations of their own beside the ordinary rows (which carry no such
field).

--json PATH writes the results as rows of docs/bench-format.md (`make_row`): bench "e2e",
kernel "prefill" (batch 1, qo_len = seq_len = --prompt-len) or "decode" (qo_len 1, seq_len =
--prompt-len: the prompt each sequence holds when the warm-up steps begin), one row per library with
impl "tvmattn" (our cache) or "tvm-stock-cache", ms per prefill call / decode step, tokens_per_s,
and max_abs_diff: the max |diff| between the two libraries' logits (the same in both rows).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if os.path.dirname(os.path.abspath(__file__)) not in sys.path:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import tvm  # noqa: E402
from tvm import relax  # noqa: E402
from tvm.runtime import ShapeTuple  # noqa: E402

import bench_rows  # noqa: E402
import tvmattn  # noqa: E402,F401  - registers tvmattn.*
from tvmattn.build import (MODEL_NAMES, PARAMS_SUFFIX, RUNTIME_SUFFIX, BuildError, compile_model,  # noqa: E402
                           resolve_target, sidecar)
from tvmattn.compiler.dependent_launch import dependent_launch_problem  # noqa: E402
from tvmattn.compiler.tensor_core_matmul import tensor_core_matmul_problem  # noqa: E402
from tvmattn.generate import no_cyclic_gc  # noqa: E402

# always run: ours eagerly, ours replaying CUDA graphs (the same library; --no-cuda-graph leaves it out),
# the stock cache; "flashinfer" (--flashinfer) is ours with FlashInfer's kernels
KV_CACHES = ("tvmattn", "graph", "tvm")
LABELS = {"tvmattn": "tvmattn cache", "graph": "tvmattn cache, CUDA graphs", "tvm": "TVM stock cache",
          "flashinfer": "tvmattn cache + FlashInfer", "keep": "tvmattn cache, weights kept quantized"}
IMPLS = {"tvmattn": "tvmattn", "graph": "tvmattn-cuda-graph", "tvm": "tvm-stock-cache",
         "flashinfer": "tvmattn-flashinfer", "keep": "tvmattn-cuda-graph-keep"}  # the rows' impl
BUILD = {"tvmattn": dict(kv_cache="tvmattn"), "tvm": dict(kv_cache="tvm"),  # compile_model arguments
         "flashinfer": dict(kv_cache="tvmattn", attn_backend="flashinfer"),
         "keep": dict(kv_cache="tvmattn", quantization="keep")}
LIBRARY = {"graph": "tvmattn"}  # runs another entry's library
WARMUP_STEPS = 3
PROFILE_STEPS = 20  # decode steps of a --profile-host run
REPLAYS = 200  # back-to-back replays that time a graph step's GPU work
RANDOM_FORMATS = ("Q4_0", "Q4_1", "Q8_0")  # --keep-format: weights.random_blocks.RANDOM_BLOCK_TYPES
# build options whose runs are configurations of their own: (args / build option / row field,
# command-line flag, library name suffix, the value the flag sets, against the build's default)
OWN_CONFIG_BUILDS = (("dependent_launch", "--no-dependent-launch", "nopdl", False),
                     ("tensor_core_matmul", "--no-tensor-core-matmul", "cc", False),
                     ("decode_append", "--no-decode-append", "noda", False),
                     ("fused_batch_layers", "--fused-batch-layers", "fb", True))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="as for scripts/compile.py")
    p.add_argument("--libs", default="build/e2e", help="folder of the two libraries (built when missing)")
    p.add_argument("--name", default=None, help="library base name: NAME-tvmattn.so, NAME-tvm.so (default: "
                                                "smollm2, or the model file's stem; with --keep-format, plus its type)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--steps", type=int, default=64, help="timed decode steps per batch size")
    p.add_argument("--reps", type=int, default=10, help="timed prefill runs")
    p.add_argument("--rounds", type=int, default=1,
                   help="decode timings per batch size and library, taken in rounds that alternate the libraries "
                        "(each round starts with the next one); each library's median round is reported")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", type=int, default=0, metavar="BATCH",
                   help="also print the top GPU kernels of a decode step at this batch size, per cache, by "
                        "duration and by share of the stream's busy time (PDL overlap charged to the predecessor)")
    p.add_argument("--profile-host", type=int, default=0, metavar="BATCH",
                   help="also print where the host spends 20 decode steps at this batch size (cProfile), per cache")
    p.add_argument("--target", default="cuda", choices=["cuda", "llvm"], help="llvm: a CPU smoke run of this script")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON rows (docs/bench-format.md)")
    p.add_argument("--flashinfer", action="store_true",
                   help="also run a third library, our cache with FlashInfer's attention kernels (--attn-backend "
                        "flashinfer; its modules must be built: python -m tvmattn.flashinfer.build)")
    p.add_argument("--no-cuda-graph", action="store_true", help="leave out the CUDA-graph runs of our library")
    p.add_argument("--build-only", action="store_true",
                   help="build the run's missing libraries into --libs and stop (several builds may then run in "
                        "parallel, before the timed runs)")
    p.add_argument("--quantization", default="f16", choices=["f16", "keep"],
                   help="keep: also run our library with the GGUF's block-quantized weights kept (scripts/compile.py "
                        "--quantization keep; fused dequantize + matmul kernels, float16 activations), with CUDA "
                        "graphs as 'graph' and its own weights, beside the float16 libraries (needs a GGUF --model, "
                        "or a config.json with --keep-format)")
    p.add_argument("--keep-format", default=None, choices=RANDOM_FORMATS,
                   help="with --quantization keep and a config.json --model: draw random weights as blocks of this "
                        "type for every library (kept in the quantized one, dequantized in the float ones)")
    p.add_argument("--no-small-batch-matmul", dest="small_batch_matmul", action="store_false",
                   help="build every library with dlight's Matmul rule for decode_step's projections instead of "
                        "compiler.pipeline.SmallBatchMatmul")
    p.add_argument("--unfused-layers", dest="fused_layers", action="store_false",
                   help="build every library without the fused decode ops (compiler.fused_decode), to compare")
    p.add_argument("--no-dependent-launch", dest="dependent_launch", action="store_false", default=None,
                   help="build every library without programmatic dependent launch (compile --no-dependent-launch; "
                        "compiler.dependent_launch): its libraries are named NAME-nopdl-*.so and its rows carry "
                        "dependent_launch: false")
    p.add_argument("--no-tensor-core-matmul", dest="tensor_core_matmul", action="store_false", default=None,
                   help="build every library with decode_step's projections on CUDA cores at every batch (compile "
                        "--no-tensor-core-matmul; compiler.tensor_core_matmul): its libraries are named NAME-cc-*.so "
                        "and its rows carry tensor_core_matmul: false")
    p.add_argument("--no-decode-append", dest="decode_append", action="store_false",
                   help="build every library with the K/V append in a kernel of its own instead of inside the "
                        "tensor-core decode kernel (compile --no-decode-append; tir_kernels.paged_decode_append): its "
                        "libraries are named NAME-noda-*.so and its rows carry decode_append: false")
    p.add_argument("--fused-batch-layers", action="store_true",
                   help="build every library with the fused decode ops in the batched steps too (compile "
                        "--fused-batch-layers; compiler.tensor_core_matmul.norm_matmul from batch 16 on): its "
                        "libraries are named NAME-fb-*.so and its rows carry fused_batch_layers: true")
    args = p.parse_args(argv)
    graphs = args.target == "cuda" and not args.no_cuda_graph
    args.libraries = tuple(kv for kv in KV_CACHES if kv != "graph" or graphs) + (("flashinfer",) if args.flashinfer
                                                                                  else ())
    if args.quantization == "keep":
        args.libraries += ("keep",)
    config_model = args.model not in MODEL_NAMES and Path(args.model).suffix != ".gguf"
    if args.keep_format is not None and (args.quantization != "keep" or not config_model):
        p.error("argument --keep-format: needs --quantization keep and a config.json --model (a GGUF keeps its own "
                "blocks)")
    if args.quantization == "keep" and config_model and args.keep_format is None:
        p.error("argument --quantization keep: a config.json --model has no blocks to keep: add --keep-format "
                f"{{{','.join(RANDOM_FORMATS)}}} (random weights drawn as blocks)")
    # the build options this run sets against their defaults; a library's own default elsewhere
    args.own_config = {field: value for field, _, _, value in OWN_CONFIG_BUILDS if getattr(args, field) is value}
    for field, flag, _, _ in OWN_CONFIG_BUILDS:
        if field in args.own_config and args.target != "cuda":
            p.error(f"argument {flag}: needs --target cuda (a CUDA feature)")
    if args.tensor_core_matmul is None:  # compile's default: wherever the target takes it
        args.tensor_core_matmul = tensor_core_matmul_problem(args.target, args.small_batch_matmul) is None
    if args.dependent_launch is None:  # compile's default: wherever the target (the GPU's arch) takes it
        try:
            args.dependent_launch = dependent_launch_problem(resolve_target(args.target)) is None
        except BuildError as err:
            p.error(f"argument --target: {err}")
    if args.name is None:
        args.name = "smollm2" if args.model in MODEL_NAMES else Path(args.model).stem
        if args.keep_format is not None:
            args.name += "-" + args.keep_format.lower()
        for field, _, suffix, _ in OWN_CONFIG_BUILDS:  # not the ordinary libraries of the same folder
            if field in args.own_config:
                args.name += "-" + suffix
    if args.rounds < 1:
        p.error(f"argument --rounds: expected at least 1, got {args.rounds}")
    problem = bench_rows.output_path_problem(args.json)
    if problem:
        p.error(f"argument --json: {problem}")
    return args


def library_path(args, kv_cache: str) -> Path:
    return Path(args.libs) / f"{args.name}-{LIBRARY.get(kv_cache, kv_cache)}.so"


def sequence_tokens(args) -> int:
    """The most tokens a sequence of the run holds: its prompt, the timed steps or a profile's
    (--profile-host), the warm-up, and a margin."""
    steps = max(args.steps, PROFILE_STEPS if args.profile_host else 0)
    return args.prompt_len + steps + WARMUP_STEPS + 8


def ensure_libraries(args, max_batch: int) -> None:
    Path(args.libs).mkdir(parents=True, exist_ok=True)
    context = sequence_tokens(args)
    for library in args.libraries:
        path = library_path(args, library)
        if library in LIBRARY:
            continue
        if path.is_file():
            check_own_config_builds(args, path)
            continue
        print(f"building {path} ({LABELS[library]})")
        random = dict(random_weights=args.seed, random_format=args.keep_format) if args.keep_format else {}
        compile_model(args.model, path, target=args.target, max_batch_size=max_batch, context_window=context,
                      prefill_chunk=args.prompt_len, log=lambda m: print("  " + m),
                      small_batch_matmul=args.small_batch_matmul, fused_layers=args.fused_layers,
                      dependent_launch=args.dependent_launch, tensor_core_matmul=args.tensor_core_matmul,
                      decode_append=args.decode_append, fused_batch_layers=args.fused_batch_layers,
                      **random, **BUILD[library])


def check_own_config_builds(args, path: Path) -> None:
    """An existing library must have been built with each of OWN_CONFIG_BUILDS' options as this
    run builds them (its runtime file's build options), else its rows would say what did not run."""
    runtime = sidecar(path, RUNTIME_SUFFIX)
    options = json.loads(runtime.read_text())["metadata"]["build_options"] if runtime.is_file() else {}
    for field, _, _, _ in OWN_CONFIG_BUILDS:
        built, asked = bool(options.get(field, False)), getattr(args, field)
        if built != asked:
            raise SystemExit(f"{path} was built with {field}={built}, this run builds {field}={asked}: "
                             f"pass another --name or --libs")


def own_weights(args, device) -> list:
    """The quantized library's own parameters (block arrays), from its params file."""
    file = sidecar(library_path(args, "keep"), PARAMS_SUFFIX)
    if not file.is_file():
        raise SystemExit(f"--quantization keep: {file} is missing: --model must be a GGUF with weights, or a "
                         "config.json with --keep-format (delete a library built without them)")
    with np.load(file) as stored:
        return [tvm.runtime.tensor(stored[f"p{i}"], device=device) for i in range(len(stored.files))]


def load_weights(args, device, metadata) -> tuple[list, str]:
    """The same parameter tensors for every float library: stored weights if any library has them."""
    for kv_cache in (kv for kv in args.libraries if kv != "keep"):
        file = sidecar(library_path(args, kv_cache), PARAMS_SUFFIX)
        if file.is_file():
            with np.load(file) as stored:
                arrays = [stored[f"p{i}"] for i in range(len(metadata["params"]))]
            return [tvm.runtime.tensor(a, device=device) for a in arrays], f"weights from {file.name}"
    if metadata["params"][0]["dtype"] == "bfloat16":
        raise SystemExit("random weights for a bfloat16 library are not supported: build it with weights")
    rng = np.random.default_rng(args.seed)
    arrays = []
    for param in metadata["params"]:
        dtype = param["dtype"]
        if param["name"].endswith("norm.weight"):
            value = np.ones(param["shape"], dtype)
        else:
            value = (rng.standard_normal(param["shape"], dtype=np.float32) * 0.02).astype(dtype)
        arrays.append(value)
    return [tvm.runtime.tensor(a, device=device) for a in arrays], "random weights (seeded; no params file)"


class Runner:
    """One library in the VM with its cache; every call runs on the GPU, synchronized where timed."""

    def __init__(self, path: Path, device, params, capacity: int, max_batch: int, prefill_chunk: int,
                 graph: bool = False):
        self.device, self.params = device, params
        start = time.perf_counter()
        self.vm = relax.VirtualMachine(tvm.runtime.load_module(str(path)), device)
        self.load_s = time.perf_counter() - start
        runtime = json.loads(sidecar(path, RUNTIME_SUFFIX).read_text())
        self.metadata = runtime["metadata"]
        self.gpu_code = runtime["settings"].get("gpu_code")
        kind = self.metadata["kv_cache"]["kind"]
        # Whether a step's plan upload is ordered after the previous step's kernels: ours uploads
        # on the kernels' stream; TVM's stock cache copies into one reused device buffer on a
        # non-blocking copy stream, so a step must not begin before the previous one finished
        self.ordered_uploads = kind == "tvmattn"
        prefix = "tvmattn." if kind == "tvmattn" else "vm.builtin."
        self.host = {name: tvm.get_global_func(prefix + "kv_state_" + name)
                     for name in ("add_sequence", "remove_sequence", "begin_forward", "end_forward")}
        page = self.metadata["kv_cache"]["page_size"]
        self.cache = self.vm["create_paged_kv_cache"](
            ShapeTuple([max_batch]), ShapeTuple([capacity]), ShapeTuple([prefill_chunk]), ShapeTuple([page]),
            ShapeTuple([0]))
        self.hidden = self.metadata["model_config"]["hidden_size"]
        self.functions: dict = {}  # the VM's functions, looked up once
        self.plan_s = self.host_s = 0.0  # host seconds in begin_forward / in whole forwards
        self.embed_s = 0.0  # host seconds embedding an eager decode step's tokens (a library call of its own)
        self.graphs = None  # DecodeGraphs: decode steps replayed as CUDA graphs
        if graph:
            from tvmattn.runtime.graphs import DecodeGraphs

            if "decode_step" not in self.metadata["functions"]:
                raise SystemExit(f"{path} has no decode_step (built before CUDA-graph support): delete it to rebuild")
            from tvmattn.device_sampling import FEED_FUNCTION, has_device_sampling

            self.graph_ids: dict = {}
            # the greedy choice inside the graph where the library has sampling kernels: `sample`
            # with all-zero parameters (temperature 0: the argmax), its ids fed to the next step
            # by `feed_tokens`, so that a step is one graph and no kernel runs between graphs
            self.samples_in_graph = (has_device_sampling(self.metadata)
                                     and FEED_FUNCTION in self.metadata.get("functions", ()))
            self.graph_params: dict = {}
            self.graphs = DecodeGraphs(self.cache, self._decode_step, max_batch)
        self.sampled = None  # the last graph step's sampled ids (samples_in_graph), else None

    def _decode_step(self, bucket: int):
        from tvmattn.session import library_decode_step

        params = None
        if self.samples_in_graph:
            if bucket not in self.graph_params:
                self.graph_params[bucket] = tvm.runtime.tensor(np.zeros((bucket, 4), np.float32), self.device)
            params = self.graph_params[bucket]
        return library_decode_step(self.vm, self.graph_ids[bucket], self.cache, self.params, self.hidden, params)

    def function(self, name: str):
        function = self.functions.get(name)
        if function is None:
            function = self.functions[name] = self.vm[name]
        return function

    def embed(self, ids, shape):
        return self.function("embed")(ids, self.params)._create_view(shape)

    def forward(self, function: str, seq_ids: list[int], lengths: list[int], embeds):
        start = time.perf_counter()
        self.host["begin_forward"](self.cache, ShapeTuple(seq_ids), ShapeTuple(lengths))
        planned = time.perf_counter()
        logits, _ = self.function(function)(embeds, self.cache, self.params)
        self.host["end_forward"](self.cache)
        self.plan_s += planned - start
        self.host_s += time.perf_counter() - start
        return logits

    def prefill(self, seq_id: int, ids):
        n = ids.shape[0]
        return self.forward("prefill", [seq_id], [n], self.embed(ids, (1, n, self.hidden)))

    def decode(self, seq_ids: list[int], ids):
        b = len(seq_ids)
        if self.graphs is not None:
            from tvmattn.runtime.graphs import bucket_of

            start = time.perf_counter()
            bucket = bucket_of(b, self.graphs.buckets)
            if bucket not in self.graph_ids:
                self.graph_ids[bucket] = tvm.runtime.empty((bucket,), "int32", device=self.device)
            buffer = self.graph_ids[bucket]
            ids_view = buffer if b == bucket else buffer._create_view((b,), "int32", 0)
            if self.samples_in_graph:
                self.function("feed_tokens")(ids, ids_view)
            else:
                ids_view.copyfrom(ids)
            outputs = self.graphs.run(seq_ids)
            logits = outputs
            if self.samples_in_graph:
                logits, sampled = outputs
                self.sampled = sampled if b == bucket else sampled._create_view((b,), "int32", 0)
            if b != bucket:
                logits = logits._create_view((b, *logits.shape[1:]), "float32", 0)
            self.host_s += time.perf_counter() - start
            return logits
        function = "decode" if b == 1 else "batch_decode"
        start = time.perf_counter()
        embeds = self.embed(ids, (b, 1, self.hidden))
        self.embed_s += time.perf_counter() - start
        return self.forward(function, seq_ids, [1] * b, embeds)

    def sync(self):
        self.device.sync()


def greedy(logits, device):
    """argmax over the vocabulary of logits [b, 1, vocab] -> int32 tensor [b] on the device."""
    try:
        import torch

        tokens = torch.from_dlpack(logits)[:, 0].argmax(-1).to(torch.int32).contiguous()
        return tvm.runtime.from_dlpack(tokens), tokens
    except ImportError:
        host = logits.numpy()[:, 0].argmax(-1).astype(np.int32)
        return tvm.runtime.tensor(host, device=device), host


def next_tokens(runner: Runner, logits):
    """The greedy ids of a decode step on the device: chosen inside its graph (Runner.sampled),
    else `greedy` of its logits."""
    if runner.graphs is not None and runner.sampled is not None:
        return runner.sampled
    return greedy(logits, runner.device)[0]


@no_cyclic_gc()
def bench_prefill(runner: Runner, ids, reps: int) -> float:
    times = []
    for rep in range(reps + 2):
        runner.host["add_sequence"](runner.cache, 0)
        runner.sync()
        start = time.perf_counter()
        runner.prefill(0, ids)
        runner.sync()
        if rep >= 2:
            times.append(time.perf_counter() - start)
        runner.host["remove_sequence"](runner.cache, 0)
    return statistics.median(times)


@no_cyclic_gc()
def bench_decode(runner: Runner, prompts, steps: int, around_steps=None):
    """-> (DecodeTiming, first-step logits as numpy); around_steps: a context manager
    entered for the timed steps only (a profiler)."""
    seq_ids = list(range(len(prompts)))
    for seq_id, ids in zip(seq_ids, prompts):
        runner.host["add_sequence"](runner.cache, seq_id)
        runner.prefill(seq_id, ids)
        # TVM's C++ cache uploads its page tables on a separate copy stream into one reused
        # buffer: back-to-back forwards without a sync let a later upload overwrite the tables
        # of kernels still running. Fill the caches synchronously.
        runner.sync()
    tokens = tvm.runtime.tensor(np.full(len(prompts), 17, np.int32), device=runner.device)
    first = None
    try:
        for _ in range(WARMUP_STEPS):
            if not runner.ordered_uploads:
                runner.sync()
            logits = runner.decode(seq_ids, tokens)
            if first is None:
                first = logits.numpy()
            tokens = next_tokens(runner, logits)
        runner.sync()
        captured = runner.graphs.captures if runner.graphs is not None else 0
        wait_s = choose_s = 0.0  # host seconds waiting for the previous step / choosing the tokens
        with around_steps or contextlib.nullcontext():
            runner.plan_s = runner.host_s = runner.embed_s = 0.0
            start = time.perf_counter()
            for _ in range(steps):
                if not runner.ordered_uploads:  # (see Runner.ordered_uploads)
                    waiting = time.perf_counter()
                    runner.sync()
                    wait_s += time.perf_counter() - waiting
                logits = runner.decode(seq_ids, tokens)
                choosing = time.perf_counter()
                tokens = next_tokens(runner, logits)
                choose_s += time.perf_counter() - choosing
            runner.sync()
            per_step = (time.perf_counter() - start) / steps
        captures = (runner.graphs.captures - captured) if runner.graphs is not None else None
        gpu_s = None
        if runner.graphs is not None:  # the last step's graph replayed back to back: its GPU time
            from tvmattn.runtime.graphs import bucket_of

            gpu_s = runner.graphs.time_replays(bucket_of(len(seq_ids), runner.graphs.buckets), REPLAYS)
    finally:
        for seq_id in seq_ids:
            runner.host["remove_sequence"](runner.cache, seq_id)
    return DecodeTiming(per_step, runner.host_s / steps, runner.plan_s / steps, gpu_s, captures,
                        runner.embed_s / steps, choose_s / steps, wait_s / steps), first


def round_order(libraries: tuple, round_index: int) -> tuple:
    """The libraries in the order round `round_index` times them: rotated by one a round, so
    none is always first (after a prefill) or last."""
    shift = round_index % len(libraries)
    return libraries[shift:] + libraries[:shift]


def median_round(timings: list):
    """The round whose step time is the median (the lower middle one of an even count)."""
    ranked = sorted(timings, key=lambda t: t.step_s)
    return ranked[(len(ranked) - 1) // 2]


@dataclasses.dataclass
class DecodeTiming:
    step_s: float  # wall time per step, synchronized
    host_s: float  # host time per step in begin_forward + the library call + end_forward
    plan_s: float  # of which begin_forward
    gpu_s: float | None = None  # a CUDA-graph step's GPU time: its graph replayed back to back (None: eager)
    captures: int | None = None  # graphs captured during the timed steps (None: eager)
    # the step's other host time: embedding its tokens (eager steps), choosing the next tokens
    # (`next_tokens`), and waiting for the previous step (the stock cache: Runner.ordered_uploads)
    embed_s: float = 0.0
    choose_s: float = 0.0
    wait_s: float = 0.0


def agrees(diff: float, scale: float) -> bool:
    """The rows' `agrees`: max |diff| of the two libraries' logits finite and within 2e-2 of the
    largest |logit| (at least 1), the tolerance of the run's agreement check."""
    return math.isfinite(diff) and diff <= 2e-2 * max(scale, 1.0)


def make_row(kernel: str, kv_cache: str, *, batch: int, prompt_len: int, seconds: float, diff: float, scale: float,
             target: str, dtype: str, meta: dict, timing: DecodeTiming | None = None,
             extra: dict | None = None) -> dict:
    """One row of docs/bench-format.md for `kv_cache`'s library ("tvmattn", "tvm", "flashinfer"):
    `seconds` per prefill call (kernel "prefill", one sequence of `prompt_len` tokens) or per decode
    step (kernel "decode", `batch` sequences holding `prompt_len` prompt tokens, one token each);
    `diff`/`scale`: max |diff| between this library's logits and the stock one's / max |logit| of the stock one."""
    if kernel not in ("prefill", "decode"):
        raise ValueError(f"kernel {kernel!r}: expected 'prefill' or 'decode'")
    prefill = kernel == "prefill"
    row = {"bench": "e2e", "kernel": kernel, "impl": IMPLS[kv_cache], "variant": f"{target}/{dtype}", "dtype": dtype,
           "batch": batch, "seq_len": prompt_len, "qo_len": prompt_len if prefill else 1, "ms": 1e3 * seconds,
           "tokens_per_s": (prompt_len if prefill else batch) / seconds,
           "max_abs_diff": diff, "max_abs_logit": scale, "agrees": agrees(diff, scale)}
    if timing is not None:
        row.update(host_ms=1e3 * timing.host_s, begin_forward_ms=1e3 * timing.plan_s, embed_ms=1e3 * timing.embed_s,
                   choose_ms=1e3 * timing.choose_s, wait_ms=1e3 * timing.wait_s)
        if timing.gpu_s is not None:
            row.update(gpu_ms=1e3 * timing.gpu_s)
        if timing.captures is not None:
            row.update(graph_captures=timing.captures)
    row.update(extra or {})
    row.update(meta)
    return row


def stream_shares(kernels) -> tuple[dict, float]:
    """({name: (microseconds, calls)}, busy microseconds) of kernels [(name, start, end)] of one
    stream: each kernel's share of the stream's busy time, from the later of its start and the
    end of the kernels before it to its own end. Under programmatic dependent launch a kernel
    starts while its predecessor runs and waits for it; that wait is the predecessor's time, so
    the shares add up to the busy time (idle gaps excluded) where plain durations overlap."""
    shares, busy, done = {}, 0.0, -math.inf
    for name, start, end in sorted(kernels, key=lambda k: (k[1], k[2])):
        share = max(0.0, end - max(start, done))
        total, calls = shares.get(name, (0.0, 0))
        shares[name] = (total + share, calls + 1)
        busy += share
        done = max(done, end)
    return shares, busy


def profile_decode(runner: Runner, prompts, steps: int = 5, top: int = 15) -> None:
    """Print the GPU kernels of `steps` decode steps by total time (torch.profiler / CUPTI), then
    by their share of the stream's busy time (`stream_shares`)."""
    from torch.profiler import ProfilerActivity, profile

    import torch

    prof = profile(activities=[ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU])
    bench_decode(runner, prompts, steps, around_steps=prof)
    sort_by = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    print(prof.key_averages().table(sort_by=sort_by, row_limit=top, max_name_column_width=60))
    if not torch.cuda.is_available():
        return
    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))]
    shares, busy = stream_shares(kernels)
    print(f"stream busy {busy / steps:.1f} us a step; each kernel's share (from its predecessor's end to its own):")
    for name, (total, calls) in sorted(shares.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"  {total / steps:8.1f} us a step {total / calls:7.2f} us a call {calls // steps:4d} a step  {name[:70]}")


def profile_host(runner: Runner, prompts, steps: int = PROFILE_STEPS, top: int = 18) -> None:
    """Print the host functions of `steps` decode steps by their own time (cProfile)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    bench_decode(runner, prompts, steps, around_steps=profiler)
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


def main(argv=None) -> int:
    args = parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    max_batch = max(batches)
    if args.build_only:
        ensure_libraries(args, max_batch)
        print(f"libraries in {args.libs}: " + ", ".join(library_path(args, kv).name for kv in args.libraries
                                                         if kv not in LIBRARY))
        return 0
    device = tvm.cuda(0) if args.target == "cuda" else tvm.cpu(0)
    if not device.exist:
        raise SystemExit("bench_e2e.py needs a CUDA GPU (or --target llvm for a CPU smoke run)")
    ensure_libraries(args, max_batch)
    metadata = json.loads(sidecar(library_path(args, "tvmattn"), RUNTIME_SUFFIX).read_text())["metadata"]
    params, weights_note = load_weights(args, device, metadata)
    page = metadata["kv_cache"]["page_size"]
    pages_per_sequence = -(-sequence_tokens(args) // page)
    capacity = max_batch * pages_per_sequence * page
    graphs = ("graph", "keep") if args.target == "cuda" and not args.no_cuda_graph else ()
    runners = {kv: Runner(library_path(args, kv), device, own_weights(args, device) if kv == "keep" else params,
                          capacity, max_batch, args.prompt_len, graph=kv in graphs)
               for kv in args.libraries}
    config = metadata["model_config"]
    vocab = config["vocab_size"]
    rng = np.random.default_rng(args.seed)
    prompt = rng.integers(0, vocab, args.prompt_len, dtype=np.int32)
    prompt_ids = tvm.runtime.tensor(prompt, device=device)

    print(f"model: {args.model} ({config['num_hidden_layers']} layers, hidden {config['hidden_size']}, "
          f"{config['num_attention_heads']}/{config['num_key_value_heads']} heads), "
          f"{metadata['build_options']['dtype']}, page {metadata['kv_cache']['page_size']}; {weights_note}"
          + ("; every kernel launched with programmatic dependent launch" if metadata["build_options"].get(
              "dependent_launch") else "")
          + ("; decode_step's projections on CUDA cores at every batch" if "tensor_core_matmul" in args.own_config
             else ""))
    for kv, runner in runners.items():
        print(f"{LABELS[kv]}: library load {runner.load_s:.3f} s, GPU code: {runner.gpu_code}")

    failures = []
    rows = []
    json_rows = []
    common = dict(target=args.target, dtype=metadata["build_options"]["dtype"],
                  meta=bench_rows.run_meta(gpu=args.target == "cuda") if args.json else {})
    kv_config = metadata["kv_cache"]
    model_fields = {"model": args.model, "num_layers": config["num_hidden_layers"], "head_dim": kv_config["head_dim"],
                    "num_qo_heads": kv_config["num_qo_heads"], "num_kv_heads": kv_config["num_kv_heads"],
                    "page_size": page}

    # which decode functions of the float libraries take compiler.fused_decode's ops (models/export.py:
    # CUDA builds in `decode` only); the kept library's layers fuse in their own GEMVs either way
    fused_layers = (("decode" if args.target == "cuda" and not args.fused_batch_layers else "all")
                    if args.fused_layers else "none")

    def kept_variant(kv: str) -> dict:
        """The kept library's rows name the block type of random blocks (--keep-format) in their
        variant; the float libraries' rows say which decode functions fuse (fused_layers); the rows
        of a run with OWN_CONFIG_BUILDS' flags say so (dependent_launch: true, ...; the others carry no
        such field)."""
        pdl = dict(args.own_config)
        if kv != "keep":
            return {"fused_layers": fused_layers, **pdl}
        if args.keep_format is None:
            return pdl
        return {"variant": f"{args.target}/{common['dtype']}/{args.keep_format.lower()}", **pdl}

    # prefill
    prefill_s, prefill_logits = {}, {}
    for kv, runner in runners.items():
        runner.host["add_sequence"](runner.cache, 0)
        start = time.perf_counter()
        prefill_logits[kv] = runner.prefill(0, prompt_ids).numpy()
        print(f"{LABELS[kv]}: first prefill call (loads the GPU modules) {time.perf_counter() - start:.3f} s")
        runner.host["remove_sequence"](runner.cache, 0)
        prefill_s[kv] = bench_prefill(runner, prompt_ids, args.reps)
    libraries = args.libraries
    ours = [kv for kv in libraries if kv != "tvm"]
    agreement = []
    window = kv_config.get("sliding_window", 0) if any(kv_config.get("sliding_layers", ())) else 0
    # TVM's stock cache prefills past a sliding window with unwindowed new tokens (docs/design.md,
    # "MHA_SLIDING"): its logits are then not the model's, and the two caches are not compared
    inexact_stock = bool(window) and args.prompt_len > window
    if window:
        model_fields["sliding_window"] = window
    if inexact_stock:
        print(f"the prompt ({args.prompt_len} tokens) is longer than the sliding window ({window}): TVM's stock "
              "cache attends past it unwindowed in prefill, so the logits are not compared (times only)")

    def compare(what: str, logits: dict) -> tuple[dict, float]:
        """max |diff| of each library's logits against the stock cache's (0 for the stock one); a
        disagreement is a failure."""
        scale = float(np.abs(logits["tvm"]).max())
        diffs = {"tvm": 0.0}
        for kv in ours:
            diffs[kv] = float(np.abs(logits[kv] - logits["tvm"]).max())
            agreement.append(f"{what}, {LABELS[kv]} vs stock: max |diff| {diffs[kv]:.3e} (max |logit| {scale:.3e})")
            if not agrees(diffs[kv], scale) and not inexact_stock:
                failures.append(f"{what}: {LABELS[kv]} disagrees with the stock cache")
        diffs["tvm"] = max(diffs[kv] for kv in ours)
        return diffs, scale

    diffs, scale = compare("prefill logits", prefill_logits)
    json_rows += [make_row("prefill", kv, batch=1, prompt_len=args.prompt_len, seconds=prefill_s[kv], diff=diffs[kv],
                           scale=scale, **common, extra={**model_fields, **kept_variant(kv), "reps": args.reps})
                  for kv in libraries]
    rows.append((f"prefill {args.prompt_len}", 1, {kv: args.prompt_len / prefill_s[kv] for kv in libraries},
                 {kv: 1e3 * prefill_s[kv] for kv in libraries}))

    # decode
    host_lines = []
    for batch in batches:
        prompts = [tvm.runtime.tensor(np.roll(prompt, 7 * i), device=device) for i in range(batch)]
        step_s, first, timings = {}, {}, {}
        rounds = {kv: [] for kv in runners}
        for round_index in range(args.rounds):
            for kv in round_order(tuple(runners), round_index):
                timing, logits = bench_decode(runners[kv], prompts, args.steps)
                rounds[kv].append(timing)
                first.setdefault(kv, logits)
        for kv in runners:
            timings[kv] = timing = median_round(rounds[kv])
            step_s[kv] = timing.step_s
            gpu = "" if timing.gpu_s is None else (f", GPU {1e3 * timing.gpu_s:.3f} ms (graph replayed alone), "
                                                   f"{timing.captures} captures in the timed steps")
            spread = "" if args.rounds == 1 else (
                f" (median of {args.rounds} rounds; wall {1e3 * min(t.step_s for t in rounds[kv]):.3f} to "
                f"{1e3 * max(t.step_s for t in rounds[kv]):.3f} ms)")
            host_lines.append(f"decode batch {batch}, {LABELS[kv]}: host {1e3 * timing.host_s:.3f} ms per step "
                              f"(begin_forward {1e3 * timing.plan_s:.3f} ms), and {1e3 * timing.embed_s:.3f} ms "
                              f"embedding, {1e3 * timing.choose_s:.3f} choosing the tokens, {1e3 * timing.wait_s:.3f} "
                              f"waiting for the previous step; wall {1e3 * timing.step_s:.3f} ms{gpu}" + spread)
        diffs, scale = compare(f"decode batch {batch}, first step logits", first)
        json_rows += [make_row("decode", kv, batch=batch, prompt_len=args.prompt_len, seconds=step_s[kv],
                               diff=diffs[kv], scale=scale, **common, timing=timings[kv],
                               extra={**model_fields, **kept_variant(kv), "steps": args.steps,
                                      "warmup_steps": WARMUP_STEPS,
                                      **({"rounds": args.rounds} if args.rounds > 1 else {})})
                      for kv in libraries]
        rows.append(("decode", batch, {kv: batch / step_s[kv] for kv in libraries},
                     {kv: 1e3 * step_s[kv] for kv in libraries}))

    if args.profile:
        prompts = [tvm.runtime.tensor(np.roll(prompt, 7 * i), device=device) for i in range(args.profile)]
        for kv, runner in runners.items():
            print(f"--- {LABELS[kv]}: GPU kernels of 5 decode steps at batch {args.profile}")
            profile_decode(runner, prompts)
    if args.profile_host:
        prompts = [tvm.runtime.tensor(np.roll(prompt, 7 * i), device=device) for i in range(args.profile_host)]
        for kv, runner in runners.items():
            print(f"--- {LABELS[kv]}: host time of 20 decode steps at batch {args.profile_host}")
            profile_host(runner, prompts)

    print()
    short = {"tvmattn": "tvmattn", "graph": "graph", "tvm": "stock", "flashinfer": "flashinfer", "keep": "keep"}
    header = f"{'phase':>12} {'batch':>5} " + " ".join(f"{short[kv] + ' tok/s':>17}" for kv in libraries)
    header += " " + " ".join(f"{short[kv] + ' ms':>14}" for kv in libraries)
    header += " " + " ".join(f"{short[kv] + '/stock':>17}" for kv in ours)
    print(header)
    print("-" * len(header))
    for phase, batch, rate, ms in rows:
        print(f"{phase:>12} {batch:>5} " + " ".join(f"{rate[kv]:>17.1f}" for kv in libraries) + " "
              + " ".join(f"{ms[kv]:>14.3f}" for kv in libraries) + " "
              + " ".join(f"{rate[kv] / rate['tvm']:>17.2f}" for kv in ours))
    print("(tok/s: prompt tokens per second in prefill, generated tokens per second in decode, one token per "
          "sequence per step; ms: per prefill call / per decode step, synchronized; "
          "X/stock = X's tokens/s / the stock cache's)")
    if "keep" in libraries:
        versus = "graph" if "graph" in libraries else "tvmattn"
        for phase, batch, rate, ms in rows:
            print(f"{phase} batch {batch}: weights kept quantized {ms['keep']:.3f} ms vs float16 ({short[versus]}) "
                  f"{ms[versus]:.3f} ms: {ms[versus] / ms['keep']:.2f}x")
    for line in host_lines:
        print(line)
    print()
    for line in agreement:
        print(line)
    return bench_rows.finish(json_rows, args.json, failures, "FAILED: ", "; ")


if __name__ == "__main__":
    sys.exit(main())
