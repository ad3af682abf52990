"""Async scheduling (`async_scheduling=True`): the engine plans step N+1 while the worker process runs
step N, and nothing a user sees may change.

The same workload (greedy, seeded sampling, penalties, logprobs, prompt logprobs, stop tokens hit while
the next step is already running, stop strings, parallel samples, a grammar, a shared prefix) gives the
same tokens, texts and logprobs as the synchronous in-process engine, with plenty of KV blocks and with
so few that requests are preempted; a request aborted while its steps are in flight leaves the others
alone; afterwards no block is held, in the engine or in the worker's copies of the requests.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import pytest
from test_server import RemoteServer
from test_server_load import wait_until
from tiny_models import metric_values, random_prompts

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import GuidedDecodingParams

VOCAB = 512  # tiny_llama_dir's BPE vocabulary
MAX_MODEL_LEN = 256


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = random_prompts(20, VOCAB, seed=11)
    shared = random_prompts(1, VOCAB, [37], seed=12)[0]
    prompts += [shared + suffix for suffix in random_prompts(4, VOCAB, [0, 3, 16, 20], seed=13)]
    params = []
    for i in range(len(prompts)):
        kind = i % 6
        common = dict(max_tokens=3 + (7 * i) % 23, seed=i)
        if kind == 0:
            p = SamplingParams(temperature=0.0, **common)
        elif kind == 1:
            p = SamplingParams(temperature=0.9, top_p=0.8, top_k=40, **common)
        elif kind == 2:  # stops on a common token, so some requests stop while their next step runs
            p = SamplingParams(temperature=1.0, stop_token_ids=list(range(10, 200)), min_tokens=2, **common)
        elif kind == 3:
            p = SamplingParams(temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5, logprobs=2,
                               **common)
        elif kind == 4:
            p = SamplingParams(temperature=0.0, prompt_logprobs=1, stop=["e", " t"], **common)
        else:
            p = SamplingParams(temperature=1.0, n=2, **common)
        params.append(p)
    # a grammar: the whole engine plans step by step while it runs
    params[7] = SamplingParams(temperature=0.0, max_tokens=12,
                               guided_decoding=GuidedDecodingParams(regex="(ab|cd)+[0-9]"))
    return prompts, params


def logprob_items(position) -> list[tuple[int, float]] | None:  # type: ignore[no-untyped-def]
    return None if position is None else sorted((t, v.logprob) for t, v in position.items())


def summary(llm: LLM) -> list:
    """Per request: each sample's (tokens, text, finish and stop reason), and every logprob in order."""
    prompts, params = workload()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    result = []
    for out in outputs:
        samples = [(list(c.token_ids), c.text, c.finish_reason, c.stop_reason) for c in out.outputs]
        logprobs = [logprob_items(p) for p in out.prompt_logprobs or []]
        logprobs += [logprob_items(p) for c in out.outputs for p in c.logprobs or []]
        result.append((samples, logprobs))
    return result


def assert_same_logprobs(got: list, want: list) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert (a is None) == (b is None)
        if a is not None:
            assert [t for t, _ in a] == [t for t, _ in b]
            assert all(math.isclose(x, y, abs_tol=1e-4) for (_, x), (_, y) in zip(a, b))


def assert_nothing_held(llm: LLM) -> None:
    metrics = metric_values(llm)
    assert metrics["pagedllm:kv_cache_free_blocks"] == metrics["pagedllm:kv_cache_total_blocks"]
    assert metrics["pagedllm:num_requests_running"] == metrics["pagedllm:num_requests_waiting"] == 0
    engine = llm.llm_engine
    assert not engine.engine_core._in_flight
    live = engine.model_executor.collective_rpc("live_request_ids")
    assert not any(live), live  # every rank has dropped its copies


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: str) -> tuple[list, float]:
    """The synchronous in-process engine's outputs, and the generated tokens its metrics count."""
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=16)
    try:
        return summary(llm), metric_values(llm)["pagedllm:generation_tokens"]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("num_blocks", [None, 12])
