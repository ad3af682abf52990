"""Turns the core's per-step token deltas into RequestOutputs, in the API process (vLLM V1's
OutputProcessor): incremental detokenization, stop strings, parallel samples, and output_kind.

The core sends each sample's new token ids and logprobs only (core.py). Here they are appended to the
sample's lists, decoded, and shaped by the request's output_kind: CUMULATIVE copies everything so far
into each output, DELTA hands out only what is new (a stream's work per token stays flat however long
the output grows), FINAL_ONLY makes one output at the end (and, without stop strings, decodes the text
only then: the text the incremental decode gives, in one call rather than one every step). A
stop string is found here, so the samples it ends are returned to the caller, which tells the core to
stop them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedllm.core_types.engine_core import EngineCoreOutput, engine_request_id
from pagedllm.engine.detokenizer import IncrementalDetokenizer, prepare_detokenizer
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import CompletionOutput, PositionLogprobs, RequestMetrics, RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class _SampleState:
    index: int
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # DELTA: how much of the text and tokens earlier outputs carried, and whether the end was sent
    num_sent_chars: int = 0
    num_sent_tokens: int = 0
    sent_finish: bool = False
    num_detokenized: int = 0  # tokens fed to the detokenizer so far


@dataclass
class RequestState:
    """One user request: one sample, or `n` samples forked from a shared prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    samples: dict[int, _SampleState] = field(default_factory=dict)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    sent_prompt_logprobs: bool = False
    num_cached_tokens: int = 0
    kv_transfer_params: dict | None = None  # disaggregated prefill: sent with the final output
    lora_request: LoRARequest | None = None

    @property
    def finished(self) -> bool:
        if len(self.samples) != self.params.n:
            return False
        for sample in self.samples.values():  # a loop, not all(generator): asked for every output every step
            if not sample.finish_reason:
                return False
        return True


