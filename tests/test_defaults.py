"""Defaults a newcomer relies on (issue 20): sampling from the model's generation_config.json as vLLM's
`--generation-config auto`, a bounded CPU KV cache, thread counts, chat habits, the progress bar."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.config import ModelConfig
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.worker.model_runner import CPU_KVCACHE_SPACE_ENV

SMALL = dict(dtype="float32", max_model_len=128, seed=0)


def with_generation_config(tiny_llama_dir: str, tmp_path: Path, config: dict) -> str:
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    (model / "generation_config.json").write_text(json.dumps(config))
    return str(model)


def test_generation_config_diff_follows_vllm(tiny_llama_dir: str, tmp_path: Path) -> None:
    model = with_generation_config(tiny_llama_dir, tmp_path, {
        "max_new_tokens": 7, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
        "repetition_penalty": 1.1, "eos_token_id": 1})
    diff = ModelConfig.from_pretrained(model).get_diff_sampling_param()
    assert diff == {"max_tokens": 7, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                    "repetition_penalty": 1.1}
    assert ModelConfig.from_pretrained(model, generation_config="vllm").get_diff_sampling_param() == {}
    greedy = with_generation_config(tiny_llama_dir, tmp_path / "g", {"do_sample": False, "temperature": 0.6})
    assert ModelConfig.from_pretrained(greedy).get_diff_sampling_param() == {"temperature": 0.0}
    # a directory of its own, as vLLM's --generation-config DIR
    assert ModelConfig.from_pretrained(tiny_llama_dir, generation_config=model).get_diff_sampling_param()[
        "max_tokens"] == 7
    with pytest.raises(ValueError, match="generation_config"):
        ModelConfig.from_pretrained(tiny_llama_dir, generation_config=str(tmp_path / "nowhere"))


def test_llm_defaults_come_from_the_generation_config(tiny_llama_dir: str, tmp_path: Path) -> None:
    model = with_generation_config(tiny_llama_dir, tmp_path, {"do_sample": False, "max_new_tokens": 5})
    llm = LLM(model=model, **SMALL)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens) == (0.0, 5)
    out = llm.generate("def f", use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) <= 5
    # an explicit SamplingParams is used as given
    explicit = llm.generate("def f", SamplingParams(max_tokens=9, ignore_eos=True, temperature=0.0), use_tqdm=False)
    assert len(explicit[0].outputs[0].token_ids) == 9
    plain = LLM(model=model, generation_config="vllm", **SMALL)
    assert plain.get_default_sampling_params().temperature == SamplingParams().temperature == 1.0


def test_server_request_defaults_fill_only_unset_fields() -> None:
    defaults = {"temperature": 0.0, "top_k": 5, "max_tokens": 128}
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], top_p=0.5)
    params = request.build_sampling_params(10, None, defaults=defaults)
    assert (params.temperature, params.top_k, params.top_p, params.max_tokens) == (0.0, 5, 0.5, 10)
    explicit = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], temperature=0.8)
    assert explicit.build_sampling_params(10, None, defaults=defaults).temperature == 0.8


def test_chat_max_tokens_is_bounded_by_the_generation_config() -> None:
    from pagedllm.entrypoints.openai.serving_engine import ServingContext

    class FakeEngine:
        model_config = type("C", (), {"vocab_size": 10})()

    context = ServingContext(engine=FakeEngine(), tokenizer=None, served_model_names=["m"], max_model_len=2048,
                             default_sampling_params={"max_tokens": 128})
    assert context.check_length(10, None, "messages") == 128
    assert context.check_length(2000, None, "messages") == 48
    assert context.check_length(10, 500, "messages") == 500  # explicit wins
    context.default_sampling_params = {}
    assert context.check_length(10, None, "messages") == 2038  # vLLM: the rest of the context


def test_cpu_kv_cache_default_is_bounded(tiny_llama_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedllm.worker import model_runner

    monkeypatch.delenv(CPU_KVCACHE_SPACE_ENV, raising=False)
    # max_num_seqs x max_model_len bounds it for a small model
    llm = LLM(model=tiny_llama_dir, **SMALL, max_num_seqs=4)
    engine = llm.llm_engine
    per_block = engine.model_runner.kv_cache_bytes_per_block()
    assert engine.cache_config.num_blocks == (4 * 128 // 16 + 1)
    assert engine.model_runner.kv_budget_source == "max_num_seqs x max_model_len"
    # 4 GiB bounds it when every sequence at full length would need more
    monkeypatch.setattr(model_runner, "DEFAULT_CPU_KV_CACHE_BYTES", 64 * per_block)
    assert LLM(model=tiny_llama_dir, **SMALL).llm_engine.cache_config.num_blocks == 64
    # PAGEDLLM_CPU_KVCACHE_SPACE (GiB) sets it exactly, as VLLM_CPU_KVCACHE_SPACE does
    monkeypatch.setenv(CPU_KVCACHE_SPACE_ENV, str(32 * per_block / 2**30))
    assert LLM(model=tiny_llama_dir, **SMALL).llm_engine.cache_config.num_blocks == 32
    monkeypatch.setenv(CPU_KVCACHE_SPACE_ENV, "lots")
    with pytest.raises(ValueError, match=CPU_KVCACHE_SPACE_ENV):
        LLM(model=tiny_llama_dir, **SMALL)
    monkeypatch.delenv(CPU_KVCACHE_SPACE_ENV)
    exact = LLM(model=tiny_llama_dir, **SMALL, kv_cache_memory_bytes=8 * per_block)
    assert exact.llm_engine.cache_config.num_blocks == 8


def test_kv_cache_start_up_line_is_honest(tiny_llama_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    logger = logging.getLogger("pagedllm")
    logger.addHandler(caplog.handler)
    try:
        LLM(model=tiny_llama_dir, **SMALL, max_num_seqs=2)
    finally:
        logger.removeHandler(caplog.handler)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:"))
    assert "room for 2 sequences of max_model_len 128" in line and "lazily" in line
    assert "from max_num_seqs x max_model_len" in line


def test_num_threads(tiny_llama_dir: str) -> None:
    before = torch.get_num_threads()
    try:
        llm = LLM(model=tiny_llama_dir, **SMALL, max_num_seqs=2, num_threads=1)
        assert torch.get_num_threads() == 1 and llm.llm_engine.num_threads == 1
        with pytest.raises(ValueError, match="num_threads"):
            EngineArgs(model=tiny_llama_dir, num_threads=0)
    finally:
        torch.set_num_threads(before)


def test_default_num_threads_leaves_busy_cores_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without num_threads or OMP_NUM_THREADS the engine takes the usable CPUs other processes do not
    keep busy now, never more than torch's own count and never fewer than one."""
    from pagedllm import platform

    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(platform, "usable_cpus", lambda: 8)
    try:
        torch.set_num_threads(4)
        for busy, expected in ((0, 4), (5, 3), (7, 1), (30, 1)):
            monkeypatch.setattr(platform, "busy_cpus", lambda busy=busy: busy)
            assert platform.default_num_threads()[0] == expected, busy
        torch.set_num_threads(4)
        assert platform.configure_threads(None) == 1  # still 30 busy
        monkeypatch.setenv("OMP_NUM_THREADS", "4")
        torch.set_num_threads(4)
        assert platform.configure_threads(None) == 4  # OMP_NUM_THREADS said
        assert platform.configure_threads(2) == 2      # an explicit count wins
    finally:
        torch.set_num_threads(before)