def test_async_scheduling_changes_no_output(tiny_llama_dir: str, reference: tuple[list, float],
                                            num_blocks: int | None) -> None:
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=16,
              async_scheduling=True, num_gpu_blocks_override=num_blocks)
    try:
        plans = {"ahead": 0, "after": 0}
        scheduler = llm.llm_engine.engine_core.scheduler
        schedule = scheduler.schedule

        def counted(ahead: bool = False):  # type: ignore[no-untyped-def]
            plans["ahead" if ahead else "after"] += 1
            return schedule(ahead)

        scheduler.schedule = counted
        got = summary(llm)
        assert plans["ahead"] > plans["after"], plans  # most steps were planned while another ran
        if num_blocks is not None:
            assert scheduler.num_preemptions > 0
        want, num_generated = reference
        assert [g[0] for g in got] == [r[0] for r in want]
        for g, w in zip(got, want):
            assert_same_logprobs(g[1], w[1])
        # the tokens of requests that ended while their next step ran were dropped, and are not counted
        assert metric_values(llm)["pagedllm:generation_tokens"] == num_generated
        assert_nothing_held(llm)
    finally:
        llm.shutdown()


def test_abort_while_steps_are_in_flight(tiny_llama_dir: str) -> None:
    prompts = random_prompts(4, VOCAB, seed=21)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    alone = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=MAX_MODEL_LEN)
    try:
        want = [list(o.outputs[0].token_ids) for o in
                alone.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    finally:
        alone.shutdown()
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, async_scheduling=True)
    try:
        engine = llm.llm_engine
        for i, p in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": p}, params)
        finished = {}
        for step in range(200):
            if step == 3:
                assert engine.engine_core._in_flight  # the next step is already running
                engine.abort_request(["1"])
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
            if not engine.has_unfinished_requests():
                break
        assert "1" not in finished or finished["1"].outputs[0].finish_reason == "abort"
        for i in (0, 2, 3):
            assert list(finished[str(i)].outputs[0].token_ids) == want[i]
        assert_nothing_held(llm)
    finally:
        llm.shutdown()


def test_a_parallel_sampling_request_is_admitted_while_others_run(tiny_llama_dir: str) -> None:
    """A request with n > 1 is one request per sample, which plans made ahead admit as any other: it is
    admitted at once, not when the running requests end."""
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, async_scheduling=True)
    try:
        engine = llm.llm_engine
        long = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
        for i, p in enumerate(random_prompts(2, VOCAB, seed=31)):
            engine.add_request(f"long{i}", {"prompt_token_ids": p}, long)
        for _ in range(3):
            engine.step()
        engine.add_request("pair", {"prompt_token_ids": random_prompts(1, VOCAB, seed=32)[0]},
                           SamplingParams(temperature=1.0, n=2, max_tokens=4, seed=0))
        scheduler = engine.engine_core.scheduler
        finished = set()
        for _ in range(12):
            finished |= {out.request_id for out in engine.step() if out.finished}
        assert "pair" in finished and not finished & {"long0", "long1"}
        assert not any(r.request_id == "pair" for r in scheduler.waiting)
        while engine.has_unfinished_requests():
            engine.step()
        assert_nothing_held(llm)
    finally:
        llm.shutdown()


def test_async_scheduling_refuses_what_it_cannot_overlap(tiny_llama_dir: str) -> None:
    with pytest.raises(ValueError, match="async_scheduling"):
        LLM(model=tiny_llama_dir, async_scheduling=True, distributed_executor_backend="uni")
    with pytest.raises(ValueError, match="async_scheduling"):
        LLM(model=tiny_llama_dir, async_scheduling=True,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2})


