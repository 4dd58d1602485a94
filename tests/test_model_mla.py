"""The DeepSeek-V2-style library (multi-head latent attention on tvmattn's MLA cache) against an
independent float64 torch model, on the CPU (llvm, float32) and on CUDA (fp16).

The library is compiled once per configuration by `compile_model` from the example config
(scripts/deepseek-v2-tiny-config.json, q_lora_rank 48, and a copy without the q bottleneck),
with random parameters (`--random-weights`); the test turns those parameters back into HF
tensors (gate_up split into gate and up, the rope rows of q_b_proj / q_proj and
kv_a_proj_with_mqa interleaved again) and runs them through the torch model below.

The torch model is written from HF's DeepSeek-V2 attention, without weight absorption: per
head q = [q_nope, q_pe]; c, k_pe = kv_a_proj_with_mqa(x), c RMS-normed; kv_b_proj(c) = per-head
[k_nope, v]; k = [k_nope, k_pe] (k_pe shared by the heads); RoPE on q_pe and k_pe as HF applies
it (interleaved pairs de-interleaved by view / transpose, then rotate-half); softmax scale
1/sqrt(nope + rope); causal; no KV cache (every step recomputes the whole sequence). The
library instead caches [c, k_pe] and runs absorbed queries in decode and against the history.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import tvm

import tvmattn  # noqa: F401  - registers the tvmattn.* functions the library calls
from test_model import LOGITS_TOLERANCE, Session, load_bundle, run_batch, run_single
from tvmattn.build import compile_model
from tvmattn.generate import Generator
from tvmattn.models import ModelConfigError
from tvmattn.models.config import DeepseekV2Config, model_config_from_hf

CONFIG_FILE = Path(__file__).resolve().parent.parent / "scripts" / "deepseek-v2-tiny-config.json"
HF = json.loads(CONFIG_FILE.read_text())


class TorchDeepseekV2:
    """DeepSeek-V2 decoder (dense MLPs) in float64 torch; `logits(tokens)` runs the whole sequence."""

    def __init__(self, hf: dict, weights: dict[str, np.ndarray]):
        self.hf = hf
        self.w = {name: torch.tensor(value, dtype=torch.float64) for name, value in weights.items()}
        self.heads = hf["num_attention_heads"]
        self.nope, self.rope, self.dv = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"], hf["v_head_dim"]
        self.latent = hf["kv_lora_rank"]

    def _rms_norm(self, x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.hf["rms_norm_eps"]) * weight

    def _linear(self, x, name):
        return x @ self.w[f"{name}.weight"].T

    def _rope(self, x, positions):
        """HF's apply_rotary_pos_emb of DeepSeek-V2: x [n, h, d] in interleaved pair order."""
        n, h, d = x.shape
        x = x.view(n, h, d // 2, 2).transpose(-1, -2).reshape(n, h, d)
        inv_freq = 1.0 / self.hf["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        angles = positions[:, None].double() * inv_freq[None, :]
        emb = torch.cat([angles, angles], -1)[:, None, :]
        rotated = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
        return x * emb.cos() + rotated * emb.sin()

    def _attention(self, x, p, positions):
        q_nope, q_pe, c, k_pe = self._project(x, p, positions)
        causal = torch.ones(x.shape[0], x.shape[0], dtype=torch.bool).tril()
        return self._attend(p, q_nope, q_pe, c, k_pe, causal)

    def _project(self, x, p, positions):
        """(q_nope [n, H, nope], q_pe [n, H, rope], c [n, latent] (normed), k_pe [n, 1, rope] (rotated))."""
        n, heads = x.shape[0], self.heads
        if self.hf.get("q_lora_rank"):
            q = self._linear(self._rms_norm(self._linear(x, f"{p}.q_a_proj"), self.w[f"{p}.q_a_layernorm.weight"]),
                             f"{p}.q_b_proj")
        else:
            q = self._linear(x, f"{p}.q_proj")
        q = q.view(n, heads, self.nope + self.rope)
        q_nope, q_pe = q[..., :self.nope], self._rope(q[..., self.nope:], positions)
        compressed = self._linear(x, f"{p}.kv_a_proj_with_mqa")
        c = self._rms_norm(compressed[:, :self.latent], self.w[f"{p}.kv_a_layernorm.weight"])
        k_pe = self._rope(compressed[:, None, self.latent:], positions)
        return q_nope, q_pe, c, k_pe

    def _attend(self, p, q_nope, q_pe, c, k_pe, mask):
        """Queries [n, H, *] over the keys and values of latent rows c [m, latent], k_pe [m, 1, rope];
        mask [n, m] True where a query sees a key."""
        (n, heads, _), m = q_nope.shape, c.shape[0]
        kv = self._linear(c, f"{p}.kv_b_proj").view(m, heads, self.nope + self.dv)
        k = torch.cat([kv[..., :self.nope], k_pe.expand(m, heads, self.rope)], -1)
        v = kv[..., self.nope:]
        scores = torch.einsum("qhd,khd->hqk", torch.cat([q_nope, q_pe], -1), k) / math.sqrt(self.nope + self.rope)
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        return self._linear(torch.einsum("hqk,khd->qhd", probs, v).reshape(n, heads * self.dv), f"{p}.o_proj")

    def logits(self, tokens: list[int], start: int = 0) -> np.ndarray:
        """[len(tokens), vocab] logits of every position (the first at position `start`)."""
        x = self.w["model.embed_tokens.weight"][torch.tensor(tokens)]
        positions = torch.arange(start, start + len(tokens))
        for i in range(self.hf["num_hidden_layers"]):
            p = f"model.layers.{i}"
            x = x + self._attention(self._rms_norm(x, self.w[f"{p}.input_layernorm.weight"]), f"{p}.self_attn",
                                    positions)
            h = self._rms_norm(x, self.w[f"{p}.post_attention_layernorm.weight"])
            gate, up = self._linear(h, f"{p}.mlp.gate_proj"), self._linear(h, f"{p}.mlp.up_proj")
            x = x + self._linear(torch.nn.functional.silu(gate) * up, f"{p}.mlp.down_proj")
        x = self._rms_norm(x, self.w["model.norm.weight"])
        return (x @ self.w["lm_head.weight"].T).numpy()


def interleave_rope_rows(rows: np.ndarray, rope: int) -> np.ndarray:
    """The library's rotate-half order of the last `rope` rows back to HF's interleaved pairs:
    HF row 2i is library row i, HF row 2i + 1 is library row rope / 2 + i."""
    head, tail = rows[:-rope], rows[-rope:]
    pairs = np.empty_like(tail)
    pairs[0::2], pairs[1::2] = tail[:rope // 2], tail[rope // 2:]
    return np.concatenate([head, pairs])


def hf_weights(hf: dict, named: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The library's parameters as HF tensors (see the module docstring)."""
    heads, rope = hf["num_attention_heads"], hf["qk_rope_head_dim"]
    out = {}
    for name, value in named.items():
        value = value.astype(np.float32)
        if name.endswith("gate_up_proj.weight"):
            half = value.shape[0] // 2
            out[name.replace("gate_up_proj", "gate_proj")] = value[:half]
            out[name.replace("gate_up_proj", "up_proj")] = value[half:]
        elif name.endswith(("q_proj.weight", "q_b_proj.weight")):
            per_head = value.reshape(heads, -1, value.shape[1])
            out[name] = np.stack([interleave_rope_rows(h, rope) for h in per_head]).reshape(value.shape)
        elif name.endswith("kv_a_proj_with_mqa.weight"):
            out[name] = interleave_rope_rows(value, rope)
        else:
            out[name] = value
    return out


class MLAModel:
    """A bundle from compile_model with random parameters, loaded into a VM, and the torch model
    on the same weights (Session's interface: vm, params, device, kv_cache, tolerance, torch)."""

    def __init__(self, hf: dict, folder: Path, seed: int, target: str = "llvm", dtype: str = "float32",
                 kv_cache_dtype: str | None = None):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(hf))
        self.lib = folder / "model.so"
        compile_model(str(folder / "config.json"), self.lib, target=target, dtype=dtype, page_size=16,
                      max_batch_size=4, context_window=256, prefill_chunk=64, random_weights=seed,
                      kv_cache_dtype=kv_cache_dtype, log=lambda m: None)
        self.kv_cache = "tvmattn"
        self.device = tvm.cpu() if target == "llvm" else tvm.cuda()
        self.tolerance = LOGITS_TOLERANCE[dtype]
        self.vm, self.metadata, self.params, named = load_bundle(self.lib, self.device)
        self.torch_weights = hf_weights(hf, named)
        self.torch = TorchDeepseekV2(hf, self.torch_weights)

    def session(self) -> Session:
        return Session(self, vm=self.vm)


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory) -> MLAModel:
    return MLAModel(HF, tmp_path_factory.mktemp("mla"), seed=5)


@pytest.fixture(scope="module")
def mla_model_without_q_lora(tmp_path_factory) -> MLAModel:
    return MLAModel({**HF, "q_lora_rank": None}, tmp_path_factory.mktemp("mla-no-q-lora"), seed=6)


PROMPT = [5, 17, 99, 3, 42, 64, 7, 120, 1, 33, 18, 77, 2, 90, 11, 54, 26, 8, 71]  # crosses a page (16)
PROMPTS = [[9, 4, 100, 23, 61], [12, 80, 3, 3, 45, 127, 0, 66, 19, 101, 38, 7, 56, 91, 14, 29, 88]]


def test_config_from_hf():
    config = model_config_from_hf(HF)
    assert isinstance(config, DeepseekV2Config)
    assert (config.qk_head_dim, config.q_lora_rank) == (48, 48)
    assert config.sm_scale == pytest.approx(1 / math.sqrt(48)), "the scale comes from nope + rope, not the latent"
    assert model_config_from_hf({**HF, "q_lora_rank": None}).q_lora_rank == 0
    assert model_config_from_hf({**HF, "n_routed_experts": 8, "first_k_dense_replace": 2}).num_hidden_layers == 2
    refused = [({"n_routed_experts": 8, "first_k_dense_replace": 1}, "n_routed_experts"),
               ({"rope_scaling": {"type": "yarn", "factor": 40}}, "rope_scaling"),
               ({"kv_lora_rank": 40}, "kv_lora_rank"), ({"qk_rope_head_dim": 0}, "qk_rope_head_dim"),
               ({"qk_nope_head_dim": 256}, "qk_nope_head_dim"), ({"attention_bias": True}, "attention_bias")]
    for change, field in refused:
        with pytest.raises(ModelConfigError, match=field):
            model_config_from_hf({**HF, **change})
    with pytest.raises(ModelConfigError, match="kv_lora_rank"):
        model_config_from_hf({key: value for key, value in HF.items() if key != "kv_lora_rank"})


def test_library_metadata(mla_model):
    meta = mla_model.metadata
    assert meta["model_type"] == "deepseek_v2" and "batch_verify" not in meta["functions"]
    assert meta["kv_cache"]["attention"] == "mla" and meta["kv_cache"]["latent_dim"] == 64
    session = mla_model.session()
    assert session.cache.options.is_mla and session.cache.options.qk_head_dim == 64 + 16


def test_prefill_then_decode_matches_torch(mla_model):
    """Prefill (self attention among the prompt, nothing cached before) and 8 decode steps
    (absorbed attention over the latent cache), each step's logits against torch."""
    run_single(mla_model.session(), PROMPT, steps=8)


def test_batch_of_different_lengths_matches_torch(mla_model):
    """batch_prefill scores every position of a 5- and a 17-token prompt, then batch_decode."""
    run_batch(mla_model.session(), PROMPTS, steps=5)


def test_chunked_prefill_merges_self_and_cross_attention(mla_model):
    """Prefill in chunks: each chunk's self attention merged with the absorbed cross attention
    over the cached history (a one-token chunk is a decode step for the cache, as in TVM, so it
    goes through decode), then decode."""
    session = mla_model.session()
    session.add(0)
    for chunk in (PROMPT[:4], PROMPT[4:13], PROMPT[13:14], PROMPT[14:16], PROMPT[16:]):
        logits = session.prefill(0, chunk) if len(chunk) > 1 else session.decode(0, chunk[0])
        np.testing.assert_allclose(logits, mla_model.torch.logits(session.tokens[0])[-1], **mla_model.tolerance,
                                   err_msg=f"chunk ending at {len(session.tokens[0])}")
    for step in range(3):
        logits = session.decode(0, int(np.argmax(logits)))
        np.testing.assert_allclose(logits, mla_model.torch.logits(session.tokens[0])[-1], **mla_model.tolerance,
                                   err_msg=f"decode step {step}")


@pytest.mark.slow  # a library of its own
def test_without_q_lora_matches_torch(mla_model_without_q_lora):
    run_single(mla_model_without_q_lora.session(), PROMPT[:11], steps=5)


def test_generator_runs_the_bundle(mla_model):
    """Generator (the bundle's files, checked and loaded) answers one prompt and a batch with
    greedy tokens whose every logits row matches torch."""
    generator = Generator(mla_model.lib)
    # one-token prompts: a step of one token per sequence runs the decode functions
    for prompts in ([PROMPT], PROMPTS, [[7], [99]], [[42]]):
        result = generator.generate_tokens(prompts, max_new_tokens=5, keep_logits=True)
        for prompt, tokens, rows in zip(prompts, result.tokens, result.logits):
            assert len(tokens) == 5
            expected = mla_model.torch.logits(prompt + tokens[:-1])[len(prompt) - 1:]
            np.testing.assert_allclose(rows, expected, **mla_model.tolerance)
            assert tokens == [int(np.argmax(row)) for row in rows]


# On CUDA, head dims the tensor-core prefill tiles (ragged 128 / 64, as in test_prefill_tc.py).
GPU_HF = {**HF, "qk_nope_head_dim": 64, "qk_rope_head_dim": 64, "v_head_dim": 64, "kv_lora_rank": 128}


@pytest.mark.gpu
def test_cuda_float16_matches_torch(tmp_path):
    from tir_kernels.support import resolve_target

    model = MLAModel(GPU_HF, tmp_path, seed=5, target=resolve_target("cuda"), dtype="float16")
    run_single(model.session(), PROMPT, steps=6)
    run_batch(model.session(), PROMPTS, steps=4)
    result = Generator(model.lib).generate_tokens(PROMPTS, max_new_tokens=4, keep_logits=True)
    for prompt, tokens, rows in zip(PROMPTS, result.tokens, result.logits):
        np.testing.assert_allclose(rows, model.torch.logits(prompt + tokens[:-1])[len(prompt) - 1:], **model.tolerance)


# ---------------------------------------------------------------- FP8 latent pages
# compile --kv-cache-dtype float8_e4m3fn: the cache stores each layer's latent row [c, k_pe] as
# FP8 codes, c at the layer's latent scale (kv_scales[layer, 0, 0]) and k_pe at its rope scale
# (kv_scales[layer, 1, 0]).

class TorchMLAOnFp8Pages(TorchDeepseekV2):
    """The torch model run as the library's cache runs teacher-forced steps: one prefill step
    (attention among the prompt's own rows, exact: no page is read), then one decode step per
    token, whose queries read every cached row (their own included) from FP8 pages: c and k_pe
    rounded to `fmt` at scales [layers, 2, 1] (None: no rounding). `exact[layer]` keeps the
    prompt's unrounded (c, k_pe), what calibration measures."""

    def __init__(self, hf: dict, weights: dict[str, np.ndarray], scales, fmt: str = "float8_e4m3fn"):
        super().__init__(hf, weights)
        self.scales, self.fmt = scales, fmt
        self.pages: dict[str, tuple] = {}
        self.exact: dict[int, tuple] = {}
        self.decoding = False

    def _round(self, x, layer: int, part: int):
        if self.scales is None:
            return x
        from fp8_reference import dequantize, quantize

        scale = self.scales[layer, part, 0]
        return torch.tensor(dequantize(quantize(x.numpy(), scale, self.fmt), scale))

    def _attention(self, x, p, positions):
        layer = int(p.split(".")[2])
        q_nope, q_pe, c, k_pe = self._project(x, p, positions)
        stored = (self._round(c, layer, 0), self._round(k_pe, layer, 1))
        if not self.decoding:
            self.pages[p], self.exact[layer] = stored, (c, k_pe)
            causal = torch.ones(x.shape[0], x.shape[0], dtype=torch.bool).tril()
            return self._attend(p, q_nope, q_pe, c, k_pe, causal)
        cached_c, cached_pe = (torch.cat(pair) for pair in zip(self.pages[p], stored))
        self.pages[p] = (cached_c, cached_pe)
        n, m = x.shape[0], cached_c.shape[0]
        mask = torch.ones(n, m, dtype=torch.bool).tril(m - n)
        return self._attend(p, q_nope, q_pe, cached_c, cached_pe, mask)

    def forced_logits(self, prompt: list[int], continuation: list[int]) -> np.ndarray:
        """[len(continuation) + 1, vocab]: the prompt's last row, then each decode step's."""
        self.pages, self.decoding = {}, False
        rows = [self.logits(prompt)[-1]]
        self.decoding = True
        for i, token in enumerate(continuation):
            rows.append(self.logits([token], start=len(prompt) + i)[-1])
        return np.stack(rows)


@pytest.fixture(scope="module")
def mla_fp8_model(tmp_path_factory) -> MLAModel:
    """The library of mla_model (the same seed: the same weights) with FP8 (e4m3) latent pages."""
    return MLAModel(HF, tmp_path_factory.mktemp("mla-fp8"), seed=5, kv_cache_dtype="float8_e4m3fn")


CONTINUATION = [21, 8, 44, 13, 30, 101]


def rel_error(a, b) -> np.ndarray:
    return np.linalg.norm(a - b, axis=1) / np.linalg.norm(b, axis=1)


def mla_scales(model: MLAModel, value) -> np.ndarray:
    return np.full((model.metadata["kv_cache"]["num_layers"], 2, 1), value, np.float32)


@pytest.mark.parametrize("calibrated", [False, True], ids=["scale-1", "calibrated"])
def test_fp8_latent_pages_hold_what_the_library_reads(mla_model, mla_fp8_model, calibrated):
    """Teacher-forced logits of the FP8 MLA library equal the float64 torch model's whose cached
    latent rows are rounded to e4m3 at the same scales (relative error < 1e-4, float32 kernels),
    and differ from the float32-KV library's by FP8's rounding (above 1e-4, below 10%); the
    prefill step, which reads no page, equals the float32-KV library's."""
    from fp8_accuracy import forced_logits

    from tvmattn.calibrate import calibrate_kv_scales

    reference, fp8 = Generator(mla_model.lib), Generator(mla_fp8_model.lib)
    assert fp8.metadata["kv_cache"]["kv_dtype"] == "float8_e4m3fn" and fp8.metadata["kv_cache"]["attention"] == "mla"
    scales = calibrate_kv_scales(reference, [PROMPT]) if calibrated else mla_scales(mla_fp8_model, 1.0)
    fp8.kv_scales = scales if calibrated else None
    got = forced_logits(fp8, PROMPT, CONTINUATION).astype(np.float64)
    f32 = forced_logits(reference, PROMPT, CONTINUATION).astype(np.float64)
    assert fp8.session.cache is not None and fp8.session.cache.options.kv_dtype == "float8_e4m3fn"
    simulated = TorchMLAOnFp8Pages(HF, mla_fp8_model.torch_weights, scales).forced_logits(PROMPT, CONTINUATION)
    exact = TorchMLAOnFp8Pages(HF, mla_fp8_model.torch_weights, None).forced_logits(PROMPT, CONTINUATION)
    assert rel_error(got, simulated).max() < 1e-4, rel_error(got, simulated)
    assert rel_error(f32, exact).max() < 1e-4, rel_error(f32, exact)
    to_f32 = rel_error(got, f32)
    assert to_f32[0] < 1e-5 and (to_f32[1:] > 1e-4).all() and (to_f32[1:] < 0.1).all(), to_f32


def test_fp8_mla_library_generates_the_float32_tokens(mla_model, mla_fp8_model):
    """Greedy tokens of a few steps, teacher-forced (both libraries fed the float32-KV library's
    tokens): the FP8 library's argmax is the float32-KV library's on at least 80% of positions,
    and where not, the float32 logits of the two tokens are within 5% of the row's logit range
    of each other (a near tie of this random-weight model, not a wrong cache)."""
    from fp8_accuracy import forced_logits

    reference, fp8 = Generator(mla_model.lib), Generator(mla_fp8_model.lib)
    same = total = 0
    for prompt in (PROMPT, *PROMPTS):
        tokens = reference.generate_tokens([prompt], max_new_tokens=6).tokens[0]
        f32 = forced_logits(reference, prompt, tokens[:-1])
        assert list(f32.argmax(axis=1)) == tokens
        got = forced_logits(fp8, prompt, tokens[:-1])
        for row, token in enumerate(tokens):
            chosen = int(got[row].argmax())
            same, total = same + (chosen == token), total + 1
            if chosen != token:
                gap, spread = f32[row, token] - f32[row, chosen], np.ptp(f32[row])
                assert gap < 0.05 * spread, (prompt, row, gap, spread)
    assert same >= 0.8 * total, f"{same} of {total} tokens equal"


def test_mla_scales_are_the_latent_and_rope_amax(mla_model, mla_fp8_model):
    """calibrate_kv_scales on an MLA library: [layers, 2, 1], the amax of the prompt's normed
    latent c (index 0) and rotated k_pe (index 1) per layer over 448 (the torch model's, float64);
    on the FP8 library (its own rounded rows) within e4m3's rounding of those; percentile 50
    maps the columns' median |value| instead."""
    from tvmattn.calibrate import calibrate_kv_scales

    torch_model = TorchMLAOnFp8Pages(HF, mla_model.torch_weights, None)
    torch_model.forced_logits(PROMPT, [])
    expected = np.array([[[float(part.abs().max()) / 448.0] for part in torch_model.exact[layer]]
                         for layer in range(HF["num_hidden_layers"])])
    exact = calibrate_kv_scales(Generator(mla_model.lib), [PROMPT])
    assert exact.shape == (HF["num_hidden_layers"], 2, 1) and exact.dtype == np.float32
    np.testing.assert_allclose(exact, expected, rtol=1e-5, atol=0)
    assert not np.allclose(exact[:, 0], exact[:, 1], rtol=0.05), "the latent and rope scales are measured apart"
    headroom = calibrate_kv_scales(Generator(mla_model.lib), [PROMPT, PROMPTS[1]], headroom=2.0)
    assert (headroom >= 2 * exact * (1 - 1e-6)).all()
    median = calibrate_kv_scales(Generator(mla_model.lib), [PROMPT], percentile=50.0)
    columns = [np.abs(part.numpy()).ravel() for layer in range(HF["num_hidden_layers"])
               for part in torch_model.exact[layer]]
    np.testing.assert_allclose(median.ravel(), [np.percentile(c, 50.0) / 448.0 for c in columns], rtol=1e-5)
    rounded = calibrate_kv_scales(Generator(mla_fp8_model.lib), [PROMPT])
    assert np.allclose(rounded, exact, rtol=1 / 8, atol=0), rounded / exact


def test_fp8_mla_library_refuses_bad_scale_shapes(mla_fp8_model, tmp_path, capsys):
    """Scales of another shape ([layers, 2, kv_heads] as an MHA cache's, [layers, 2], a layer too
    many): refused naming the argument (the file, --kv-scales, kv_scales), the cache's scales
    unchanged; a file of [layers, 2, 1] is read and given to the generator."""
    from test_cli import one_error

    from tvmattn.__main__ import _apply_kv_scales, main
    from tvmattn.calibrate import load_library_kv_scales, save_kv_scales
    from tvmattn.runtime import KVCacheError

    generator = Generator(mla_fp8_model.lib)
    spec = generator.metadata["kv_cache"]
    layers = spec["num_layers"]
    good = tmp_path / "good.npy"
    save_kv_scales(good, mla_scales(mla_fp8_model, 0.01))
    assert np.array_equal(load_library_kv_scales(good, spec), mla_scales(mla_fp8_model, 0.01))
    bad = tmp_path / "bad.json"
    save_kv_scales(bad, np.ones((layers, 2, 4), np.float32))
    with pytest.raises(ValueError) as err:
        load_library_kv_scales(bad, spec)
    assert str(bad) in str(err.value) and f"[layers, 2, 1] (latent, rope) = [{layers}, 2, 1]" in str(err.value)
    assert main(["generate", "--lib", str(mla_fp8_model.lib), "--prompt", "hi", "--no-chat",
                 "--kv-scales", str(bad)]) == 2
    one_error(capsys.readouterr().err, "--kv-scales: kv scales file", str(bad), "[layers, 2, 1] (latent, rope)")
    # a random-weight bundle has no tokenizer, so `generate` cannot go on to the prompt: its
    # scales step is run alone
    assert _apply_kv_scales(generator, argparse.Namespace(kv_scales=str(good), calibrate_kv_scales=False)) is None
    assert np.array_equal(generator.kv_scales, mla_scales(mla_fp8_model, 0.01))
    generator.session.kv_scales = mla_scales(mla_fp8_model, 0.5)
    generator.session.create_cache(1, 32)
    cache = generator.session.cache
    for scales in (np.ones((layers, 2, 4)), np.ones((layers, 2)), np.ones((layers + 1, 2, 1))):
        with pytest.raises(KVCacheError, match=r"kv_scales must broadcast to \[num_layers, 2, 1\] \(latent, rope\)"):
            cache.set_kv_scales(scales)
        assert np.array_equal(cache._kv_scales, mla_scales(mla_fp8_model, 0.5))


@pytest.mark.parametrize("kv_dtype", ["", "float8_e4m3fn", "float8_e5m2"])
def test_mla_cache_spec_takes_the_kv_dtype(kv_dtype):
    """BuildOptions.kv_dtype reaches the MLA cache spec, its latent kernels' config and the
    metadata record; the self attention among new tokens (no pages) keeps the dtype."""
    from tvmattn.models.architectures import cache_spec
    from tvmattn.models.export import BuildOptions

    spec = cache_spec(model_config_from_hf(HF), BuildOptions(kv_dtype=kv_dtype))
    assert spec.kv_dtype == kv_dtype and spec.mla_config().kv_dtype == kv_dtype
    assert spec.to_dict()["kv_dtype"] == kv_dtype and spec.to_dict()["attention"] == "mla"
    assert spec.self_attention_config().kv_dtype == ""


@pytest.mark.gpu
def test_cuda_fp8_latent_pages_match_the_rounded_torch_model(tmp_path):
    """fp16 on CUDA with FP8 latent pages: teacher-forced logits against the float64 torch model
    whose cached rows are rounded to e4m3 at calibrated scales (fp16's tolerance)."""
    from fp8_accuracy import forced_logits
    from tir_kernels.support import resolve_target

    from tvmattn.calibrate import calibrate_kv_scales

    target = resolve_target("cuda")
    fp16 = MLAModel(GPU_HF, tmp_path / "fp16", seed=5, target=target, dtype="float16")
    fp8 = MLAModel(GPU_HF, tmp_path / "fp8", seed=5, target=target, dtype="float16", kv_cache_dtype="float8_e4m3fn")
    scales = calibrate_kv_scales(Generator(fp16.lib), [PROMPT], headroom=2.0)
    generator = Generator(fp8.lib)
    generator.kv_scales = scales
    got = forced_logits(generator, PROMPT, CONTINUATION).astype(np.float64)
    simulated = TorchMLAOnFp8Pages(GPU_HF, fp8.torch_weights, scales).forced_logits(PROMPT, CONTINUATION)
    assert rel_error(got, simulated).max() < 2e-2, rel_error(got, simulated)
