"""Tensor parallelism (issue 10): TP 2 and 4 over real gloo processes give TP 1's outputs.

Each model gets one LLM per tensor-parallel size, reused for every assertion (a worker process costs
seconds to start on a 2-core machine). The engine runs with chunked prefill (a 24-token budget), prefix
caching (prompts share a prefix) and a KV pool small enough to force preemption, so the sharded engine
walks every scheduling path; greedy and seeded sampled outputs must still equal TP 1's token for token.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from tiny_models import build_model, metric_values, perturbed_copy, random_prompts

from pagedllm import LLM, GuidedDecodingParams, SamplingParams
from pagedllm.executor.abstract import ExecutorDeadError

VOCAB = 512
MAX_TOKENS = 10
BLOCK_SIZE = 8
ENGINE_ARGS = dict(dtype="float32", block_size=BLOCK_SIZE, max_model_len=128, enable_chunked_prefill=True,
                   max_num_batched_tokens=24, enable_prefix_caching=True, num_gpu_blocks_override=14)


def make_prompts() -> list[list[int]]:
    shared = random_prompts(1, VOCAB, [20], seed=11)[0]
    return random_prompts(4, VOCAB, [5, 17, 30, 41], seed=12) + [shared + s for s in
                                                               random_prompts(3, VOCAB, [1, 9, 14], seed=13)]


PROMPTS = make_prompts()
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
SAMPLED = [SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=100 + i, max_tokens=MAX_TOKENS,
                          ignore_eos=True, n=2 if i == 1 else 1, repetition_penalty=1.2 if i == 2 else 1.0,
                          logprobs=2 if i == 3 else None, prompt_logprobs=1 if i == 3 else None)
           for i in range(len(PROMPTS))]


def run(llm: LLM) -> tuple[list[list[int]], list[list[list[int]]], list[float]]:
    """Greedy tokens, seeded sampled tokens (every sample of n=2), and the logprobs one request asked for."""
    greedy = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    outs = llm.generate(PROMPTS, SAMPLED, use_tqdm=False)
    sampled = [[list(c.token_ids) for c in o.outputs] for o in outs]
    logprobs = [lp[t].logprob for c in outs[3].outputs for t, lp in zip(c.token_ids, c.logprobs)]
    logprobs += [lp[t].logprob for t, lp in zip(outs[3].prompt_token_ids[1:], outs[3].prompt_logprobs[1:])]
    return greedy, sampled, logprobs


def check_against_tp1(model_dir: str, tp: int, num_kv_heads_total: int, then_raise: bool = False) -> None:
    reference_llm = LLM(model=model_dir, **ENGINE_ARGS)
    want_greedy, want_sampled, want_logprobs = run(reference_llm)
    base = reference_llm.llm_engine.model_executor.collective_rpc("shard_info")[0]
    llm = LLM(model=model_dir, tensor_parallel_size=tp, **ENGINE_ARGS)
    try:
        assert llm.llm_engine.parallel_config.distributed_executor_backend == "mp"
        greedy, sampled, logprobs = run(llm)
        assert greedy == want_greedy
        assert sampled == want_sampled
        # Sharded matmuls and the all-reduce sum in another order: about 4e-6 here (AVX2 AMD), but one CI run
        # on another CPU kind saw 1e-3 at TP 4 with every token equal, hence a relative bound as well.
        assert logprobs == pytest.approx(want_logprobs, rel=5e-4, abs=1e-4)
        metrics = metric_values(llm)
        assert metrics["pagedllm:num_preemptions"] > 0, "the pool should be small enough to preempt"
        assert metrics["pagedllm:prefix_cache_hits"] > 0
        assert metrics["pagedllm:kv_cache_free_blocks"] == metrics["pagedllm:kv_cache_total_blocks"]
        infos = llm.llm_engine.model_executor.collective_rpc("shard_info")
        assert [info["rank"] for info in infos] == list(range(tp))
        kv_heads = max(1, num_kv_heads_total // tp)
        replicated_kv = num_kv_heads_total < tp
        for info in infos:
            # Each rank's KV cache holds only its heads, for every block of the shared block table.
            assert info["num_kv_heads"] == kv_heads
            assert info["kv_cache_shape"] == (2, kv_heads, base["num_blocks"], BLOCK_SIZE,
                                              base["kv_cache_shape"][-1])
            if not replicated_kv:  # every sharded weight is split exactly N ways
                assert info["sharded_weight_bytes"] * tp == base["sharded_weight_bytes"]
            assert info["replicated_weight_bytes"] == base["replicated_weight_bytes"]
        if then_raise:  # a worker that raises fails the engine at once, naming the rank, and stops them all
            with pytest.raises(ExecutorDeadError, match=r"rank \d raised"):
                llm.llm_engine.model_executor.collective_rpc("no_such_method")
            assert _wait_gone([info["pid"] for info in infos], 10) == []
    finally:
        llm.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_gqa_kv_heads_split(tmp_path, tp: int) -> None:
    """8 query heads, 4 KV heads: at TP 2 and 4 each rank holds whole KV heads of its own."""
    model = build_model(tmp_path / "gqa", "llama", hidden_size=64, num_attention_heads=8, num_key_value_heads=4,
                        seed=21)
    check_against_tp1(model, tp, num_kv_heads_total=4)


@pytest.mark.slow
def test_mqa_kv_head_replicated(tmp_path) -> None:
    """One KV head and 4 ranks: the KV head is replicated on every rank (as vLLM does)."""
    model = build_model(tmp_path / "mqa", "llama", num_attention_heads=4, num_key_value_heads=1, seed=22)
    check_against_tp1(model, 4, num_kv_heads_total=1)


@pytest.mark.slow
def test_qwen2_bias_and_tied_embeddings(tiny_qwen2_dir: str) -> None:
    check_against_tp1(tiny_qwen2_dir, 2, num_kv_heads_total=2, then_raise=True)


def test_heads_not_divisible_is_a_value_error(tiny_llama_dir: str) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(model=tiny_llama_dir, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        LLM(model=tiny_llama_dir, tensor_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(ValueError, match="tensor_parallel_size"):  # a rank would split a quantization group
        LLM(model=tiny_llama_dir, tensor_parallel_size=2, quantization="int8", quantization_group_size=64)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes (its parent has not reaped it yet).
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [pid for pid in pids if _alive(pid)]
        if not alive:
            return []
        time.sleep(0.2)
    return [pid for pid in pids if _alive(pid)]


@pytest.mark.slow
def test_killed_worker_fails_fast_and_leaves_no_process(tiny_llama_dir: str) -> None:
    llm = LLM(model=tiny_llama_dir, dtype="float32", tensor_parallel_size=2, max_model_len=128)
    pids = [info["pid"] for info in llm.llm_engine.model_executor.collective_rpc("shard_info")]
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(ExecutorDeadError, match="rank 1"):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    assert time.monotonic() - start < 30
    assert _wait_gone(pids, 10) == [], "every worker must be stopped once one is gone"
    with pytest.raises(ExecutorDeadError):  # the engine stays dead, it does not hang
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)


@pytest.mark.slow
def test_sigterm_of_the_engine_leaves_no_worker(tiny_llama_dir: str) -> None:
    """The engine's process is terminated: its workers follow. (A script that simply returns without
    shutdown() is covered by the two-node test below.)"""
    script = textwrap.dedent(f"""
        import sys, time
        from pagedllm import LLM, SamplingParams
        llm = LLM(model={tiny_llama_dir!r}, dtype="float32", tensor_parallel_size=2, max_model_len=128)
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
        pids = [i["pid"] for i in llm.llm_engine.model_executor.collective_rpc("shard_info")]
        print(" ".join(map(str, pids)), flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PAGEDLLM_LOGGING_LEVEL": "WARNING"})
    try:
        line = proc.stdout.readline()
        pids = [int(p) for p in line.split()]
        assert len(pids) == 2, line
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        assert _wait_gone(pids, 15) == []
    finally:
        proc.kill()
        proc.wait()


# --- speculative decoding under TP: the draft runs unsharded on rank 0 --------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("proposer", ["draft_model", "ngram"])
def test_speculative_decoding_with_tp2_equals_plain_tp1(tiny_llama_dir: str, tmp_path, proposer: str) -> None:
    prompts = PROMPTS + [[11, 12, 13, 14] * 6]  # a repetitive prompt, so n-gram lookups fire
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    # A grammar too: its bitmask travels with the plan and rank 0 masks the verified positions.
    guided = SamplingParams(temperature=0.0, max_tokens=16, guided_decoding=GuidedDecodingParams(
        regex=r"[a-z]{2,5}-[0-9]{3}"))
    plain = LLM(model=tiny_llama_dir, **ENGINE_ARGS)
    want = [list(o.outputs[0].token_ids) for o in plain.generate(prompts, params, use_tqdm=False)]
    want_guided = [o.outputs[0].text for o in plain.generate(prompts[:3], guided, use_tqdm=False)]
    if proposer == "draft_model":
        spec = dict(speculative_model=perturbed_copy(tiny_llama_dir, tmp_path / "draft", noise=0.03),
                    num_speculative_tokens=4)
    else:
        spec = dict(speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                                        "prompt_lookup_max": 3})
    llm = LLM(model=tiny_llama_dir, tensor_parallel_size=2, **ENGINE_ARGS, **spec)
    try:
        got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == want
        assert [o.outputs[0].text for o in llm.generate(prompts[:3], guided, use_tqdm=False)] == want_guided
        metrics = metric_values(llm)
        assert metrics["pagedllm:spec_decode_num_accepted_tokens"] > 0
        assert metrics["pagedllm:num_preemptions"] > 0
        assert metrics["pagedllm:kv_cache_free_blocks"] == metrics["pagedllm:kv_cache_total_blocks"]
    finally:
        llm.shutdown()