@pytest.mark.slow
def test_async_scheduling_with_two_ranks(tiny_llama_dir: str, reference: tuple[list, float]) -> None:
    """Every rank appends rank 0's sampled tokens (broadcast), so tensor parallelism overlaps too."""
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=16,
              async_scheduling=True, tensor_parallel_size=2)
    try:
        got = summary(llm)
        assert [g[0] for g in got] == [r[0] for r in reference[0]]
        assert_nothing_held(llm)
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_server_with_async_scheduling(tiny_llama_dir: str, tmp_path) -> None:
    """`pagedllm serve --async-scheduling` through the openai client: concurrent completions and a stream
    equal the offline engine's, and every block is free afterwards."""
    prompts = ["def fibonacci(n):", "Hello, world! How are", "import heapq\n", "class Counter:"] * 3
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=256, seed=0)
    try:
        want = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20),
                                                          use_tqdm=False)]
    finally:
        llm.shutdown()
    server = RemoteServer(tiny_llama_dir, tmp_path, extra_args=["--async-scheduling"])
    try:
        client = server.client()

        def complete(prompt: str) -> str:
            response = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0.0)
            return response.choices[0].text

        with ThreadPoolExecutor(len(prompts)) as pool:
            assert list(pool.map(complete, prompts)) == want
        stream = client.completions.create(model="tiny", prompt=prompts[0], max_tokens=20, temperature=0.0,
                                           stream=True)
        assert "".join(chunk.choices[0].text for chunk in stream) == want[0]

        def all_free() -> bool:
            metrics = server.metrics()
            return (metrics["pagedllm:kv_cache_free_blocks"] == metrics["pagedllm:kv_cache_total_blocks"]
                    and metrics["pagedllm:num_requests_running"] == 0)

        wait_until(all_free, 60, "every KV block free")
        assert server.terminate() == 0, server.log()
    finally:
        if server.proc.poll() is None:
            server.terminate()


def test_plan_travels_compact_and_arrives_whole() -> None:
    """What reaches a worker: a plan's columns that say nothing travel as None, and its request ids as None
    when they are the previous plan's. The worker's InputBatch rebuilds the same plan over its own request
    states, whose tokens (the prompt from the plan, the sampled ones appended by the worker itself) equal
    the engine's."""
    from pagedllm.core_types.scheduler_output import ScheduledRequest, SchedulerOutput
    from pagedllm.engine.request import Request
    from pagedllm.worker.input_batch import InputBatch
    from pagedllm.worker.request_state import SchedulerOutputEncoder

    requests = [Request(f"r{i}", [5, 6, 7 + i], SamplingParams(max_tokens=8)) for i in range(3)]

    def plan(items: list[tuple[Request, int, int, bool, list[int]]]) -> SchedulerOutput:
        return SchedulerOutput.of([ScheduledRequest(r, n, start, [], sample, spec)
                                   for r, n, start, sample, spec in items],
                                  num_batched_tokens=sum(n for _, n, *_ in items))

    encoder, batch = SchedulerOutputEncoder(), InputBatch(max_num_reqs=2, max_model_len=16, max_blocks_per_req=4)
    by_id = {r.request_id: r for r in requests}
    # each step's plan, made from the engine's requests, and the tokens it samples (which the engine and
    # the worker each append: none travels in the next plan)
    steps = [(lambda: plan([(r, 3, 0, True, []) for r in requests]), {r.request_id: [100] for r in requests}),
             (lambda: plan([(r, 1, 3, True, []) for r in requests]), {"r0": [101]}),
             (lambda: plan([(requests[0], 1, 4, True, [])]), {"r0": [102]}),
             (lambda: plan([(requests[0], 3, 5, True, [7, 8])]), {"r0": [7, 103]})]
    sent = []
    for make_plan, sampled in steps:
        step = make_plan()
        message = encoder.encode(step)
        sent.append(message.scheduled)
        batch.update(message)
        rebuilt = batch.plan(message.scheduled)
        assert [(s.request.request_id, s.num_new_tokens, s.start_pos, s.sample, s.spec_token_ids)
                for s in rebuilt] == \
               [(s.request.request_id, s.num_new_tokens, s.start_pos, s.sample, s.spec_token_ids)
                for s in step.scheduled]
        for s in rebuilt:
            assert s.request.all_token_ids == s.request.prompt_token_ids + by_id[s.request.request_id].output_token_ids
            row = batch.block_tables.row_of[s.request.request_id]
            assert batch.token_ids[row, :len(s.request.all_token_ids)].tolist() == s.request.all_token_ids
        batch.append_sampled([sampled.get(request.request_id, []) for request in step.requests])  # the plan's order
        for request_id, tokens in sampled.items():
            for token in tokens:
                by_id[request_id].append_output_token(token)
    assert sent[0].request_ids is not None and sent[1].request_ids is None and sent[2].request_ids == ["r0"]
    assert sent[1].spec_token_ids is None and sent[1].sample is None and sent[3].spec_token_ids == [[7, 8]]

