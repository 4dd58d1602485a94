"""scripts/tune_decode.py without a GPU: merging re-tuned table entries into a previous table."""

import json

import pytest
from harness import load_script


@pytest.fixture(scope="module")
def tune():
    return load_script("tune_decode")


def entry(batch, seq_len, schedule):
    return {"batch": batch, "seq_len": seq_len, "schedule": schedule, "gbps": 1.0, "best_gbps": 1.0, "best": schedule}


def bucket(group, shapes, dtype="float16"):
    return {"dtype": dtype, "head_dim": 128, "group": group, "page_size": 16, "shapes": shapes}


def test_merge_buckets_replaces_only_measured_shapes(tune):
    base = {"schedules": {"a": {"kind": "tensor-core", "warps": 4}, "b": {"kind": "tensor-core", "warps": 2},
                          "unused": {"kind": "tensor-core"}},
            "buckets": [bucket(8, [entry(1, 4096, "a"), entry(1, 32768, "a"), entry(64, 4096, "b")]),
                        bucket(4, [entry(1, 4096, "b")])]}
    new = [bucket(8, [entry(1, 32768, "c"), entry(1, 4096, "c")]), bucket(16, [entry(1, 4096, "c")])]
    out, kept = tune.merge_buckets(base, new)
    assert [(b["group"], [(e["batch"], e["seq_len"], e["schedule"]) for e in b["shapes"]]) for b in out] == [
        (8, [(1, 4096, "c"), (1, 32768, "c"), (64, 4096, "b")]),
        (4, [(1, 4096, "b")]),
        (16, [(1, 4096, "c")]),
    ]
    assert kept == {"b": base["schedules"]["b"]}  # "a" is no longer used; "c" comes from the candidates


def test_write_table_with_base_keeps_old_schedules(tune, tmp_path):
    from tir_kernels.schedules import TensorCoreDecodeSchedule, schedule_to_dict

    old = TensorCoreDecodeSchedule(warps=2)
    new = TensorCoreDecodeSchedule(fused_merge=True, cooperative_merge=True)
    base = {"schedules": {old.label: schedule_to_dict(old)},
            "buckets": [bucket(8, [entry(1, 4096, old.label), entry(64, 4096, old.label)])]}
    path = tmp_path / "table.json"
    meta = {"device": "NVIDIA H200", "date": "2026-01-01T00:00:00+00:00", "commit": "abc1234"}
    tune.write_table(str(path), [bucket(8, [entry(1, 4096, new.label)])], {new.label: new}, meta, "cmd", base)
    table = json.loads(path.read_text())
    assert table["schedules"] == {old.label: schedule_to_dict(old), new.label: schedule_to_dict(new)}
    assert [e["schedule"] for e in table["buckets"][0]["shapes"]] == [new.label, old.label]


def test_write_table_with_base_keeps_its_provenance(tune, tmp_path):
    """A partial re-tune keeps the base table's top-level device / command / date / commit (true
    of the buckets it did not measure); the buckets it measured carry the run's own."""
    from tir_kernels.schedules import TensorCoreDecodeSchedule, schedule_to_dict

    old, new = TensorCoreDecodeSchedule(warps=2), TensorCoreDecodeSchedule(keys_per_warp=32)
    first = {"device": "NVIDIA H200", "command": "first", "date": "2026-01-01T00:00:00+00:00", "commit": "aaa1111"}
    base = {"about": "a table", **first, "arch": "sm_90", "sms": 132, "schedules": {old.label: schedule_to_dict(old)},
            "buckets": [bucket(8, [entry(1, 4096, old.label)]), bucket(4, [entry(1, 4096, old.label)])]}
    path = tmp_path / "table.json"
    meta = {"device": "NVIDIA H100 80GB HBM3", "date": "2026-02-02T00:00:00+00:00", "commit": "bbb2222"}
    tune.write_table(str(path), [bucket(4, [entry(1, 512, new.label)])], {new.label: new}, meta, "second", base)
    table = json.loads(path.read_text())
    assert {k: table[k] for k in first} == first
    untouched, measured = table["buckets"]
    assert not set(tune.PROVENANCE) & set(untouched)
    assert {k: measured[k] for k in tune.PROVENANCE} == {**meta, "command": "second"}
    assert [(e["seq_len"], e["schedule"]) for e in measured["shapes"]] == [(512, new.label), (4096, old.label)]


def rope_row(label, group, batch, seq_len, gbps, dtype="float16", agrees=True):
    return {"impl": f"tvmattn-tc-{label}-rope", "variant": "rotary_mode=1", "dtype": dtype, "head_dim": 128,
            "num_qo_heads": 32, "num_kv_heads": 32 // group, "page_size": 16, "batch": batch, "seq_len": seq_len,
            "gbps": gbps, "agrees": agrees}


