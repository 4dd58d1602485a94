"""Specification of random block weights (tvmattn/weights/random_blocks.py) and of
`compile_model(..., random_weights=SEED, random_format=TYPE)`.

- `random_block_tensors(config, type, seed)` holds exactly the tensors the config calls for
  (`expected_shapes`), every matrix a QuantizedTensor of `type`, every vector float32; one seed
  gives the same tensors, another seed others.
- Dequantized, a matrix's values have a standard deviation near 1 / sqrt(in_features) (1 for the
  token embedding) and a mean near 0 (measured in float64 from the blocks' own formula).
- Bad types and shapes are ValueErrors naming them; compile_model refuses a random_format that
  is unknown or comes without random_weights before it loads anything.
- A kept library and a float one built from one seed and format hold the same weights: the
  float one's parameters are the kept one's blocks dequantized (the compile itself stubbed).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tvmattn.weights import QuantizedTensor, expected_shapes
from tvmattn.weights.random_blocks import RANDOM_BLOCK_TYPES, random_block_matrix, random_block_tensors

CONFIG = {  # Llama-3.2-1B's family, scaled down: tied embeddings, Llama-3 RoPE scaling
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 32, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 64},
    "vocab_size": 512, "max_position_embeddings": 256, "tie_word_embeddings": True, "attention_bias": False,
}


def reference_values(matrix: QuantizedTensor) -> np.ndarray:
    """float64 values of a Q4_0 / Q4_1 / Q8_0 matrix from the block formulas (GGML's)."""
    rows, cols = matrix.shape
    d = matrix.parts["d"].astype(np.float64).repeat(32, axis=1)
    qs = matrix.parts["qs"]
    if matrix.type_name == "Q8_0":
        return d * qs.astype(np.float64)
    blocks = qs.reshape(rows, cols // 32, 16)
    q = np.concatenate([blocks & 15, blocks >> 4], axis=2).reshape(rows, cols).astype(np.float64)
    if matrix.type_name == "Q4_0":
        return d * (q - 8)
    return d * q + matrix.parts["m"].astype(np.float64).repeat(32, axis=1)


@pytest.mark.parametrize("type_name", sorted(RANDOM_BLOCK_TYPES))
@pytest.mark.parametrize("std", [1.0, 2048 ** -0.5])
def test_matrix_values_have_the_asked_spread(type_name, std):
    matrix = random_block_matrix(256, 1024, type_name, std, np.random.default_rng(1))
    assert matrix.type_name == type_name and matrix.shape == (256, 1024)
    values = reference_values(matrix)
    np.testing.assert_allclose(matrix.dequantize(), values, rtol=1e-6, atol=1e-7)
    assert abs(values.std() / std - 1) < 0.1
    assert abs(values.mean()) < 0.05 * std
    if type_name == "Q8_0":
        assert matrix.parts["qs"].min() >= -127  # GGML's quantizer never writes -128


@pytest.mark.parametrize("type_name", sorted(RANDOM_BLOCK_TYPES))
def test_tensors_are_the_configs(type_name):
    tensors = random_block_tensors(CONFIG, type_name, seed=3)
    required, _ = expected_shapes(CONFIG)
    assert set(tensors) == set(required)
    for name, shape in required.items():
        value = tensors[name]
        if len(shape) == 2:
            assert isinstance(value, QuantizedTensor) and value.type_name == type_name and value.shape == shape
        else:
            assert isinstance(value, np.ndarray) and value.dtype == np.float32 and value.shape == shape
            assert abs(float(value.mean()) - 1) < 0.1
    embed = reference_values(tensors["model.embed_tokens.weight"])
    down = reference_values(tensors["model.layers.1.mlp.down_proj.weight"])
    assert abs(embed.std() - 1) < 0.1
    assert abs(down.std() * np.sqrt(CONFIG["intermediate_size"]) - 1) < 0.1


def test_seed_decides_the_values():
    a, b, c = (random_block_tensors(CONFIG, "Q4_1", seed) for seed in (5, 5, 6))
    name = "model.layers.0.self_attn.q_proj.weight"
    for part in ("qs", "d", "m"):
        np.testing.assert_array_equal(a[name].parts[part], b[name].parts[part])
    assert not np.array_equal(a[name].parts["qs"], c[name].parts["qs"])


@pytest.mark.parametrize("call, message", [
    (lambda: random_block_tensors(CONFIG, "Q4_K"), r"type_name='Q4_K': expected one of"),
    (lambda: random_block_matrix(4, 48, "Q4_0", 1.0, np.random.default_rng(0)), r"cols=48: must be a multiple of 32"),
    (lambda: random_block_tensors({**CONFIG, "hidden_size": 120, "head_dim": 30}, "Q8_0"),
     r"model.embed_tokens.weight: 120 columns, not a multiple of the Q8_0 block"),
])
def test_bad_arguments_are_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("kwargs, message", [
    (dict(random_weights=0, random_format="Q5_0"), r"--random-format 'Q5_0' is not supported: expected one of"),
    (dict(random_format="Q4_0"), r"--random-format Q4_0 needs --random-weights SEED"),
])
def test_compile_refuses_bad_random_formats(tmp_path, kwargs, message):
    from tvmattn.build import BuildError, compile_model

    config = tmp_path / "config.json"
    config.write_text(json.dumps(CONFIG))
    with pytest.raises(BuildError, match=message):
        compile_model(str(config), tmp_path / "out.so", target="llvm", log=lambda m: None, **kwargs)
    assert not (tmp_path / "out.so").exists()


def test_kept_and_float_libraries_share_the_weights(tmp_path, monkeypatch):
    """compile_model of one seed and format, kept and dequantized (the compile and the write
    stubbed: the parameters are what is checked): the kept library holds the blocks, the float
    one their values."""
    import tvmattn.build as build
    import tvmattn.models as models

    config = tmp_path / "config.json"
    config.write_text(json.dumps(CONFIG))
    written = {}

    def write_bundle(out_path, executable, params, document, *args):
        written[out_path.stem] = {p["name"]: value for p, value in zip(document["params"], params)}
        return out_path, None, out_path

    monkeypatch.setattr(models, "compile_module", lambda mod, options: None)
    monkeypatch.setattr(build, "write_bundle", write_bundle)
    for quantization in ("keep", "f32"):
        build.compile_model(str(config), tmp_path / f"{quantization}.so", target="llvm", quantization=quantization,
                            random_weights=7, random_format="Q4_0", max_batch_size=2, context_window=128,
                            prefill_chunk=32, log=lambda m: None)
    tensors = random_block_tensors(CONFIG, "Q4_0", seed=7)
    kept, floats = written["keep"], written["f32"]
    for name in ("model.embed_tokens", "model.layers.1.mlp.down_proj", "model.layers.0.self_attn.o_proj"):
        for part in ("qs", "d"):
            np.testing.assert_array_equal(kept[f"{name}.weight_{part}"], tensors[f"{name}.weight"].parts[part])
    np.testing.assert_array_equal(floats["model.layers.1.mlp.down_proj.weight"],
                                  reference_values(tensors["model.layers.1.mlp.down_proj.weight"]).astype(np.float32))
    np.testing.assert_array_equal(floats["model.norm.weight"], tensors["model.norm.weight"])