def _bundled_models_with_heads_divisible_by(tp: int) -> tuple[str, str] | None:
    from pagedllm.assets import demo_draft_path, demo_model_path
    from pagedllm.config import ModelConfig

    target = demo_model_path()
    if target is None:
        return None
    config = ModelConfig.from_pretrained(target)
    if config.num_attention_heads % tp or (config.num_key_value_heads % tp and tp % config.num_key_value_heads):
        return None
    return target, demo_draft_path()


@pytest.mark.slow
def test_seed_call_with_bundled_models() -> None:
    """The seed's own example: bundled target + draft, k 5, TP 4, fp8 KV cache; greedy output equals TP 1."""
    models = _bundled_models_with_heads_divisible_by(4)
    if models is None:
        pytest.skip("the bundled target's attention heads do not divide by 4 (tensor_parallel_size=4 needs "
                    "num_attention_heads % 4 == 0); retrained demo models with 8/4 heads make this run")
    target, draft = models
    # float32: the bundled models are bf16, and dtype="auto" computes in bf16 on CPUs with bf16 units, where
    # an all-reduce of four partial sums rounds differently from one whole matmul; equality across TP sizes
    # is a float32 property (the README says so).
    kwargs = dict(speculative_model=draft, num_speculative_tokens=5, kv_cache_dtype="fp8",
                  enable_chunked_prefill=True, max_num_batched_tokens=2048, enable_prefix_caching=True,
                  gpu_memory_utilization=0.92, block_size=16, dtype="float32")
    prompts = ["def fibonacci(n):", "import os\n\ndef read_lines(path):", "class Stack:\n    def __init__(self):"]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    want = [o.outputs[0].token_ids for o in LLM(model=target, tensor_parallel_size=1, **kwargs).generate(
        prompts, params, use_tqdm=False)]
    llm = LLM(model=target, tensor_parallel_size=4, **kwargs)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    finally:
        llm.shutdown()


