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
