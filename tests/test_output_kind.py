"""vLLM's output_kind (issue 19): CUMULATIVE, DELTA and FINAL_ONLY outputs of one request agree with each
other, and a DELTA stream's cost per token stays flat however long the output grows: the bytes the
engine core sends per step (as its process would serialise them) and the list entries each output
carries do not grow with the output length."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pagedllm import LLM, RequestOutputKind, SamplingParams
from pagedllm.core_types.engine_core import EngineCoreOutputs
from pagedllm.engine.async_engine import OutputQueue
from pagedllm.engine.core_proc import dumps
from pagedllm.outputs import CompletionOutput, RequestOutput

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: str) -> LLM:
    return LLM(model=tiny_llama_dir, dtype="float32", max_model_len=512, seed=0)


def run(llm: LLM, request_id: str, params: SamplingParams, prompt: Any = PROMPT) -> list[RequestOutput]:
    engine = llm.llm_engine
    engine.add_request(request_id, prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [output for output in engine.step() if output.request_id == request_id]
    return outputs


def joined(outputs: list[RequestOutput], index: int = 0) -> tuple[str, list[int], list[Any]]:
    text, token_ids, logprobs = "", [], []
    for output in outputs:
        for completion in output.outputs:
            if completion.index == index:
                text += completion.text
                token_ids += completion.token_ids
                logprobs += completion.logprobs or []
    return text, token_ids, logprobs


@pytest.mark.parametrize("extra", [{}, {"stop": True}, {"n": 2, "temperature": 1.0, "seed": 7}],
                         ids=["plain", "stop-string", "n=2"])
def test_output_kinds_agree(llm: LLM, extra: dict[str, Any]) -> None:
    base = {"max_tokens": 24, "temperature": 0.0, "logprobs": 2, "prompt_logprobs": 1, "ignore_eos": True, **extra}
    if "stop" in extra:  # a stop string the greedy output reaches in its middle
        [plain] = llm.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
                               use_tqdm=False)
        base["stop"] = [plain.outputs[0].text[10:13]]
    finals = run(llm, "final", SamplingParams(**base, output_kind=RequestOutputKind.FINAL_ONLY))
    assert len(finals) == 1 and finals[0].finished, "FINAL_ONLY: one output, at the end"
    final = finals[0]
    cumulative = run(llm, "cumulative", SamplingParams(**base))
    deltas = run(llm, "delta", SamplingParams(**base, output_kind=RequestOutputKind.DELTA))
    assert len(deltas) > 1 and deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    assert cumulative[-1].outputs == final.outputs
    for completion in final.outputs:
        text, token_ids, logprobs = joined(deltas, completion.index)
        assert (text, token_ids, logprobs) == (completion.text, completion.token_ids, completion.logprobs)
        previous = ""
        for output in cumulative:  # every cumulative output extends the one before
            current = next((c.text for c in output.outputs if c.index == completion.index), previous)
            assert current.startswith(previous)
            previous = current
    if "stop" in extra:
        assert final.outputs[0].finish_reason == "stop" and base["stop"][0] not in final.outputs[0].text
    # the prompt's logprobs come once in a DELTA stream, in every cumulative output
    assert deltas[0].prompt_logprobs == final.prompt_logprobs and final.prompt_logprobs is not None
    assert all(d.prompt_logprobs is None for d in deltas[1:])
    assert all(c.prompt_logprobs == final.prompt_logprobs for c in cumulative)


def test_delta_stream_cost_is_flat_in_the_output_length(llm: LLM) -> None:
    engine = llm.llm_engine
    core = engine.engine_core
    bytes_per_step: list[int] = []
    real_step = core.step

    def measured_step() -> Any:
        outputs = real_step()
        bytes_per_step.append(len(dumps(("outputs", EngineCoreOutputs(outputs, [], 0)))))
        return outputs

    core.step = measured_step  # type: ignore[method-assign]
    try:
        params = SamplingParams(max_tokens=240, temperature=0.0, ignore_eos=True, logprobs=5,
                                output_kind=RequestOutputKind.DELTA)
        deltas = run(llm, "long", params)
    finally:
        del core.step
    assert len(deltas) == 240 == len(bytes_per_step)  # one token per step, one output per step
    # each output carries the new token and its logprobs only, not the whole output so far
    assert all(len(d.outputs[0].token_ids) == 1 and len(d.outputs[0].logprobs) == 1 for d in deltas)
    # what the core sends per step does not grow: the last steps cost what the first ones did
    # (a cumulative message would grow by a token id and a logprob entry every step)
    early, late = bytes_per_step[1:41], bytes_per_step[-41:-1]
    assert max(late) <= max(early) + 16, (max(early), max(late))
    cumulative = run(llm, "long-cumulative", SamplingParams(max_tokens=240, temperature=0.0, ignore_eos=True))
    assert [len(c.outputs[0].token_ids) for c in cumulative] == list(range(1, 241))  # what DELTA avoids


def test_unread_delta_outputs_are_folded_into_one() -> None:
    def delta(text: str, token_ids: list[int], finished: bool = False) -> RequestOutput:
        return RequestOutput("r", None, [1], None, [CompletionOutput(0, text, token_ids, None, None,
                                                                     "length" if finished else None)], finished)

    async def scenario() -> list[Any]:
        queue = OutputQueue()
        for output in (delta("a", [1]), delta("b", [2]), delta("c", [3], finished=True)):
            queue.put("r", output, aggregate=True)
        return await queue.get_batch()

    [(request_id, output)] = asyncio.run(scenario())
    assert output.outputs[0].text == "abc" and output.outputs[0].token_ids == [1, 2, 3] and output.finished


def test_output_kind_must_be_a_request_output_kind() -> None:
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="delta")  # type: ignore[arg-type]


def test_final_only_core_output_comes_once(llm: LLM) -> None:
    """In-process, a FINAL_ONLY request without stop strings gets one core output, when it ends, with
    every token and logprob and the time of its first token; one with stop strings still gets a delta
    every step (the stop strings are looked for in the API process as the text grows)."""
    engine = llm.llm_engine
    base = dict(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1, output_kind=RequestOutputKind.FINAL_ONLY)
    core_outputs: list[list[Any]] = []
    step = engine.engine_core.step

    def recording_step() -> list[Any]:
        outputs = step()
        core_outputs.append(outputs)
        return outputs

    engine.engine_core.step = recording_step  # type: ignore[method-assign]
    try:
        [final] = run(llm, "deferred", SamplingParams(**base))
        per_step = [len(outputs) for outputs in core_outputs]
        core_outputs.clear()
        run(llm, "with-stop", SamplingParams(**base, stop=["never seen \x00"]))
        per_step_with_stop = [len(outputs) for outputs in core_outputs]
    finally:
        del engine.engine_core.step
    assert per_step == [0] * (len(per_step) - 1) + [1]
    assert per_step_with_stop == [1] * len(per_step_with_stop)
    completion = final.outputs[0]
    assert len(completion.token_ids) == 12 and len(completion.logprobs) == 12
    metrics = final.metrics
    assert metrics.first_token_time is not None and metrics.first_token_time < metrics.finished_time
