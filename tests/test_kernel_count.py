"""scripts/kernel_count.py and tvmattn.compiler.kernel_count: the launches of a decode step per
layer, against a hand count of the tiny model's graph.

Hand count of one Llama layer in a decode step (tvmattn's cache, which appends with
split_rotary_append and decodes with one paged kernel):
- plain ops: RMSNorm, qkv projection, [append, attention], o_proj + residual (FuseOps puts the
  add into the matmul), RMSNorm, gate_up projection, SiLU * mul, down_proj + residual:
  4 projections, 2 norms, 1 elementwise, 1 append, 1 attention = 9;
- fused (compiler.fused_decode): norm + qkv, [append, attention], o_proj + residual,
  norm + gate_up + SiLU * mul, down_proj + residual: 4 projections + 2 = 6 (CUDA: in `decode`
  only, unless BuildOptions.fused_batch_layers; else the batched steps' gate_up takes SiLU * mul
  on tensor cores, fused_decode.matmul_swiglu: 8, the plain count less the elementwise kernel);
- kept-quantized weights on CUDA (quant.linear: norm, SwiGLU and residual inside the GEMV in
  `decode`; a decode batch keeps the norms and the gate apart): 6 in decode, 9 in batch_decode;
- CUDA libraries whose attention takes the tensor-core decode (GQA groups of 3 and more, fp16):
  the append inside the decode kernel (decode_append), one kernel fewer: 5 in decode.
After the layers: the final norm and the (tied) LM head; decode_step also embeds first (1).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import kernel_count  # noqa: E402

from tvmattn.compiler.kernel_count import count_step, step_launches  # noqa: E402

TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128, "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0, "tie_word_embeddings": True, "attention_bias": False}
_MODULES: dict = {}


def lowered(target: str, fused: bool = True, quantization: str = "none"):
    """The tiny model's lowered module, built once per module run (each build takes seconds)."""
    key = (target, fused, quantization)
    if key not in _MODULES:
        extra = dict(fused_batch_layers=fused) if target == "cuda-fused-batch" else {}
        _MODULES[key] = kernel_count.lowered_module(TINY, target.replace("-fused-batch", ""), quantization, "Q4_1",
                                                    fused=fused, **extra)[0]
    return _MODULES[key]


PLAIN = {"projection": 4, "norm": 2, "elementwise": 1, "cache append": 1, "attention": 1}
FUSED = {"projection": 4, "cache append": 1, "attention": 1}
BATCHED_SWIGLU = {"projection": 4, "norm": 2, "cache append": 1, "attention": 1}


@pytest.mark.parametrize("target", ["llvm", "cuda", "cuda-fused-batch"])
@pytest.mark.parametrize("fused, per_layer", [(False, PLAIN), (True, FUSED)], ids=["plain", "fused"])
def test_float_library_counts_match_the_hand_count(target, fused, per_layer):
    """CUDA libraries fuse in `decode` only (fused_decode's single_row_only), and in the batched
    steps take gate_up with SiLU * mul as one op (batched_swiglu), unless built with
    fused_batch_layers ("cuda-fused-batch": the fused ops on tensor cores from batch 16 on)."""
    mod = lowered(target, fused)
    for function, before in (("decode", 0), ("batch_decode", 0), ("decode_step", 1)):
        counts = count_step(mod, function)
        expected = per_layer
        if target == "cuda" and function != "decode":
            expected = BATCHED_SWIGLU if fused else PLAIN
        assert sorted(counts.per_layer) == [0, 1], function
        assert counts.uniform_layer() == expected, function
        assert sum(counts.embed.values()) == before, function
        assert counts.head.get("projection") == 1 and sum(counts.head.values()) == 2, (function, counts.head)
        assert counts.total == before + 2 * sum(expected.values()) + 2


def without_append(counts: dict) -> dict:
    return {kind: n for kind, n in counts.items() if kind != "cache append"}


def test_decode_append_library_counts():
    """A group-4 model on CUDA: the library carries decode_append, and every step's attention
    call is one launch."""
    mod = kernel_count.lowered_module({**TINY, "hidden_size": 128, "num_attention_heads": 4,
                                       "num_key_value_heads": 1}, "cuda", "none", "Q4_1", fused=True)[0]
    assert count_step(mod, "decode").uniform_layer() == without_append(FUSED)
    assert count_step(mod, "batch_decode").uniform_layer() == without_append(BATCHED_SWIGLU)
    layer = [launch.name for launch in step_launches(mod, "decode") if launch.segment == 0]
    assert "decode_append" in layer and "split_rotary_append" not in layer
    separate = kernel_count.lowered_module({**TINY, "hidden_size": 128, "num_attention_heads": 4,
                                            "num_key_value_heads": 1}, "cuda", "none", "Q4_1", fused=True,
                                           decode_append=False)[0]  # (compile --no-decode-append)
    assert count_step(separate, "decode").uniform_layer() == FUSED


def test_layer_launches_in_order():
    mod = lowered("llvm")
    layer = [(launch.kind, launch.segment) for launch in step_launches(mod, "decode") if launch.segment == 1]
    assert [kind for kind, _ in layer] == ["projection", "cache append", "attention", "projection", "projection",
                                           "projection"]


def test_kept_quantized_cuda_counts():
    mod = lowered("cuda", quantization="keep")
    assert count_step(mod, "decode").uniform_layer() == FUSED  # norm, gate and residual in the GEMV
    assert count_step(mod, "batch_decode").uniform_layer() == PLAIN


def test_command_line_prints_and_writes_the_counts(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    out = tmp_path / "counts.json"
    assert kernel_count.main(["--model", str(config), "--target", "llvm", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "decode: 6 per layer (projection 4, cache append 1, attention 1) x 2 layers" in printed
    document = json.loads(out.read_text())
    assert document["functions"]["batch_decode"]["layer_total"] == 6 and document["fused"] is True


def test_command_line_errors(tmp_path, capsys):
    assert kernel_count.main(["--model", str(tmp_path / "missing.json")]) == 2
    assert capsys.readouterr().err.startswith("error: --model")
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    assert kernel_count.main(["--model", str(config), "--functions", "prefill"]) == 2
    assert "error: --functions 'prefill'" in capsys.readouterr().err
