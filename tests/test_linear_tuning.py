"""The CPU linear kernel chosen by measurement (pagedllm.layers.linear_tuning): the table's cache key and
its reuse, one path per dtype for every row bucket (so a row's result never depends on its batch), F.linear
only for a draft, the forced paths, and the same greedy tokens whichever path a table selects. Nothing
here asserts a time: tables are either measured with tiny shapes (for their form) or written by hand."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.layers import linear_tuning
from pagedllm.layers.linear import prepack_enabled
from pagedllm.layers.linear_tuning import (
    BUCKETS,
    LM_HEAD_BUCKET_WEIGHTS,
    choose_linear_kernel,
    load_table,
    runnable_paths,
    shape_key,
    table_key,
    table_path,
)

pytestmark = pytest.mark.skipif(not prepack_enabled(torch.device("cpu"), torch.float32),
                                reason="torch built without oneDNN")

SHAPES = [(80, 48), (48, 40), (80, 48), (100, 48)]


@pytest.fixture
def tuning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Measurement on, its table in a fresh directory (the compiled kernels stay where they are: moved,
    they would be rebuilt)."""
    monkeypatch.setattr(linear_tuning, "table_dir", lambda: str(tmp_path))
    monkeypatch.setenv("PAGEDLLM_CPU_TUNE", "1")
    monkeypatch.delenv("PAGEDLLM_CPU_PREPACK_WEIGHTS", raising=False)
    monkeypatch.setattr(linear_tuning, "_REPEAT_S", 0.0)  # two runs per cell: the form, not the times
    return tmp_path


def _write_fastest(path: str, fastest: str, dtype: torch.dtype, shapes: list[tuple[int, int]],
                   threads: int | None = None) -> None:
    """A table in which `fastest` wins every bucket by 2x, for this CPU's key."""
    key = table_key(threads)
    cells = {shape_key(dtype, shape): {p: {b: (1.0 if p == fastest else 2.0) * 1e-3 for b in BUCKETS}
                                        for p in runnable_paths(dtype)} for shape in shapes}
    linear_tuning.save_table(path, key, cells)


