"""A model library compiled with --kv-cache-dtype float8_e4m3fn (the tiny random-weight Llama of
conftest's tiny_library): its decode logits (which read the FP8 pages) are those of an
independent float64 model whose K/V are rounded to FP8, near those of the float32-KV library
and not equal to them; it generates; FP8 scales come from a file
(`generate --kv-scales`, written by `calibrate-kv`) or from the prompt (`--calibrate-kv-scales`),
and a bad file or a library without FP8 pages is one `error:` line with exit status 2."""

import json

import numpy as np
import pytest
from harness import shared_folder
from test_cli import one_error

from tvmattn.__main__ import main
from tvmattn.calibrate import load_kv_scales, save_kv_scales

PROMPT = [5, 9, 17, 33, 2, 40, 41, 7, 11, 60, 3, 19]


@pytest.fixture(scope="module")
def fp8_library(tmp_path_factory, tiny_library):
    gguf, _ = tiny_library

    def fill(folder):
        from tvmattn.build import compile_model

        compile_model(str(gguf), folder / "tiny-fp8.so", target="llvm", max_batch_size=4, prefill_chunk=64,
                      kv_cache_dtype="float8_e4m3fn", log=lambda _message: None)

    return shared_folder(tmp_path_factory, "tiny-llama-fp8", fill) / "tiny-fp8.so"


CONTINUATION = [21, 8, 44, 13, 30]


def simulated(gguf, scales) -> np.ndarray:
    """float64 [len(CONTINUATION) + 1, vocab]: tests/fp8_simulation.py's float64 model of the same
    weights fed PROMPT (one prefill step: its own K/V exact) then CONTINUATION one decode step
    each (every key read back from FP8 pages at `scales`; None: no rounding)."""
    from fp8_simulation import SimLlama

    sim = SimLlama(gguf)
    exact_from = np.array([0] * len(PROMPT) + [len(PROMPT) + i + 1 for i in range(len(CONTINUATION))])
    logits = sim.logits(PROMPT + CONTINUATION, scales, "float8_e4m3fn", exact_from=exact_from)
    return logits[len(PROMPT) - 1:]


def rel_error(a, b) -> np.ndarray:
    return np.linalg.norm(a - b, axis=1) / np.linalg.norm(b, axis=1)


@pytest.mark.parametrize("calibrated", [False, True], ids=["scale-1", "calibrated"])
def test_an_fp8_library_computes_what_fp8_pages_hold(tiny_library, fp8_library, calibrated):
    """Teacher-forced logits (prefill, then decode steps) of the FP8 library equal the float64
    simulation's with K/V rounded to e4m3 at the same scales, and differ from the unquantized
    model's by FP8's error (which is large on this random-weight model: a few to 20 percent);
    the prefill step, which reads no page, equals the float32-KV library's."""
    from fp8_accuracy import forced_logits

    from tvmattn.calibrate import calibrate_kv_scales
    from tvmattn.generate import Generator

    gguf, f32_library = tiny_library
    reference, fp8 = Generator(f32_library), Generator(fp8_library)
    assert fp8.metadata["kv_cache"]["kv_dtype"] == "float8_e4m3fn"
    spec = fp8.metadata["kv_cache"]
    ones = np.ones((spec["num_layers"], 2, spec["num_kv_heads"]), np.float32)
    scales = calibrate_kv_scales(reference, [PROMPT]) if calibrated else ones
    fp8.kv_scales = scales if calibrated else None
    got = forced_logits(fp8, PROMPT, CONTINUATION).astype(np.float64)
    f32 = forced_logits(reference, PROMPT, CONTINUATION).astype(np.float64)
    assert rel_error(got, simulated(gguf, scales)).max() < 1e-4
    to_exact = rel_error(got, simulated(gguf, None))
    assert to_exact[0] < 1e-5 and rel_error(got[:1], f32[:1])[0] < 1e-5, to_exact
    assert (to_exact[1:] > 1e-3).all() and (rel_error(got, f32)[1:] < 0.5).all(), to_exact


def write_scales(path, value, shape):
    array = np.full(shape, value, np.float32)
    if path.suffix == ".json":
        path.write_text(json.dumps(array.tolist()))
    else:
        np.save(path, array)
    return path


