"""Turns scheduler updates into RequestOutputs: detokenize, find stop strings, group parallel samples."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.request import Request
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams


@dataclass
class _SampleState:
    request: Request
    detokenizer: IncrementalDetokenizer | None
    num_processed_tokens: int = 0
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_decoded_logprobs: int = 0


@dataclass
class RequestState:
    """One user request: one sample, or `n` samples forked from a shared prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    root: Request
    samples: dict[int, _SampleState] = field(default_factory=dict)
    num_decoded_prompt_logprobs: int = 0

    @property
    def finished(self) -> bool:
        return len(self.samples) == self.params.n and all(s.finish_reason for s in self.samples.values())


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add_request(self, request: Request) -> None:
        state = RequestState(request.request_id, request.prompt, request.prompt_token_ids,
                             request.sampling_params, request)
        self.states[request.request_id] = state
        if not request.is_fork_parent:
            self._add_sample(state, request)

    def _add_sample(self, state: RequestState, request: Request) -> None:
        params = request.sampling_params
        detok = None
        if params.detokenize and self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params.skip_special_tokens,
                                           params.spaces_between_special_tokens)
        state.samples[request.index] = _SampleState(request, detok)

    def add_forked(self, children: list[Request]) -> None:
        for child in children:
            state = self.states.get(child.parent_id)
            if state is not None:
                self._add_sample(state, child)

    def group_id(self, request: Request) -> str:
        return request.parent_id or request.request_id

    def process(self, updated: list[Request]) -> tuple[list[RequestOutput], list[Request]]:
        """Returns the outputs of requests that changed, and samples stopped by a stop string (which
        the engine must finish in the scheduler)."""
        stopped: list[Request] = []
        changed: dict[str, RequestState] = {}
        for request in updated:
            state = self.states.get(self.group_id(request))
            if state is None:
                continue
            sample = state.samples[request.index]
            if sample.finish_reason:
                continue
            new_tokens = request.output_token_ids[sample.num_processed_tokens:]
            sample.num_processed_tokens = len(request.output_token_ids)
            if sample.detokenizer is not None:
                old_len = len(sample.detokenizer.text)
                sample.detokenizer.add_tokens(new_tokens)
                if self._check_stop_strings(sample, old_len):
                    stopped.append(request)
            if not sample.finish_reason and request.is_finished:
                sample.finish_reason = request.status.finish_reason
                sample.stop_reason = request.stop_reason
            changed[state.request_id] = state
        outputs = [self._make_output(state) for state in changed.values()]
        for state in changed.values():
            if state.finished:
                del self.states[state.request_id]
        return outputs, stopped

    def _check_stop_strings(self, sample: _SampleState, old_len: int) -> bool:
        params = sample.request.sampling_params
        text = sample.detokenizer.text
        if params.stop:
            for stop in params.stop:
                start = max(0, old_len - len(stop) + 1)
                index = text.find(stop, start)
                if index != -1:
                    end = index + len(stop) if params.include_stop_str_in_output else index
                    sample.detokenizer.text = text[:end]
                    sample.finish_reason = "stop"
                    sample.stop_reason = stop
                    return True
        return False

    def abort(self, request_id: str) -> RequestState | None:
        return self.states.pop(request_id, None)

    def _visible_text(self, sample: _SampleState) -> str:
        if sample.detokenizer is None:
            return ""
        text = sample.detokenizer.text
        params = sample.request.sampling_params
        # While running, hold back a possible start of a stop string so a stream never shows it.
        if not sample.finish_reason and params.stop and not params.include_stop_str_in_output:
            hold = max(len(s) for s in params.stop) - 1
            if hold > 0:
                text = text[:max(0, len(text) - hold)]
        return text

    def _make_output(self, state: RequestState) -> RequestOutput:
        completions = []
        for index in sorted(state.samples):
            sample = state.samples[index]
            request = sample.request
            logprobs = request.logprobs
            if logprobs is not None and sample.detokenizer is not None:
                for position in logprobs[sample.num_decoded_logprobs:]:
                    for token_id, logprob in position.items():
                        if logprob.decoded_token is None:
                            logprob.decoded_token = sample.detokenizer.decode_token(token_id)
                sample.num_decoded_logprobs = len(logprobs)
            completions.append(CompletionOutput(
                index=index,
                text=self._visible_text(sample),
                token_ids=list(request.output_token_ids),
                cumulative_logprob=request.cumulative_logprob if logprobs is not None else None,
                logprobs=list(logprobs) if logprobs is not None else None,
                finish_reason=sample.finish_reason,
                stop_reason=sample.stop_reason,
            ))
        prompt_logprobs = state.root.prompt_logprobs
        if prompt_logprobs is not None and self.tokenizer is not None:
            # Prompt logprobs arrive during prefill; each position is decoded once, not every step.
            for position in prompt_logprobs[state.num_decoded_prompt_logprobs:]:
                for token_id, logprob in (position or {}).items():
                    if logprob.decoded_token is None:
                        logprob.decoded_token = self.tokenizer.decode([token_id])
            state.num_decoded_prompt_logprobs = len(prompt_logprobs)
        return RequestOutput(
            request_id=state.request_id, prompt=state.prompt, prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=list(prompt_logprobs) if prompt_logprobs is not None else None,
            outputs=completions, finished=state.finished, metrics=state.root.metrics,
            num_cached_tokens=max(0, state.root.num_cached_tokens),
            kv_transfer_params=state.root.kv_transfer_params_out if state.finished else None)