def test_table_is_keyed_by_the_machine_and_reused(tuning: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    choice = choose_linear_kernel(SHAPES, torch.float32)
    key = table_key()
    assert set(key) == {"cpu", "flags", "threads", "torch", "kernels"}
    assert key["threads"] == torch.get_num_threads() and key["torch"] == torch.__version__
    path = table_path(key)
    assert os.path.dirname(path) == str(tuning)  # beside the compiled kernels
    table = load_table(path, key)
    paths = runnable_paths(torch.float32)
    for shape in set(SHAPES):  # every cell: each runnable path, each bucket, once per distinct shape
        assert set(table[shape_key(torch.float32, shape)]) == set(paths)
        assert all(set(cells) == set(BUCKETS) for cells in table[shape_key(torch.float32, shape)].values())
    assert choice.path in paths and choice.path != "plain"  # a target model is batch-invariant
    assert set(choice.bucket_ms) == set(BUCKETS) and "measured on this CPU" in choice.source
    line = choice.describe()
    assert line.startswith(f"float32 linears: {choice.path} ") and "serves every row bucket" in line

    def no_timing(*args: object) -> float:
        raise AssertionError("the cached table should have been reused")

    monkeypatch.setattr(linear_tuning, "_time", no_timing)
    again = choose_linear_kernel(SHAPES, torch.float32)
    assert (again.path, again.bucket_ms) == (choice.path, choice.bucket_ms)
    # Another thread count, or another key in the file, is another table: nothing reused.
    assert table_path(table_key(key["threads"] + 1)) != path
    assert load_table(path, {**key, "torch": "0.0"}) == {}


def test_one_path_for_every_bucket_and_f_linear_only_for_a_draft(tuning: Path) -> None:
    """A table where F.linear is fastest everywhere: the target takes the best batch-invariant path, the
    draft (batch_invariant=False) takes F.linear; either way one path for all buckets."""
    paths = runnable_paths(torch.float32)
    _write_fastest(table_path(table_key()), "plain", torch.float32, SHAPES)
    target = choose_linear_kernel(SHAPES, torch.float32)
    assert target.path == [p for p in paths if p != "plain"][0]
    draft = choose_linear_kernel(SHAPES, torch.float32, batch_invariant=False)
    assert draft.path == "plain"
    if len(paths) == 3:  # blocked, oneDNN and F.linear all run here: a table can pick either packed one
        _write_fastest(table_path(table_key()), "onednn", torch.float32, SHAPES)
        assert choose_linear_kernel(SHAPES, torch.float32).path == "onednn"
        assert "(onednn" not in choose_linear_kernel(SHAPES, torch.float32).describe()  # it is the fastest


def test_an_lm_head_chosen_alone_leaves_the_prefill_bucket_out() -> None:
    """A quantized model's LM head is the only full-precision linear: it multiplies one row per sequence
    sampled, never a prefill chunk, so a path that only wins that bucket does not take it."""
    bucket_ms = {"1": {"amx": 1.0, "onednn": 1.2}, "2-4": {"amx": 1.0, "onednn": 1.1},
                 "5-16": {"amx": 1.0, "onednn": 1.1}, "17-64": {"amx": 1.3, "onednn": 1.0},
                 "prefill": {"amx": 10.0, "onednn": 1.0}}
    assert linear_tuning._pick(bucket_ms, ["amx", "onednn"]) == "onednn"
    assert linear_tuning._pick(bucket_ms, ["amx", "onednn"], LM_HEAD_BUCKET_WEIGHTS) == "amx"


def test_forced_paths_and_bounded_budget(tuning: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for forced in ("blocked", "onednn"):
        monkeypatch.setenv("PAGEDLLM_CPU_PREPACK_WEIGHTS", forced)
        choice = choose_linear_kernel(SHAPES, torch.float32)
        if forced in runnable_paths(torch.float32):
            assert choice.path == forced and choice.source == f"PAGEDLLM_CPU_PREPACK_WEIGHTS={forced}"
    monkeypatch.setenv("PAGEDLLM_CPU_PREPACK_WEIGHTS", "fastest")
    with pytest.raises(ValueError, match="PAGEDLLM_CPU_PREPACK_WEIGHTS"):
        choose_linear_kernel(SHAPES, torch.float32)
    monkeypatch.delenv("PAGEDLLM_CPU_PREPACK_WEIGHTS")
    monkeypatch.setattr(linear_tuning, "TUNE_BUDGET_S", 0.0)  # nothing fits: the static default, said so
    choice = choose_linear_kernel(SHAPES, torch.float32)
    assert "budget ran out" in choice.source and choice.path == runnable_paths(torch.float32)[0]
    monkeypatch.setenv("PAGEDLLM_CPU_TUNE", "0")
    assert choose_linear_kernel(SHAPES, torch.float32).source == "not measured: PAGEDLLM_CPU_TUNE=0"


def test_the_table_json_is_plain_data(tuning: Path) -> None:
    choose_linear_kernel(SHAPES[:1], torch.float32)
    data = json.loads(Path(table_path(table_key())).read_text())
    assert data["key"] == table_key() and shape_key(torch.float32, SHAPES[0]) in data["shapes"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_every_path_a_table_selects_gives_the_same_greedy_tokens(tiny_qwen2_dir: str, dtype: str, tuning: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    torch_dtype = getattr(torch, dtype)
    if len([p for p in runnable_paths(torch_dtype) if p != "plain"]) < 2:  # AVX2-only CPUs in bf16
        pytest.skip(f"one path runs {dtype} on this CPU: nothing is measured or chosen")
    prompts = ["def fibonacci(n):", "The quick brown fox"]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    def generate() -> tuple[str, list[list[int]]]:
        llm = LLM(model=tiny_qwen2_dir, dtype=dtype, seed=0, max_model_len=128)
        choice = getattr(llm.llm_engine.model_runner.model, "linear_kernel_choice", None)
        return (choice.path if choice is not None else "plain",
                [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])

    measured, first = generate()  # measures the model's shapes, then picks one path
    prefix = shape_key(torch_dtype, (0, 0)).split(":")[0] + ":"
    shapes = [tuple(int(n) for n in name.removeprefix(prefix).split("x"))
              for name in load_table(table_path(table_key()), table_key()) if name.startswith(prefix)]
    assert shapes
    for path in runnable_paths(torch_dtype):
        if path == measured:
            continue
        if path == "plain":  # never a target's choice: forced instead
            monkeypatch.setenv("PAGEDLLM_CPU_PREPACK_WEIGHTS", "0")
        else:
            _write_fastest(table_path(table_key()), path, torch_dtype, shapes)
        chosen, tokens = generate()
        monkeypatch.delenv("PAGEDLLM_CPU_PREPACK_WEIGHTS", raising=False)
        assert chosen == path
        assert tokens == first, path


def test_tune_command_measures_again(tiny_llama_dir: str, tuning: Path, capsys: pytest.CaptureFixture) -> None:
    from pagedllm.entrypoints.cli import main

    path = Path(table_path(table_key()))
    path.write_text("{}")  # a table that is not this key's: `tune` replaces it
    assert main(["tune", "--model", tiny_llama_dir, "--num-threads", str(torch.get_num_threads()),
                 "--max-model-len", "128"]) == 0
    assert "float32 linears:" in capsys.readouterr().out and load_table(str(path), table_key())


def test_a_disturbed_measurement_is_used_once_and_not_cached(tuning: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cell where one row took far longer than 256 (another process had the CPU) is timed again; if it
    stays so, this start uses the table but does not cache it."""
    monkeypatch.setattr(linear_tuning, "_time", lambda matmul, x: 1.0 if x.shape[0] == 1 else 1e-3)
    choice = choose_linear_kernel(SHAPES, torch.float32)
    assert "disturbed by other work" in choice.source and choice.bucket_ms
    assert load_table(table_path(table_key()), table_key()) == {}
    assert linear_tuning.implausible_buckets({"1": 1.0, "2-4": 0.6, "5-16": 0.2}) == ["2-4"]


def test_quantized_linears_take_the_kernel_their_table_selects(tiny_llama_dir: str, tuning: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """int4 (and int8) linears: pagedllm's VNNI kernel or torch's, per method and group size, by the same
    measured table; PAGEDLLM_QUANT_KERNEL forces one. Where the VNNI kernel does not run there is no choice."""
    from pagedllm.benchmarks.reporting import cpu_kernel_summary, format_cpu_kernels
    from pagedllm.layers.quantization.int4 import Int4Weight
    from pagedllm.layers.quantization.vnni import VnniWeight, kernel_enabled

    if not kernel_enabled(torch.bfloat16):
        pytest.skip("no AVX512-VNNI (or kernels not built)")

    def load() -> tuple[LLM, list]:
        llm = LLM(model=tiny_llama_dir, dtype="bfloat16", quantization="int4", quantization_group_size=32,
                  max_model_len=128)
        return llm, llm.llm_engine.model_runner.model.quant_kernel_choices

    llm, choices = load()  # measured (tiny shapes: the table's form, not its times)
    assert [c.dtype for c in choices] == ["int4-g32"] and choices[0].bucket_ms
    path, key = table_path(table_key()), table_key()
    table = load_table(path, key)
    int4_cells = [name for name in table if name.startswith("int4-g32:")]
    assert int4_cells and all(set(table[name]) == {"pagedllm", "torch"} for name in int4_cells)
    prompt = [{"prompt_token_ids": [1, 5, 9, 14, 3]}]
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for fastest, weight_class in (("torch", Int4Weight), ("pagedllm", VnniWeight)):
        for name in int4_cells:
            table[name] = {p: {b: (1.0 if p == fastest else 2.0) * 1e-3 for b in BUCKETS} for p in table[name]}
        linear_tuning.save_table(path, key, table)
        llm, choices = load()
        assert choices[0].path == fastest
        assert isinstance(llm.llm_engine.model_runner.model.layers[0].mlp.down_proj.weight, weight_class)
        assert len(llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids) == 4
        summary = cpu_kernel_summary(llm)  # what the benchmarks print
        assert summary["quantized_linear_kernels"] == [choices[0].describe()]
        assert f"quantized linear kernel: int4-g32 linears: {fastest}" in format_cpu_kernels(summary)
    monkeypatch.setenv("PAGEDLLM_QUANT_KERNEL", "torch")  # forced: built in torch's layout, no choice made
    llm, choices = load()
    assert choices == [] and isinstance(llm.llm_engine.model_runner.model.layers[0].mlp.down_proj.weight, Int4Weight)