def test_kv_scales_reach_the_cache(fp8_library, tmp_path):
    """Scales 2^-4 store K/V 16x larger codes: other values after rounding, so other logits."""
    from tvmattn.generate import Generator

    from fp8_accuracy import forced_logits

    generator = Generator(fp8_library)
    spec = generator.metadata["kv_cache"]
    shape = (spec["num_layers"], 2, spec["num_kv_heads"])
    base = forced_logits(generator, PROMPT, CONTINUATION)
    path = write_scales(tmp_path / "s.json", 2.0 ** -4, shape)
    generator.kv_scales = load_kv_scales(path, *shape[::2])
    scaled = forced_logits(generator, PROMPT, CONTINUATION)
    assert not np.allclose(base[1:], scaled[1:], rtol=0, atol=1e-6)
    assert np.allclose(base[0], scaled[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scales, fragment", [(np.ones((1, 2, 3, 4)), "kv_scales must broadcast to"),
                                              (-1.0, "kv_scales must be finite and positive")])
def test_bad_generator_kv_scales_are_refused_and_change_nothing(fp8_library, scales, fragment):
    from tvmattn.generate import GenerateError, Generator

    from fp8_accuracy import forced_logits

    generator = Generator(fp8_library)
    generator.kv_scales = 0.5
    before = forced_logits(generator, PROMPT, CONTINUATION)
    runner = generator.runner
    with pytest.raises(GenerateError, match=fragment):
        generator.kv_scales = scales
    assert generator.runner is runner and (generator.kv_scales == 0.5).all()
    np.testing.assert_array_equal(forced_logits(generator, PROMPT, CONTINUATION), before)


@pytest.mark.parametrize("suffix", [".npy", ".json"])
def test_kv_scales_files_round_trip(tmp_path, suffix):
    scales = np.random.default_rng(0).uniform(0.01, 2.0, (3, 2, 2)).astype(np.float32)
    save_kv_scales(tmp_path / f"s{suffix}", scales)
    assert np.array_equal(load_kv_scales(tmp_path / f"s{suffix}", 3, 2), scales)


@pytest.mark.parametrize("content, fragment", [
    ("[[[1.0, 1.0]]]", "expected numbers of shape [layers, 2, kv_heads] = [3, 2, 2], got float64 [1, 1, 2]"),
    (json.dumps(np.ones((3, 2, 2)).tolist())[:-3], "Expecting"),
    (json.dumps(np.full((3, 2, 2), -1.0).tolist()), "every scale must be finite and positive"),
    (json.dumps(np.full((3, 2, 2), "a").tolist()), "could not convert string to float"),
    ("missing", "No such file or directory"),
])
def test_a_bad_kv_scales_file_is_named(tmp_path, content, fragment):
    path = tmp_path / "s.json"
    if content != "missing":
        path.write_text(content)
    with pytest.raises(ValueError) as err:
        load_kv_scales(path, 3, 2)
    assert str(path) in str(err.value) and fragment in str(err.value), err.value


def test_generate_with_a_kv_scales_file_and_with_calibration(fp8_library, tmp_path, capsys):
    out = tmp_path / "scales.npy"
    assert main(["calibrate-kv", "--lib", str(fp8_library), "--prompt", "hello there", "--prompt", "a b c",
                 "--no-chat", "--headroom", "2", "-o", str(out)]) == 0
    from tvmattn.generate import Generator

    spec = Generator(fp8_library).metadata["kv_cache"]
    scales = np.load(out)
    assert scales.shape == (spec["num_layers"], 2, spec["num_kv_heads"]) and (scales > 0).all()
    capsys.readouterr()
    assert main(["generate", "--lib", str(fp8_library), "--prompt", "hello", "--no-chat", "--max-new-tokens", "4",
                 "--kv-scales", str(out)]) == 0
    assert main(["generate", "--lib", str(fp8_library), "--prompt", "hello", "--no-chat", "--max-new-tokens", "4",
                 "--calibrate-kv-scales"]) == 0


def test_calibrating_an_fp8_library_matches_its_float32_twin(tiny_library, fp8_library):
    """On FP8 pages amax is that of the rounded K/V: within e4m3's rounding of the exact amax."""
    from tvmattn.calibrate import calibrate_kv_scales
    from tvmattn.generate import Generator

    exact = calibrate_kv_scales(Generator(tiny_library[1]), [PROMPT])
    rounded = calibrate_kv_scales(Generator(fp8_library), [PROMPT])
    assert np.allclose(rounded, exact, rtol=1 / 8, atol=0), (rounded / exact)


