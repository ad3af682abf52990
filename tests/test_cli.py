"""What a newcomer meets first on the command line (issue 20): one-line errors with tracebacks behind
--debug, quiet Ctrl-C and closed pipes, literal prompts, vLLM's flags, help without doubled defaults.

Every command runs as `python -m pagedllm.entrypoints.cli ...` in a child process, as a user runs it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--dtype", "float32", "--max-model-len", "128", "--num-threads", "1"]


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env={**os.environ, "TOKENIZERS_PARALLELISM": "false",
                                                         "HF_HUB_OFFLINE": "1", **(env or {})})


def assert_one_line_error(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith("INFO")]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_hub_id_is_one_line_saying_models_are_local(tmp_path: Path) -> None:
    result = cli("serve", "meta-llama/Llama-3.1-8B", "--port", "0")
    assert_one_line_error(result, "meta-llama/Llama-3.1-8B", "local", "downloads nothing")
    debug = cli("serve", "--model", "meta-llama/Llama-3.1-8B", "--debug")
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_a_server_that_is_not_there_a_bad_port_a_file_or_a_missing_tokenizer_are_one_line(
        tiny_llama_dir: str, tmp_path: Path) -> None:
    assert_one_line_error(cli("chat", "--url", "http://127.0.0.1:9/v1", "--quick", "hi"), "cannot reach")
    assert_one_line_error(cli("bench", "serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "1"),
                          "cannot reach")
    result = cli("serve", tiny_llama_dir, "--port", "70000")
    assert result.returncode == 2 and "--port" in result.stderr and "Traceback" not in result.stderr
    with socket.socket() as taken:  # a port in use: refused before the model loads, in one line
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        result = cli("serve", tiny_llama_dir, "--host", "127.0.0.1", "--port", port, *SMALL)
        assert_one_line_error(result, "--port", port, "cannot listen")
        assert "KV cache" not in result.stderr  # (the engine never started)
    # vLLM's module for the server takes serve's flags; a chat template that is neither a file nor Jinja
    # is refused before the model loads
    result = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.openai.api_server", "--model", tiny_llama_dir,
                             "--chat-template", "no-such-template.jinja"], capture_output=True, text=True,
                            timeout=300, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert_one_line_error(result, "--chat-template")
    text = tmp_path / "notes.txt"
    text.write_text("not a model")
    assert_one_line_error(cli("generate", "--model", str(text), "x"), "another kind")
    assert_one_line_error(cli("generate", "--model", tiny_llama_dir, *SMALL, "--tokenizer", str(tmp_path / "nope"),
                              "x"), "tokenizer")


def test_quantize_and_plan_refuse_bad_inputs_by_name_and_leave_nothing_behind(tiny_llama_dir: str,
                                                                             tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert_one_line_error(cli("quantize", tiny_llama_dir, str(out), "-q", "int8", "--group-size", "7"),
                          "quantization_group_size")
    assert not out.exists()  # a failed run leaves no half-written directory
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    assert_one_line_error(cli("quantize", str(gguf), str(out), "-q", "int8"), "GGUF")
    result = cli("plan", "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--peak-tflops", "-3")
    assert result.returncode == 2 and "--peak-tflops" in result.stderr and "Traceback" not in result.stderr


def test_vllm_engine_arguments_with_nothing_to_do_are_taken_and_others_named(tiny_llama_dir: str) -> None:
    from pagedllm.engine.arg_utils import EngineArgs

    EngineArgs(model=tiny_llama_dir, disable_log_stats=True, swap_space=4, tokenizer_mode="auto", task="generate",
               load_format="auto", pipeline_parallel_size=1, revision="main", max_seq_len_to_capture=8192,
               compilation_config=0, enable_sleep_mode=False, disable_async_output_proc=True,
               logprobs_mode="raw_logprobs", guided_decoding_backend="xgrammar", limit_mm_per_prompt={"image": 0},
               served_model_name="tiny", max_logprobs=-1)
    for name, value in (("pipeline_parallel_size", 2), ("tokenizer_mode", "mistral"), ("task", "embed"),
                        ("load_format", "pt"), ("cpu_offload_gb", 4), ("compilation_config", 3),
                        ("enable_sleep_mode", True), ("logprobs_mode", "processed_logprobs"),
                        ("guided_decoding_backend", "nope"), ("limit_mm_per_prompt", {"image": 1}),
                        ("hf_overrides", "x")):
        with pytest.raises(ValueError, match=name):
            EngineArgs(model=tiny_llama_dir, **{name: value})


def test_engine_construction_errors_are_one_line(tiny_llama_dir: str) -> None:
    # whatever the engine refuses (here a tensor-parallel size this host cannot give), one line
    assert_one_line_error(cli("generate", "--model", tiny_llama_dir, *SMALL, "--tensor-parallel-size", "64", "x"))
    assert_one_line_error(cli("generate", "--model", tiny_llama_dir, *SMALL, "--temperature", "-1", "x"),
                          "temperature")
    assert "Traceback" in cli("generate", "--model", tiny_llama_dir, *SMALL, "--temperature", "-1", "--debug",
                              "x").stderr


def test_custom_code_models_are_refused_and_trust_remote_code_loads_a_custom_tokenizer(tiny_llama_dir: str,
                                                                                     tmp_path: Path) -> None:
    import shutil

    custom = tmp_path / "custom"
    shutil.copytree(tiny_llama_dir, custom)
    config = json.loads((custom / "config.json").read_text())
    config["architectures"] = ["MyOwnForCausalLM"]
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_mine.MyOwnForCausalLM"}
    (custom / "config.json").write_text(json.dumps(config))
    assert_one_line_error(cli("generate", "--model", str(custom), *SMALL, "--trust-remote-code", "x"),
                          "custom code", "own model implementations")
    # a tokenizer shipped as code runs only with --trust-remote-code, as in vLLM
    custom_tokenizer = tmp_path / "custom_tokenizer"
    shutil.copytree(tiny_llama_dir, custom_tokenizer)
    (custom_tokenizer / "shouting.py").write_text(
        "from transformers import PreTrainedTokenizerFast\n\n\n"
        "class ShoutingTokenizer(PreTrainedTokenizerFast):\n"
        "    def decode(self, *args, **kwargs):\n"
        "        return super().decode(*args, **kwargs).upper()\n")
    tokenizer_config = json.loads((custom_tokenizer / "tokenizer_config.json").read_text())
    tokenizer_config["tokenizer_class"] = "ShoutingTokenizer"
    tokenizer_config["auto_map"] = {"AutoTokenizer": [None, "shouting.ShoutingTokenizer"]}
    (custom_tokenizer / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    assert_one_line_error(cli("generate", "--model", str(custom_tokenizer), *SMALL, "x"), "trust_remote_code=True")
    accepted = cli("generate", "--model", str(custom_tokenizer), *SMALL, "--trust-remote-code", "--max-tokens", "8",
                   "--temperature", "0", "--ignore-eos", "X")
    assert accepted.returncode == 0, accepted.stderr
    text = accepted.stdout.strip().splitlines()[-1]
    assert any(c.isalpha() for c in text) and text == text.upper(), "the custom tokenizer's decode ran"


def test_broken_pipe_is_quiet() -> None:
    shell = f'"{sys.executable}" -m pagedllm.entrypoints.cli plan --model llama-3.1-8b | head -1'
    result = subprocess.run(["bash", "-o", "pipefail", "-c", shell], capture_output=True, text=True, cwd=ROOT,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("model") and result.stderr == ""


def test_ctrl_c_exits_130_without_traceback(tiny_llama_dir: str) -> None:
    # 256 prompts x 1,000 tokens: seconds of work, so the interrupt lands mid-generation
    proc = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.cli", "generate", "--model", tiny_llama_dir,
                             "--dtype", "float32", "--num-threads", "1", "--max-model-len", "1024",
                             "--max-tokens", "1000", "--ignore-eos", *["x"] * 256],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "PAGEDLLM_LOGGING_LEVEL": "INFO"},
                            # a suite started in the background (`pytest &`) ignores SIGINT, and an ignored
                            # signal is inherited: Python would then never raise KeyboardInterrupt
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    # SIGINT once the engine has started (it logs its KV cache line)
    assert proc.stderr is not None
    seen = ""
    while "KV cache" not in seen:
        line = proc.stderr.readline()
        assert line, f"the command ended before starting: {seen}"
        seen += line
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err


def test_generate_takes_prompts_literally(tiny_llama_dir: str) -> None:
    prompts = ["C:\\temp", "# café – ü"]
    result = cli("generate", "--model", tiny_llama_dir, *SMALL, "--max-tokens", "2", "--json", *prompts)
    assert result.returncode == 0, result.stderr
    assert [json.loads(line)["prompt"] for line in result.stdout.splitlines()] == prompts
    escaped = cli("generate", "--model", tiny_llama_dir, *SMALL, "--max-tokens", "2", "--json",
                  "--interpret-escapes", "a\\tb café")
    assert json.loads(escaped.stdout.splitlines()[0])["prompt"] == "a\tb café"


def test_generate_logprobs_and_generation_config_defaults(tiny_llama_dir: str, tmp_path: Path) -> None:
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    (model / "generation_config.json").write_text(json.dumps({"do_sample": False, "max_new_tokens": 3}))
    result = cli("generate", "--model", str(model), *SMALL, "--ignore-eos", "--json", "--logprobs", "2", "def f")
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["num_tokens"] == 3  # max_new_tokens
    assert len(record["logprobs"]) == 3 and all(row["rank"] == 1 for row in record["logprobs"])  # greedy
    assert all(len(row["top_logprobs"]) == 2 for row in record["logprobs"])
    # an explicit flag wins; --generation-config vllm falls back to SamplingParams' max_tokens=16
    assert json.loads(cli("generate", "--model", str(model), *SMALL, "--ignore-eos", "--json", "--max-tokens", "5",
                          "def f").stdout)["num_tokens"] == 5
    assert json.loads(cli("generate", "--model", str(model), *SMALL, "--ignore-eos", "--json",
                          "--generation-config", "vllm", "def f").stdout)["num_tokens"] == 16


def test_every_command_takes_num_threads() -> None:
    from pagedllm.entrypoints.cli import build_parser

    parser = build_parser()
    for argv in (["generate"], ["serve"], ["plan"], ["bench", "throughput"], ["bench", "latency"],
                 ["bench", "spec-decode"], ["bench", "prefix-caching"], ["bench", "kv-cache-snapshot"],
                 ["bench", "mla"], ["bench", "quantization"], ["bench", "structured-output"],
                 ["bench", "prepack"]):
        assert parser.parse_args([*argv, "--num-threads", "1"]).num_threads == 1, argv
    args = parser.parse_args(["serve", "--model", "dir", "--trust-remote-code", "--disable-log-requests",
                              "--generation-config", "vllm"])
    assert (args.model, args.trust_remote_code, args.disable_log_requests, args.generation_config) == (
        "dir", True, True, "vllm")


def test_help_shows_each_default_once_and_claims_no_hub_ids() -> None:
    result = cli("serve", "--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    assert "Hugging Face id" not in text
    assert text.count("(default: 8000)") == 1 and text.count("default: $PAGEDLLM_API_KEY") == 1
    assert "(default: $PAGEDLLM_API_KEY, else open) (default" not in text
    assert "(default: auto)" in text  # flags without help text still show their default


@pytest.mark.slow
def test_bench_spec_decode_takes_num_threads_and_several_k(tmp_path: Path) -> None:
    report = tmp_path / "spec.json"
    result = cli("bench", "spec-decode", "--num-threads", "1", "--num-prompts", "1", "--input-len", "32",
                 "--output-len", "4", "--methods", "ngram", "--workloads", "code", "--modes", "greedy",
                 "--batch-size", "0", "--dtype", "float32", "-k", "1", "3", "--output-json", str(report))
    assert result.returncode == 0, result.stderr
    rows = json.loads(report.read_text())["results"]
    assert [(r["method"], r["num_speculative_tokens"]) for r in rows] == [("plain", 0), ("ngram", 1), ("ngram", 3)]
    assert cli("bench", "spec-decode", "-k", "0").returncode != 0


def test_serve_logs_requests_and_periodic_stats(tiny_llama_dir: str, tmp_path: Path) -> None:
    from test_server import RemoteServer

    server = RemoteServer(tiny_llama_dir, tmp_path, extra_args=["--num-threads", "1"])
    try:
        client = server.client()
        client.completions.create(model="tiny", prompt="def f", max_tokens=4, temperature=0)
        deadline = time.monotonic() + 60
        while "Avg generation throughput" not in server.log() and time.monotonic() < deadline:
            time.sleep(0.1)  # the stats line is written by the engine thread as it goes idle
        log = server.log()
        assert "Received request cmpl-" in log and "prompt tokens" in log
        assert "Avg prompt throughput" in log and "Running: 0 reqs" in log and "KV cache usage" in log
    finally:
        assert server.terminate() == 0, server.log()
    quiet = RemoteServer(tiny_llama_dir, tmp_path, extra_args=["--num-threads", "1", "--disable-log-requests"])
    try:
        quiet.client().completions.create(model="tiny", prompt="def f", max_tokens=2, temperature=0)
        assert "Received request" not in quiet.log()
    finally:
        assert quiet.terminate() == 0, quiet.log()


def test_python_dash_m_pagedllm_is_the_pagedllm_command() -> None:
    """`python -m pagedllm ...` works where the console script is not on PATH (issue 19)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    via_module = subprocess.run([sys.executable, "-m", "pagedllm", "serve", "--help"], capture_output=True,
                                text=True, timeout=300, cwd=ROOT, env=env)
    assert via_module.returncode == 0, via_module.stderr
    assert via_module.stdout == cli("serve", "--help").stdout
    bad = subprocess.run([sys.executable, "-m", "pagedllm", "no-such-command"], capture_output=True, text=True,
                         timeout=300, cwd=ROOT, env=env)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


def test_a_sub_command_missing_a_package_leaves_the_others_working(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A partial install (the server's packages missing, say) still benches and plans; the command that
    needs the package says which one, in one line."""
    from pagedllm.entrypoints import cli

    (tmp_path / "needs_missing_package.py").write_text("import no_such_package_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli.SUBCOMMANDS, "fancy", "needs_missing_package")
    assert cli.main(["fancy", "--port", "8000"]) == 2
    assert "pagedllm fancy needs the package 'no_such_package_xyz'" in capsys.readouterr().err
    assert cli.main(["plan", "--model", "qwen2.5-0.5b", "--hardware", "cpu", "--context", "64"]) == 0
