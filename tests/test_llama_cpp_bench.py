"""llama.cpp as the benchmark baseline (pagedllm/benchmarks/llama_cpp.py): the commands it assembles, the
parsing of llama-bench's JSON report, the build cache, and `bench latency --compare llama.cpp` end to end
with a stand-in llama-bench that prints a recorded report. Nothing here builds llama.cpp; the tests that
need the real binary skip where it is not built. No timing is asserted."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from pagedllm.benchmarks import llama_cpp
from tests.gguf_models import write_gguf

# llama-bench -m SmolLM2-135M-Instruct.Q4_1.gguf -t 2 -p 8 -n 4 -r 2 -o json, recorded from the build of
# llama-cpp-python 0.3.36 (its vendored llama.cpp) on a loaded machine: only the shape matters here
RECORDED_JSON = Path(__file__).with_name("llama_bench_sample.json")


def _fake_build(root: Path, report: str, calls_log: Path) -> llama_cpp.LlamaCppBuild:
    """A build directory whose llama-bench prints `report` and appends its arguments to `calls_log`."""
    build = llama_cpp.build_paths(root=root)
    (build.build_dir / "bin").mkdir(parents=True)
    report_file = root / "report.json"
    report_file.write_text(report)
    for name in llama_cpp.BINARIES:
        script = build.binary(name)
        script.write_text(f'#!/bin/sh\necho "$@" >> {calls_log}\ncat {report_file}\n')
        script.chmod(script.stat().st_mode | stat.S_IXUSR)
    build.stamp.write_text(" ".join(llama_cpp.cmake_flags()))
    return build


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """llama.cpp's part of the cache in a temporary directory. Only that part: a PAGEDLLM_CACHE_DIR of
    its own would make the engine rebuild its C++ kernels (minutes)."""
    root = tmp_path / "cache" / "llama.cpp"
    monkeypatch.setattr(llama_cpp, "cache_root", lambda: root)
    return root


def test_cache_root_follows_pagedllm_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    assert llama_cpp.cache_root() == tmp_path / "llama.cpp"


def test_llama_bench_command_passes_threads_lengths_repetitions_and_json() -> None:
    build = llama_cpp.LlamaCppBuild(Path("/src"), Path("/build"))
    command = llama_cpp.llama_bench_command(build, "/m/model.gguf", num_threads=2, input_len=128, output_len=64,
                                            repetitions=3)
    assert command == ["/build/bin/llama-bench", "-m", "/m/model.gguf", "-t", "2", "-p", "128", "-n", "64",
                       "-r", "3", "-o", "json"]


@pytest.mark.parametrize("kwargs, name", [({"num_threads": 0}, "num_threads"), ({"output_len": -1}, "output_len"),
                                          ({"repetitions": 0}, "repetitions")])
def test_llama_bench_command_refuses_bad_values(kwargs: dict, name: str) -> None:
    build = llama_cpp.LlamaCppBuild(Path("/src"), Path("/build"))
    args = {"num_threads": 2, "input_len": 8, "output_len": 4, **kwargs}
    with pytest.raises(ValueError, match=name):
        llama_cpp.llama_bench_command(build, "m.gguf", **args)


def test_cmake_commands_build_native_cpu_only_release_binaries() -> None:
    build = llama_cpp.LlamaCppBuild(Path("/src"), Path("/build"))
    configure = llama_cpp.cmake_configure_command(build)
    assert configure[:5] == ["cmake", "-S", "/src", "-B", "/build"]
    for flag in ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DGGML_CUDA=OFF", "-DLLAMA_CURL=OFF"):
        assert flag in configure
    built = llama_cpp.cmake_build_command(build, jobs=2)
    assert "-j2" in built and built[-2:] == ["llama-bench", "llama-quantize"]


def test_parse_recorded_llama_bench_report() -> None:
    run = llama_cpp.parse_llama_bench_json(RECORDED_JSON.read_text())
    tests = json.loads(RECORDED_JSON.read_text())
    prompt = next(t for t in tests if t["n_gen"] == 0)
    decode = next(t for t in tests if t["n_prompt"] == 0)
    assert run.prompt_tokens_per_s == pytest.approx(prompt["avg_ts"])
    assert run.decode_tokens_per_s == pytest.approx(decode["avg_ts"])
    assert run.decode_samples_tokens_per_s == pytest.approx(decode["samples_ts"])
    assert run.num_threads == 2 and run.build_commit == decode["build_commit"]
    assert run.model_size_bytes == decode["model_size"] > 0


def test_parse_skips_text_before_the_report_and_refuses_no_report() -> None:
    text = "some line llama-bench printed first\n" + RECORDED_JSON.read_text()
    assert llama_cpp.parse_llama_bench_json(text).decode_tokens_per_s is not None
    with pytest.raises(ValueError, match="no JSON"):
        llama_cpp.parse_llama_bench_json("error: failed to load model")
    with pytest.raises(ValueError, match="no test"):
        llama_cpp.parse_llama_bench_json("[]")


def test_build_is_keyed_under_the_cache_dir_and_reused(cache_dir: Path, tmp_path: Path) -> None:
    build = llama_cpp.build_paths()
    assert build.build_dir.parent == cache_dir and build.source_dir.is_relative_to(cache_dir)
    assert not build.is_built()
    _fake_build(cache_dir, RECORDED_JSON.read_text(), tmp_path / "calls")
    assert build.is_built()
    # a second call finds the build: no download, no cmake
    assert llama_cpp.ensure_built(say=lambda _: pytest.fail("must not build again")) == build
    build.stamp.write_text("-DGGML_NATIVE=OFF")  # built with other flags: not this build
    assert not build.is_built()


def test_gguf_types_and_paths(cache_dir: Path, tmp_path: Path) -> None:
    assert llama_cpp.normalize_gguf_type("q4_k_m") == "Q4_K_M"
    with pytest.raises(ValueError, match="--gguf-type"):
        llama_cpp.normalize_gguf_type("Q4_K_X")
    model = tmp_path / "qwen"
    model.mkdir()
    (model / "config.json").write_text("{}")
    cached = llama_cpp.gguf_path(model, "Q8_0")
    assert cached.name == "qwen.Q8_0.gguf" and cached.is_relative_to(cache_dir)
    assert llama_cpp.gguf_path(model, "BF16", tmp_path / "out") == tmp_path / "out" / "qwen.BF16.gguf"
    (model / "config.json").write_text('{"changed": 1}')  # a rewritten model converts anew
    assert llama_cpp.gguf_path(model, "Q8_0") != cached


def test_ensure_gguf_reuses_an_existing_file_without_building(cache_dir: Path, tmp_path: Path) -> None:
    model = tmp_path / "qwen"
    model.mkdir()
    (model / "config.json").write_text("{}")
    target = llama_cpp.gguf_path(model, "Q4_K_M", tmp_path / "out")
    target.parent.mkdir()
    target.write_bytes(b"GGUF")
    assert llama_cpp.ensure_gguf(model, "Q4_K_M", output_dir=tmp_path / "out") == target
    with pytest.raises(ValueError, match="not a Hugging Face model directory"):
        llama_cpp.ensure_gguf(tmp_path, "BF16")


def test_format_comparison_shows_both_engines_ratio_threads_and_cpu_kind() -> None:
    run = llama_cpp.parse_llama_bench_json(RECORDED_JSON.read_text())
    comparison = llama_cpp.compare("m.gguf", 2, [40.0, 44.0, 42.0], [0.1, 0.1, 0.1], 128, [run, run], ["llama-bench"])
    assert comparison.pagedllm_decode_tokens_per_s == 42.0
    assert comparison.pagedllm_prompt_tokens_per_s == pytest.approx(1280.0)
    assert comparison.decode_ratio == pytest.approx(42.0 / run.decode_tokens_per_s)
    text = llama_cpp.format_comparison(comparison)
    assert "2 threads" in text and f"{run.decode_tokens_per_s:,.1f}" in text
    assert f"{comparison.decode_ratio:.2f}x" in text
    assert ("amx_bf16" in text) and ("avx512_bf16" in text)  # the kind, present or "no ..."
    report = comparison.to_dict()
    assert report["decode_ratio"] == comparison.decode_ratio and "flags" in report["cpu"]


def test_bench_latency_compare_llama_cpp_alternates_on_the_same_file(
    cache_dir: Path, tmp_path: Path, tiny_qwen2_dir: str, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the roofline's probes are not what this test is about, and they are slow on a busy machine
    from pagedllm.benchmarks import latency
    from pagedllm.planner.hardware import HardwareSpec

    monkeypatch.setattr(latency, "measure_memory_bandwidth", lambda **_: 20e9)
    monkeypatch.setattr(latency, "measure_cpu", lambda dtype: HardwareSpec("stub", 1e11, 20e9, 0))
    calls = tmp_path / "calls"
    _fake_build(cache_dir, RECORDED_JSON.read_text(), calls)
    model = write_gguf(tiny_qwen2_dir, str(tmp_path / "tiny.gguf"), "F32")
    out = tmp_path / "latency.json"
    from pagedllm.entrypoints.cli import main

    argv = ["bench", "latency", "--model", model, "--compare", "llama.cpp", "--input-len", "8", "--output-len", "4",
            "--num-iters", "2", "--num-iters-warmup", "0", "--num-threads", "1", "--max-model-len", "64",
            "--output-json", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "llama.cpp on the same file" in printed and "pagedllm / llama.cpp" in printed
    # one llama-bench run after each of pagedllm's timed runs, on the file pagedllm loaded, same threads
    invocations = calls.read_text().splitlines()
    assert len(invocations) == 2
    assert all(line == f"-m {model} -t 1 -p 8 -n 4 -r 1 -o json" for line in invocations)
    report = json.loads(out.read_text())
    recorded = llama_cpp.parse_llama_bench_json(RECORDED_JSON.read_text())
    assert report["llama_cpp"]["llama_cpp_decode_tokens_per_s"] == pytest.approx(recorded.decode_tokens_per_s)
    assert report["llama_cpp"]["num_threads"] == report["num_threads"] == 1
    assert report["llama_cpp"]["decode_ratio"] > 0 and "flags" in report["cpu"]


def test_failing_llama_bench_is_one_error_line(
    cache_dir: Path, tmp_path: Path, tiny_qwen2_dir: str, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pagedllm.benchmarks import latency
    from pagedllm.entrypoints.cli import main

    monkeypatch.setattr(latency, "measure_memory_bandwidth", lambda **_: 20e9)
    build = _fake_build(cache_dir, RECORDED_JSON.read_text(), tmp_path / "calls")
    build.llama_bench.write_text("#!/bin/sh\necho 'error: failed to load model' >&2\nexit 1\n")
    model = write_gguf(tiny_qwen2_dir, str(tmp_path / "tiny.gguf"), "F32")
    argv = ["bench", "latency", "--model", model, "--compare", "llama.cpp", "--input-len", "8", "--output-len", "4",
            "--num-iters", "1", "--num-iters-warmup", "0", "--num-threads", "1", "--max-model-len", "64"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "llama-bench failed (exit 1)" in err and "failed to load model" in err


def test_gguf_type_needs_compare(capsys: pytest.CaptureFixture[str], tiny_qwen2_dir: str) -> None:
    from pagedllm.entrypoints.cli import main

    assert main(["bench", "latency", "--model", tiny_qwen2_dir, "--gguf-type", "Q8_0"]) == 2
    assert "--gguf-type applies to --compare llama.cpp" in capsys.readouterr().err


_BUILT = llama_cpp.build_paths()
_REAL_MODEL = Path(os.path.expanduser("~/.cache/pagedllm/models/SmolLM2-135M-Instruct.Q4_1.gguf"))


@pytest.mark.skipif(not _BUILT.is_built(), reason="llama.cpp is not built here (pagedllm bench gguf builds it)")
@pytest.mark.skipif(not _REAL_MODEL.is_file(), reason="the SmolLM2-135M-Instruct Q4_1 file is not cached")
def test_real_llama_bench_report_parses() -> None:
    command = llama_cpp.llama_bench_command(_BUILT, _REAL_MODEL, num_threads=1, input_len=8, output_len=4)
    run = llama_cpp.run_llama_bench(command)
    assert run.num_threads == 1
    assert run.prompt_tokens_per_s > 0 and run.decode_tokens_per_s > 0


@pytest.mark.slow
@pytest.mark.skipif(not _BUILT.convert_script.is_file(), reason="llama.cpp's source is not unpacked here")
def test_converter_writes_a_file_pagedllm_reads(tmp_path: Path) -> None:
    """llama.cpp's own converter on a random model whose tokenizer it does not know: written, with the
    same weights, and read back by pagedllm's GGUF loader as the same architecture."""
    pytest.importorskip("sentencepiece")
    from tests.tiny_models import build_model

    # an embedding larger than the tokenizer, as the 386M benchmark model has (the converter asserts it
    # is at least as large as the tokenizer's ids, special tokens included)
    tiny_qwen2_dir = build_model(tmp_path / "qwen2", "qwen2", tie_word_embeddings=True, vocab_size=1024, seed=1)
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    from pagedllm.models.gguf import read_hf_config

    path = llama_cpp.ensure_gguf(tiny_qwen2_dir, "F32", _BUILT, output_dir=tmp_path / "gguf")
    config = read_hf_config(str(path))
    hf = json.loads((Path(tiny_qwen2_dir) / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        assert config[key] == hf[key]
    embedding = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "token_embd.weight")
    expected = load_file(str(Path(tiny_qwen2_dir) / "model.safetensors"))["model.embed_tokens.weight"]
    np.testing.assert_array_equal(np.asarray(embedding.data).reshape(expected.shape), expected)