def test_openmp_threads_spin_briefly_whatever_the_load_and_the_environment_wins() -> None:
    """The wait policy is a bounded spin decided inside the process: the load average (which still counts
    work that ended a minute ago) no longer moves it. A user's OMP_WAIT_POLICY or GOMP_SPINCOUNT wins, and
    the policy says who chose it."""
    import os
    import subprocess
    import sys

    def policy(load: float, **extra: str) -> str:
        code = (f"import os; os.getloadavg = lambda: ({load}, 0.0, 0.0); import pagedllm; "
                "from pagedllm.openmp import wait_policy; "
                "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'), '|', wait_policy())")
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
        return subprocess.run([sys.executable, "-c", code], env={**env, **extra}, capture_output=True, text=True,
                              check=True).stdout.strip()

    idle, busy = policy(0.2), policy(1.5)
    for line in (idle, busy):
        count = int(line.split()[1])  # timed for the same duration, so the same within the timing's noise
        assert line.startswith("None ") and "pagedllm's default" in line and 100 <= count <= 10 ** 6
    assert 0.5 < int(idle.split()[1]) / int(busy.split()[1]) < 2
    assert policy(1.5, OMP_WAIT_POLICY="ACTIVE").startswith("ACTIVE None | spin without bound (from the environment")
    assert policy(0.2, GOMP_SPINCOUNT="10").startswith("None 10 | spin 10 iterations, then sleep (from the environment")
    code = "import torch, pagedllm; from pagedllm.openmp import wait_policy; print(wait_policy())"
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    late = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert "torch was imported before pagedllm" in late  # too late to choose: the line says so