@pytest.mark.parametrize("make, fragment", [
    (lambda d, shape: write_scales(d / "s.json", 1.0, (shape[0], 2, shape[2] + 1)), "expected numbers of shape"),
    (lambda d, shape: write_scales(d / "s.npy", 0.0, shape), "every scale must be finite and positive"),
])
def test_generate_refuses_a_bad_kv_scales_file(fp8_library, tmp_path, capsys, make, fragment):
    from tvmattn.generate import Generator

    spec = Generator(fp8_library).metadata["kv_cache"]
    path = make(tmp_path, (spec["num_layers"], 2, spec["num_kv_heads"]))
    assert main(["generate", "--lib", str(fp8_library), "--prompt", "hi", "--kv-scales", str(path)]) == 2
    one_error(capsys.readouterr().err, "--kv-scales: kv scales file", str(path), fragment)


def test_kv_scales_need_an_fp8_library(tiny_library, tmp_path, capsys):
    path = write_scales(tmp_path / "s.npy", 1.0, (2, 2, 2))
    for option in (["--kv-scales", str(path)], ["--calibrate-kv-scales"]):
        assert main(["generate", "--lib", str(tiny_library[1]), "--prompt", "hi", *option]) == 2
        one_error(capsys.readouterr().err, f"{option[0]}: the library's KV cache holds float32 K/V, not FP8")


@pytest.mark.parametrize("argv, fragment", [
    (["--kv-scales", "scales.txt"], "is not a .npy or .json file"),
    (["--kv-scales", "nowhere.npy"], "does not exist"),
    (["--kv-scales", "EXISTING", "--calibrate-kv-scales"], "not allowed with argument"),
])
def test_kv_scales_options_are_checked_while_parsing(tiny_library, tmp_path, argv, fragment, capsys):
    existing = write_scales(tmp_path / "s.npy", 1.0, (2, 2, 2))
    argv = [str(existing) if a == "EXISTING" else a for a in argv]
    with pytest.raises(SystemExit) as done:
        main(["generate", "--lib", str(tiny_library[1]), "--prompt", "hi", *argv])
    assert done.value.code == 2
    one_error(capsys.readouterr().err, fragment)


def test_calibration_options(tiny_library):
    """headroom multiplies the amax scales; a percentile below 100 gives smaller ones; bad values
    are refused naming the argument."""
    from tvmattn.calibrate import calibrate_kv_scales
    from tvmattn.generate import Generator

    generator = Generator(tiny_library[1])
    amax = calibrate_kv_scales(generator, [PROMPT])
    assert np.allclose(calibrate_kv_scales(generator, [PROMPT], headroom=4.0), 4 * amax, rtol=1e-6, atol=0)
    median = calibrate_kv_scales(generator, [PROMPT], percentile=50.0)
    assert (median < amax).all() and (median > 0).all()
    for keywords, name in (({"percentile": 0.0}, "percentile"), ({"percentile": 101}, "percentile"),
                           ({"headroom": 0.5}, "headroom"), ({"headroom": float("inf")}, "headroom"),
                           ({"kv_dtype": "float16"}, "kv_dtype")):
        with pytest.raises(ValueError, match=name):
            calibrate_kv_scales(generator, [PROMPT], **keywords)


def test_kv_scales_shape_of_mha_and_mla_libraries(tmp_path):
    """A library's scales are [layers, 2, kv_heads], an MLA library's [layers, 2, 1] (latent,
    rope): load_library_kv_scales reads a file of that shape and names the file and the shape
    it expected otherwise; load_kv_scales(mla=True) takes only num_kv_heads 1."""
    from tvmattn.calibrate import kv_scales_shape, load_library_kv_scales

    mha = {"num_layers": 3, "num_kv_heads": 2}
    mla = {"attention": "mla", "num_layers": 3, "latent_dim": 64, "rope_dim": 16}
    assert kv_scales_shape(mha) == (3, 2, 2) and kv_scales_shape(mla) == (3, 2, 1)
    path = write_scales(tmp_path / "s.npy", 0.5, (3, 2, 2))
    assert np.array_equal(load_library_kv_scales(path, mha), np.full((3, 2, 2), 0.5, np.float32))
    with pytest.raises(ValueError) as err:
        load_library_kv_scales(path, mla)
    assert str(path) in str(err.value) and "[layers, 2, 1] (latent, rope) = [3, 2, 1], got float32 [3, 2, 2]" in str(
        err.value), err.value
    with pytest.raises(ValueError, match="num_kv_heads"):
        load_kv_scales(path, 3, 2, mla=True)