# --- two hosts: network namespaces joined by a veth pair, one rank in each ----------------------------------


def _make_two_hosts(tag: str) -> tuple[list[str], str | None]:
    """Namespaces n0 (10.231.0.1) and n1 (10.231.0.2); returns (their names, why not if they cannot be made)."""
    import shutil

    if shutil.which("ip") is None:
        return [], "the `ip` command (iproute2) is not installed"
    names = [f"pgl{tag}n0", f"pgl{tag}n1"]
    veths = [f"pgl{tag}v0", f"pgl{tag}v1"]
    commands = [["ip", "netns", "add", names[0]], ["ip", "netns", "add", names[1]],
                ["ip", "link", "add", veths[0], "type", "veth", "peer", "name", veths[1]]]
    for i in range(2):
        commands += [["ip", "link", "set", veths[i], "netns", names[i]],
                     ["ip", "-n", names[i], "addr", "add", f"10.231.0.{i + 1}/24", "dev", veths[i]],
                     ["ip", "-n", names[i], "link", "set", veths[i], "up"],
                     ["ip", "-n", names[i], "link", "set", "lo", "up"]]
    for command in commands:
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            _remove_hosts(names)
            return [], f"cannot create network namespaces here ({' '.join(command)}: {done.stderr.strip()})"
    return names, None