def test_spin_count_is_timed_for_the_same_duration_on_every_cpu() -> None:
    """GOMP_SPINCOUNT is set for SPIN_MICROSECONDS from a timed `pause` loop: a `pause` lasts 4x longer on
    Zen 4 than on the AMX Xeons, so a fixed count spins 4x shorter on one of them."""
    import platform as host

    from pagedllm import openmp

    ns = openmp.spin_iteration_ns(iterations=2000, runs=3)
    if host.system() == "Linux" and host.machine() == "x86_64":
        assert ns is not None and 0.1 < ns < 10_000
        count = openmp.default_spincount()
        assert count * openmp._iteration_ns == pytest.approx(openmp.SPIN_MICROSECONDS * 1000, rel=0.01) or count == 100
    else:
        assert ns is None and openmp.default_spincount() == openmp.FALLBACK_SPINCOUNT


def test_busy_cpus_counts_runnable_tasks_now_not_the_load_average(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A load average of 30 left by work that has ended does not count: only tasks runnable now, less the
    thread asking; without /proc/stat, the load average is all there is."""
    from pagedllm import platform

    monkeypatch.setattr(platform.os, "getloadavg", lambda: (30.0, 30.0, 30.0))
    stat = tmp_path / "stat"
    stat.write_text("cpu  1 2 3 4\nprocs_running 3\nprocs_blocked 0\n")
    assert platform.busy_cpus(samples=2, interval_s=0.0, stat_path=str(stat)) == 2
    stat.write_text("procs_running 1\n")
    assert platform.busy_cpus(samples=1, stat_path=str(stat)) == 0
    assert platform.busy_cpus(samples=1, stat_path=str(tmp_path / "missing")) == 30


def test_chat_prompt_and_continue_final_message(tiny_llama_dir: str) -> None:
    llm = LLM(model=tiny_llama_dir, **SMALL, max_num_seqs=2)
    greedy = SamplingParams(temperature=0.0, max_tokens=3)
    messages = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi, I am"}]
    out = llm.chat(messages[:1], greedy, use_tqdm=False)[0]
    tokenizer = llm.get_tokenizer()
    assert out.prompt == tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=False)
    continued = llm.chat(messages, greedy, use_tqdm=False, continue_final_message=True)[0]
    assert continued.prompt.endswith("Hi, I am")  # no end-of-turn after the final message
    assert continued.prompt_token_ids == tokenizer(continued.prompt, add_special_tokens=False)["input_ids"]
    plain = llm.chat(messages[:1], greedy, use_tqdm=False, add_generation_prompt=False)[0]
    assert plain.prompt == tokenizer.apply_chat_template(messages[:1], add_generation_prompt=False, tokenize=False)
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat(messages, greedy, use_tqdm=False, continue_final_message=True, add_generation_prompt=True)


def test_progress_bar_shows_token_rates_and_advances(tiny_llama_dir: str, capsys: pytest.CaptureFixture) -> None:
    from pagedllm import llm as llm_module

    llm = LLM(model=tiny_llama_dir, **SMALL, max_num_seqs=4)
    seen: list[float] = []
    original = llm_module._Progress.update

    def spy(self, outputs, num_finished):  # noqa: ANN001
        self.last_refresh = 0.0  # refresh every step, so each step's position is seen
        original(self, outputs, num_finished)
        seen.append(self.bar.n)

    llm_module._Progress.update = spy
    try:
        llm.generate(["a b", "c d", "e f", "g h"], SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0))
    finally:
        llm_module._Progress.update = original
    err = capsys.readouterr().err
    assert "est. speed input:" in err and "output:" in err and "toks/s" in err and "4/4 prompts" in err
    # prompts of equal length all finish at the last step, yet the bar moved before it
    assert 0 < seen[len(seen) // 2] < 4 and seen[-1] == 4
