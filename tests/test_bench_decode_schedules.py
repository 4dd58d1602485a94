"""scripts/bench_decode_schedules.py without a GPU: its --variant parsing, the table a variant's
library is built under, and that building under it picks the variant."""

from __future__ import annotations

import dataclasses

import pytest

from harness import load_script
from tir_kernels.config import AttentionConfig
from tir_kernels.decode import choose_decode_kernel
from tir_kernels.schedules import choose_decode_variant, decode_table_bucket, load_decode_table, use_decode_table

SMOLLM2 = AttentionConfig(9, 3, 64, dtype="float16", target="cuda:sm_90")
LLAMA_1B = AttentionConfig(32, 8, 64, dtype="float16", target="cuda:sm_90")


@pytest.fixture(scope="module")
def script():
    return load_script("bench_decode_schedules")


def test_variant_fields_parse_as_the_schedule_types(script):
    assert script.parse_variant("stages=3") == {"stages": 3}
    assert script.parse_variant("min_split_keys=64, cooperative_merge=True") == {
        "min_split_keys": 64, "cooperative_merge": True}


@pytest.mark.parametrize("spec, words", [
    ("stage=3", "field=value pairs"),
    ("stages", "field=value pairs"),
    ("stages=three", "stages is an integer"),
    ("fused_merge=yes", "fused_merge is true or false"),
])
def test_bad_variants_name_the_argument(script, spec, words):
    with pytest.raises(ValueError, match="--variant") as err:
        script.parse_variant(spec)
    assert words in str(err.value)


@pytest.mark.parametrize("argv, words", [
    (["--batches", "1"], "--variant: give at least one"),
    (["--variant", "stages=x"], "stages is an integer"),
    (["--variant", "stages=3", "--batches", "1,a"], "--batches: expected comma-separated batch sizes"),
    (["--variant", "stages=3", "--rounds", "0"], "expected positive integers"),
])
def test_bad_command_lines_name_the_argument(script, capsys, argv, words):
    with pytest.raises(SystemExit):
        script.parse_args(argv)
    assert words in capsys.readouterr().err


def test_command_line_defaults(script):
    args = script.parse_args(["--variant", "stages=3", "--variant", "min_split_keys=64"])
    assert args.changes == [{"stages": 3}, {"min_split_keys": 64}]
    assert args.batch_sizes == [1, 16, 64] and args.rounds == 3


@pytest.mark.parametrize("config", [SMOLLM2, LLAMA_1B], ids=["smollm2", "llama-1b"])
def test_a_variant_table_makes_the_library_build_the_variant(script, config):
    table = load_decode_table()
    library = choose_decode_variant(config, table=table)
    changed, sched = script.variant_table(table, config, {"stages": 3, "min_split_keys": 64})
    assert sched == dataclasses.replace(library, stages=3, min_split_keys=64)
    assert {shape["schedule"] for shape in decode_table_bucket(config, changed)["shapes"]} == {sched.label}
    assert choose_decode_variant(config, table=table) == library  # the file's table is untouched
    with use_decode_table(changed):
        assert choose_decode_kernel(config).schedule == sched
        for batch, seq_len in ((1, 512), (64, 4096)):
            assert choose_decode_variant(config, batch, seq_len) == sched
    assert choose_decode_kernel(config).schedule == library


def test_a_variant_that_does_not_fit_is_refused(script):
    with pytest.raises(ValueError, match="keys_per_warp"):
        script.variant_table(load_decode_table(), SMOLLM2, {"keys_per_warp": 8})


def test_a_variant_that_changes_nothing_is_timed_once(script, capsys):
    library = choose_decode_variant(LLAMA_1B, table=load_decode_table())
    plan = script.plan_libraries(load_decode_table(), LLAMA_1B, {
        f"stages={library.stages}": {"stages": library.stages}, "min_split_keys=64": {"min_split_keys": 64},
        "min_split_keys=64,stages=3": {"min_split_keys": 64, "stages": 3}})
    assert [sched for sched, _ in plan.values()] == [library, dataclasses.replace(library, min_split_keys=64)]
    assert plan["library"][1] is None
    assert "timed once" in capsys.readouterr().out


def test_library_files_name_what_they_were_built_for(script):
    """A library built for fewer sequences or a shorter context is never taken for a longer run."""
    context = script.context_tokens(32)
    assert context % 64 == 0 and context >= script.PROMPT_LEN + script.bench_e2e.WARMUP_STEPS + 32
    assert script.context_tokens(200) > context
    plan = script.plan_libraries(load_decode_table(), SMOLLM2, {"stages=3": {"stages": 3}})
    paths = script.library_paths("libs", "scripts/smollm2-config.json", plan, 64, context)
    label = plan["library"][0].label
    assert paths["library"] == f"libs/smollm2-config-b64-c{context}-{label}.so"
    assert len(set(paths.values())) == 2
    assert script.library_paths("libs", "scripts/smollm2-config.json", plan, 16, context) != paths


@pytest.mark.parametrize("model, config", [("scripts/smollm2-config.json", SMOLLM2),
                                           ("scripts/llama-3.2-1b-config.json", LLAMA_1B)])
def test_a_models_attention_config_comes_from_its_config_json(script, model, config):
    built = script.model_attention_config(model, "cuda:sm_90")
    assert (built.num_qo_heads, built.num_kv_heads, built.head_dim, built.dtype) == (
        config.num_qo_heads, config.num_kv_heads, config.head_dim, "float16")