def _remove_hosts(names: list[str]) -> None:
    for name in names:  # deleting a namespace deletes the veth end inside it, and so the pair
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


@pytest.mark.slow
def test_two_nodes_in_network_namespaces_equal_one_host(tiny_llama_dir: str) -> None:
    names, why_not = _make_two_hosts(str(os.getpid() % 100000))
    if why_not:
        pytest.skip(why_not)
    prompts = PROMPTS[:4]
    script = textwrap.dedent(f"""
        import json, sys
        from pagedllm import LLM, SamplingParams
        node_rank = int(sys.argv[1])
        llm = LLM(model={tiny_llama_dir!r}, tensor_parallel_size=2, nnodes=2, node_rank=node_rank,
                  dist_init_addr="10.231.0.1:29517", **{ENGINE_ARGS!r})
        if node_rank == 0:
            outs = llm.generate({prompts!r}, SamplingParams(temperature=0.0, max_tokens={MAX_TOKENS}, ignore_eos=True),
                                use_tqdm=False)
            pid = llm.llm_engine.model_executor.collective_rpc("shard_info")[0]["pid"]
            print(pid, json.dumps([list(o.outputs[0].token_ids) for o in outs]), flush=True)
            # no shutdown(): leaving the interpreter stops the workers, node 1's too
    """)
    procs = []
    try:
        for node_rank in (1, 0):
            env = {**os.environ, "GLOO_SOCKET_IFNAME": f"{names[node_rank][:-2]}v{node_rank}",
                   "PAGEDLLM_LOGGING_LEVEL": "WARNING"}
            procs.append(subprocess.Popen(["ip", "netns", "exec", names[node_rank], sys.executable, "-c", script,
                                           str(node_rank)], stdout=subprocess.PIPE, text=True, env=env))
        node0_out, _ = procs[1].communicate(timeout=300)
        assert procs[1].returncode == 0
        assert procs[0].wait(timeout=60) == 0, "node 1 exits once node 0 shuts its ranks down"
        want = [list(o.outputs[0].token_ids) for o in LLM(model=tiny_llama_dir, **ENGINE_ARGS).generate(
            prompts, GREEDY, use_tqdm=False)]
        import json

        pid, tokens = node0_out.strip().splitlines()[-1].split(" ", 1)
        assert json.loads(tokens) == want
        assert _wait_gone([int(pid)], 10) == []
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        _remove_hosts(names)