def test_choose_rope_table(tune):
    """--rope --table: each measured entry gets the rope rows' greedy choice (a second schedule
    only where it gains more than min_gain), none where that is the entry's default rope
    schedule; a candidate that would change the launch, or disagrees with SDPA, is not taken;
    the other dtype's bucket takes the choice through `also`; unmeasured entries are kept."""
    import dataclasses

    from tir_kernels.schedules import TensorCoreDecodeSchedule, schedule_to_dict

    plain = TensorCoreDecodeSchedule(stages=4, target_blocks=132, min_split_keys=128, threads_per_row=8,
                                     fused_merge=True, dependent_launch=True)
    big = TensorCoreDecodeSchedule(stages=3, target_blocks=264, min_split_keys=128)
    wide = dataclasses.replace(plain, stages=2, target_blocks=396)
    long = dataclasses.replace(plain, stages=3, target_blocks=264)
    eager = dataclasses.replace(wide, min_split_keys=64)
    no_pdl = dataclasses.replace(wide, dependent_launch=False)
    candidates = {s.label: s for s in (plain, wide, long, eager, no_pdl)}
    rows = [rope_row(plain.label, 4, 1, 4096, 1000), rope_row(plain.label, 4, 1, 32768, 3000),
            rope_row(wide.label, 4, 1, 4096, 1500), rope_row(wide.label, 4, 1, 32768, 2800),
            rope_row(long.label, 4, 1, 4096, 1400), rope_row(long.label, 4, 1, 32768, 3500),
            rope_row(eager.label, 4, 1, 4096, 1490), rope_row(eager.label, 4, 1, 32768, 2000),
            rope_row(no_pdl.label, 4, 1, 4096, 9000), rope_row(no_pdl.label, 4, 1, 32768, 9000),
            rope_row(eager.label, 4, 1, 4096, 9000, dtype="bfloat16", agrees=False)]
    shapes = [entry(1, 4096, plain.label), entry(1, 32768, plain.label), entry(64, 4096, big.label)]
    base = {"schedules": {plain.label: schedule_to_dict(plain), big.label: schedule_to_dict(big)},
            "buckets": [bucket(4, shapes), bucket(4, [dict(e) for e in shapes], dtype="bfloat16"),
                        bucket(8, [entry(1, 4096, plain.label)])]}
    table = tune.choose_rope_table(rows, base, 1.03, candidates, {"bfloat16": "float16"})
    for b in table["buckets"][:2]:  # long, then wide (+7% at 1x4096); no_pdl would change the launch
        assert [e.get("rope_schedule") for e in b["shapes"]] == [wide.label, long.label, None]
        assert [e.get("rope_gbps") for e in b["shapes"]] == [1500, 3500, None]
        assert b["shapes"][0]["rope_best"] == wide.label
    assert "rope_gbps" not in table["buckets"][2]["shapes"][0]  # group 8: not measured
    assert set(table["schedules"]) == {plain.label, big.label, wide.label, long.label}
    assert base["buckets"][0]["shapes"][0].get("rope_schedule") is None  # base untouched
    # a second schedule that gains less than min_gain (1.4%) is not taken
    close = [r if r["impl"] != f"tvmattn-tc-{wide.label}-rope" or r["seq_len"] != 4096 else {**r, "gbps": 1420}
             for r in rows if r["impl"] != f"tvmattn-tc-{eager.label}-rope"]
    table = tune.choose_rope_table(close, base, 1.03, candidates)
    assert [e.get("rope_schedule") for e in table["buckets"][0]["shapes"]] == [long.label, long.label, None]
    # the winner is the entry's own default rope schedule: no key
    only_plain = [r for r in rows if r["impl"] == f"tvmattn-tc-{plain.label}-rope"]
    table = tune.choose_rope_table(only_plain, base, 1.03, candidates)
    assert all("rope_schedule" not in e for b in table["buckets"] for e in b["shapes"])
    assert table["buckets"][0]["shapes"][0]["rope_gbps"] == 1000


@pytest.mark.parametrize("heads", [["--qo-heads", "9", "--kv-heads", "2"], ["--qo-heads", "32", "--kv-heads", "8", "3"],
                                   ["--qo-heads", "0", "--kv-heads", "1"]])
def test_kv_heads_must_divide_the_query_heads(tune, capsys, heads):
    """Refused before anything is built; the query heads the benchmark uses stay as they were."""
    before = tune.bk.NUM_QO_HEADS
    with pytest.raises(SystemExit) as exit_info:
        tune.main(heads)
    assert exit_info.value.code == 2
    assert "each must divide --qo-heads" in capsys.readouterr().err
    assert tune.bk.NUM_QO_HEADS == before