class OutputProcessor:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}
        if tokenizer is not None:
            prepare_detokenizer(tokenizer)  # a byte-level vocabulary's table now, not in the first request

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float, lora_request: LoRARequest | None = None) -> None:
        state = self.states[request_id] = RequestState(request_id, prompt, prompt_token_ids, params,
                                                       RequestMetrics(arrival_time=arrival_time),
                                                       lora_request=lora_request)
        if params.n == 1:
            # Its one sample, detokenizer and all, now (as vLLM builds a request's detokenizer when it is
            # added) rather than with its first output: a final-only output's first output is its last,
            # so a batch ending together decoded every prompt's context in its last step. With n > 1 a
            # sample appears with its first output (a cumulative output lists the samples begun).
            self._sample(state, 0)

    def abort(self, request_id: str) -> RequestState | None:
        return self.states.pop(request_id, None)

    def _sample(self, state: RequestState, index: int) -> _SampleState:
        sample = state.samples.get(index)
        if sample is None:
            params = state.params
            detok = None
            if params.detokenize and self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, state.prompt_token_ids, params.skip_special_tokens,
                                               params.spaces_between_special_tokens)
            sample = _SampleState(index, detok, logprobs=[] if params.logprobs is not None else None)
            state.samples[index] = sample
        return sample

    def process_outputs(self, core_outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """The RequestOutputs this step makes (per output_kind), and the scheduler ids of samples a
        stop string ended (the core must stop them)."""
        stopped: list[str] = []
        outputs: list[RequestOutput] = []
        changed: dict[str, RequestState] = {}  # requests with parallel samples: one output for all of them
        for core_output in core_outputs:
            state = self.states.get(core_output.request_id)
            if state is None:
                continue  # aborted meanwhile
            sample = state.samples.get(core_output.index) or self._sample(state, core_output.index)
            if sample.finish_reason:
                continue  # a stop string ended it before the core heard of it
            state.num_cached_tokens = core_output.num_cached_tokens
            if (core_output.metrics is not None or core_output.prompt_logprobs is not None
                    or core_output.kv_transfer_params is not None):  # a sample's first and last outputs
                self._update_request(state, core_output)
            params = state.params
            new_token_ids, new_logprobs = core_output.new_token_ids, core_output.new_logprobs
            cumulative_logprob = core_output.cumulative_logprob
            held = held_logprob = None
            if (core_output.finish_reason == "stop" and not isinstance(core_output.stop_reason, str)
                    and new_token_ids and sample.detokenizer is not None and not params.include_stop_str_in_output):
                # As vLLM: the stop token (EOS or a stop id) that ends the sample is among its tokens, not
                # in its text (unless include_stop_str_in_output); it joins them after the text is made.
                held, new_token_ids = new_token_ids[-1], new_token_ids[:-1]
                if new_logprobs is not None:
                    held_logprob, new_logprobs = new_logprobs[-1], new_logprobs[:-1]
            if params.stop and len(new_token_ids) > 1 and sample.detokenizer is not None:
                # Several tokens in one step (speculative decoding): a stop string may end the sample before
                # the last of them. What follows it is no part of the output, as with a token a step.
                for i in range(len(new_token_ids)):
                    old_len = sample.detokenizer.text_len
                    sample.token_ids.append(new_token_ids[i])
                    self._detokenize(sample)
                    if self._check_stop_strings(params, sample, old_len):
                        if cumulative_logprob is not None and new_logprobs is not None:
                            cumulative_logprob -= sum(position[token].logprob for position, token in zip(
                                new_logprobs[i + 1:], new_token_ids[i + 1:]))
                        new_token_ids = new_token_ids[:i + 1]
                        new_logprobs = new_logprobs[:i + 1] if new_logprobs is not None else None
                        stopped.append(engine_request_id(state.request_id, sample.index, params.n))
                        break
            else:
                sample.token_ids.extend(new_token_ids)
            if sample.logprobs is not None and new_logprobs is not None:
                self._decode_logprobs(new_logprobs, sample.detokenizer)
                sample.logprobs.extend(new_logprobs)
            sample.cumulative_logprob = cumulative_logprob
            # The text is needed now only to look for a stop string or to show it before the end; else
            # it is decoded once the sample ends (the same incremental decode, in one warm loop).
            if sample.detokenizer is not None and not sample.finish_reason and (
                    params.stop or params.output_kind is not RequestOutputKind.FINAL_ONLY):
                old_len = sample.detokenizer.text_len
                self._detokenize(sample)
                if params.stop and self._check_stop_strings(params, sample, old_len):
                    stopped.append(engine_request_id(state.request_id, sample.index, params.n))
            if held is not None:
                if sample.finish_reason:  # a stop string ended the sample before it
                    if cumulative_logprob is not None and held_logprob is not None:
                        sample.cumulative_logprob = cumulative_logprob - held_logprob[held].logprob
                else:
                    self._detokenize(sample)
                    sample.token_ids.append(held)
                    sample.num_detokenized += 1
                    if sample.logprobs is not None and held_logprob is not None:
                        self._decode_logprobs([held_logprob], sample.detokenizer)
                        sample.logprobs.append(held_logprob)
            if not sample.finish_reason and core_output.finish_reason:
                sample.finish_reason = core_output.finish_reason
                sample.stop_reason = core_output.stop_reason
            if params.n > 1:
                changed[state.request_id] = state
            else:  # one sample: its output now
                self._output(state, sample.finish_reason is not None, outputs)
        for state in changed.values():
            self._output(state, state.finished, outputs)
        return outputs, stopped

    def _output(self, state: RequestState, finished: bool, outputs: list[RequestOutput]) -> None:
        """Add the request's output for this step, if its output_kind makes one; forget it once finished."""
        output = self._make_output(state, finished)
        if output is not None:
            outputs.append(output)
        if finished:
            del self.states[state.request_id]

    def _update_request(self, state: RequestState, core_output: EngineCoreOutput) -> None:
        """What a sample's first and last outputs bring: prompt logprobs, the core's timings, KV transfer
        parameters."""
        if core_output.kv_transfer_params is not None:
            state.kv_transfer_params = core_output.kv_transfer_params
        if core_output.prompt_logprobs is not None and state.prompt_logprobs is None:
            # Prompt logprobs arrive with the first token; each position is decoded once.
            state.prompt_logprobs = core_output.prompt_logprobs
            if self.tokenizer is not None:
                for position in state.prompt_logprobs:
                    for token_id, logprob in (position or {}).items():
                        if logprob.decoded_token is None:
                            logprob.decoded_token = self.tokenizer.decode([token_id])
        core_metrics = core_output.metrics
        if core_metrics is not None:  # the core's clock: scheduling, first token, end, preemptions
            metrics = state.metrics
            metrics.first_scheduled_time = metrics.first_scheduled_time or core_metrics.first_scheduled_time
            metrics.first_token_time = metrics.first_token_time or core_metrics.first_token_time
            metrics.last_token_time = core_metrics.last_token_time
            metrics.finished_time = core_metrics.finished_time
            metrics.num_preemptions = max(metrics.num_preemptions, core_metrics.num_preemptions)

    @staticmethod
    def _detokenize(sample: _SampleState) -> None:
        """Feed the detokenizer the sample's tokens it has not seen (the text is the same as if each had
        been fed as it was sampled)."""
        detokenizer, token_ids = sample.detokenizer, sample.token_ids
        if detokenizer is None:
            return
        start = sample.num_detokenized
        if len(token_ids) == start + 1:
            detokenizer.add_token(token_ids[start])
        elif len(token_ids) > start:
            detokenizer.add_tokens(token_ids[start:])
        sample.num_detokenized = len(token_ids)

    @staticmethod
    def _decode_logprobs(positions: list[PositionLogprobs], detokenizer: IncrementalDetokenizer | None) -> None:
        if detokenizer is None:
            return
        for position in positions:
            for token_id, logprob in position.items():
                if logprob.decoded_token is None:
                    logprob.decoded_token = detokenizer.decode_token(token_id)

    @staticmethod
    def _check_stop_strings(params: SamplingParams, sample: _SampleState, old_len: int) -> bool:
        """Whether the text since old_len completes a stop string (then the sample ends there). Not before
        min_tokens tokens, as vLLM: a stop string inside them is text like any other."""
        if not params.stop or len(sample.token_ids) <= params.min_tokens:
            return False
        detokenizer = sample.detokenizer
        longest = max(len(stop) for stop in params.stop)
        window_start = max(0, old_len - longest + 1)
        window = detokenizer.text_from(window_start)  # only the text a new stop string can touch
        for stop in params.stop:
            index = window.find(stop, max(0, old_len - len(stop) + 1) - window_start)
            if index != -1:
                end = window_start + index + (len(stop) if params.include_stop_str_in_output else 0)
                detokenizer.truncate(end)
                sample.finish_reason = "stop"
                sample.stop_reason = stop
                return True
        return False

    @staticmethod
    def _visible_len(params: SamplingParams, sample: _SampleState) -> int:
        text_len = sample.detokenizer.text_len if sample.detokenizer is not None else 0
        # While running, hold back a possible start of a stop string so a stream never shows it.
        if not sample.finish_reason and params.stop and not params.include_stop_str_in_output:
            hold = max(len(s) for s in params.stop) - 1
            return max(0, text_len - hold)
        return text_len

    def _make_output(self, state: RequestState, finished: bool) -> RequestOutput | None:
        kind = state.params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind is RequestOutputKind.DELTA
        completions = []
        for index in sorted(state.samples):
            sample = state.samples[index]
            self._detokenize(sample)
            visible_len = self._visible_len(state.params, sample)
            if delta:
                completion = self._delta_completion(sample, visible_len)
                if completion is None:
                    continue
            else:
                text = sample.detokenizer.text[:visible_len] if sample.detokenizer is not None else ""
                completion = CompletionOutput(
                    index=index, text=text, token_ids=list(sample.token_ids),
                    cumulative_logprob=sample.cumulative_logprob,
                    logprobs=list(sample.logprobs) if sample.logprobs is not None else None,
                    finish_reason=sample.finish_reason, stop_reason=sample.stop_reason)
            completions.append(completion)
        prompt_logprobs = state.prompt_logprobs
        if delta:  # sent once, with the first output
            prompt_logprobs = None if state.sent_prompt_logprobs else prompt_logprobs
            state.sent_prompt_logprobs = state.sent_prompt_logprobs or prompt_logprobs is not None
        elif prompt_logprobs is not None:
            prompt_logprobs = list(prompt_logprobs)
        return RequestOutput(
            request_id=state.request_id, prompt=state.prompt, prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=prompt_logprobs, outputs=completions, finished=finished, metrics=state.metrics,
            num_cached_tokens=state.num_cached_tokens,
            kv_transfer_params=state.kv_transfer_params if finished else None, lora_request=state.lora_request)

    @staticmethod
    def _delta_completion(sample: _SampleState, visible_len: int) -> CompletionOutput | None:
        """What the sample gained since its last output, or None if nothing (not even its end)."""
        num_tokens = len(sample.token_ids)
        ends_now = sample.finish_reason is not None and not sample.sent_finish
        if num_tokens == sample.num_sent_tokens and visible_len <= sample.num_sent_chars and not ends_now:
            return None
        text = ""
        if sample.detokenizer is not None and visible_len > sample.num_sent_chars:
            text = sample.detokenizer.text_from(sample.num_sent_chars)[:visible_len - sample.num_sent_chars]
        start = sample.num_sent_tokens
        completion = CompletionOutput(
            index=sample.index, text=text, token_ids=sample.token_ids[start:],
            cumulative_logprob=sample.cumulative_logprob,
            logprobs=sample.logprobs[start:] if sample.logprobs is not None else None,
            finish_reason=sample.finish_reason, stop_reason=sample.stop_reason)
        sample.num_sent_chars = max(sample.num_sent_chars, visible_len)
        sample.num_sent_tokens = num_tokens
        sample.sent_finish = sample.finish_reason is not None
        return completion
