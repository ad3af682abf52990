"""Multi-LoRA serving (issue 45): PEFT adapters on one base model, mixed in one batch.

The oracle is transformers + PEFT on the same random weights: adapters are made by
`get_peft_model(...).save_pretrained` with nonzero B, and each request's greedy tokens and per-step
logprobs must equal PEFT's for its own adapter (or the base model), whatever else shares the batch,
the prefix cache or the KV blocks.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from tiny_models import build_lora_adapter, build_model, hf_peft_greedy, metric_values, random_prompts

from pagedllm import LLM, LoRARequest, SamplingParams

pytest.importorskip("peft")

MAX_NEW_TOKENS = 8
LOGPROB_ATOL = 1e-4
TIE_GAP = 1e-4


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("lora")
    base = build_model(root / "base", "llama", seed=45)
    adapters = {
        # every projection, plain scaling
        "all": build_lora_adapter(base, root / "all", r=8, lora_alpha=16, seed=1),
        # attention only, at the rank limit, rsLoRA scaling
        "attn": build_lora_adapter(base, root / "attn", r=16, lora_alpha=8, use_rslora=True,
                                   target_modules=["q_proj", "v_proj", "o_proj"], seed=2),
        # MLP only, rank 4, weights stored in bf16
        "mlp": build_lora_adapter(base, root / "mlp", r=4, lora_alpha=32, target_modules=["gate_proj", "down_proj"],
                                  seed=3, dtype=torch.bfloat16),
    }
    return {"root": root, "base": base, "adapters": adapters,
            "requests": {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(adapters.items())}}


def make_llm(base: str, **kwargs) -> LLM:
    args = dict(dtype="float32", enable_lora=True, max_loras=4, max_lora_rank=16, max_model_len=256, seed=0)
    args.update(kwargs)
    return LLM(base, **args)


def check_against_peft(base: str, adapter: str | None, prompt: list[int], completion) -> None:
    """Tokens equal PEFT's greedy ones (a divergence only at a near-tie); each step's logprob equals
    log_softmax of PEFT's logits."""
    want_ids, want_logits = hf_peft_greedy(base, adapter, prompt, MAX_NEW_TOKENS)
    got = list(completion.token_ids)
    want_lp = torch.log_softmax(want_logits, dim=-1)
    for step, (g, w) in enumerate(zip(got, want_ids)):
        if g != w:
            gap = (want_logits[step, w] - want_logits[step, g]).item()
            assert gap < TIE_GAP, f"adapter {adapter}: step {step} engine {g} PEFT {w} (gap {gap:.3g})"
            return  # past a tie the two continue different sequences
        assert completion.logprobs[step][g].logprob == pytest.approx(want_lp[step, g].item(), abs=LOGPROB_ATOL)


PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, logprobs=1)


def test_each_adapter_alone_matches_peft(lora_setup: dict) -> None:
    base, requests = lora_setup["base"], lora_setup["requests"]
    llm = make_llm(base)
    prompts = random_prompts(2, 512, [5, 37], seed=7)
    for name, lora in requests.items():
        outputs = llm.generate(prompts, PARAMS, use_tqdm=False, lora_request=lora)
        for prompt, out in zip(prompts, outputs):
            check_against_peft(base, lora_setup["adapters"][name], prompt, out.outputs[0])


def test_mixed_batch_of_three_adapters_and_the_base(lora_setup: dict) -> None:
    base, requests, adapters = lora_setup["base"], lora_setup["requests"], lora_setup["adapters"]
    llm = make_llm(base, max_num_batched_tokens=64)  # prefills in chunks, beside other requests' decodes
    names = ["all", None, "attn", "mlp", "all", "mlp", None, "attn"]
    prompts = random_prompts(len(names), 512, [3, 20, 41, 9, 70, 16, 33, 1], seed=8)
    loras = [requests[n] if n else None for n in names]
    outputs = llm.generate(prompts, PARAMS, use_tqdm=False, lora_request=loras)
    for name, prompt, out, lora in zip(names, prompts, outputs, loras):
        check_against_peft(base, adapters[name] if name else None, prompt, out.outputs[0])
        assert out.lora_request is lora  # (vLLM's field: the adapter the request ran under)
    # the adapters do change the model: the same prompt gives other tokens than the base
    same = llm.generate([prompts[0]] * 4, PARAMS, use_tqdm=False,
                        lora_request=[None, requests["all"], requests["attn"], requests["mlp"]])
    tokens = [tuple(o.outputs[0].token_ids) for o in same]
    assert len(set(tokens)) > 1


def test_prefix_cache_is_keyed_by_adapter(lora_setup: dict) -> None:
    """A block computed under one adapter is never a hit for another or for the base; the same adapter hits."""
    base, requests, adapters = lora_setup["base"], lora_setup["requests"], lora_setup["adapters"]
    llm = make_llm(base, block_size=16)
    prompt = random_prompts(1, 512, [50], seed=9)[0]
    order = ["all", "attn", None, "all"]
    hits = []
    for name in order:
        before = metric_values(llm).get("pagedllm:prefix_cache_hits", 0.0)
        out = llm.generate([prompt], PARAMS, use_tqdm=False, lora_request=requests[name] if name else None)[0]
        hits.append(metric_values(llm).get("pagedllm:prefix_cache_hits", 0.0) - before)
        check_against_peft(base, adapters[name] if name else None, prompt, out.outputs[0])
    assert hits[:3] == [0, 0, 0]
    assert hits[3] > 0  # the first adapter's blocks, reused by its own second request


def test_more_adapters_than_slots_wait_and_preemption_is_invisible(lora_setup: dict) -> None:
    """max_loras=1: requests under three adapters run one adapter at a time and all finish; a KV cache too
    small for them all preempts requests; the tokens are still PEFT's."""
    base, requests, adapters = lora_setup["base"], lora_setup["requests"], lora_setup["adapters"]
    llm = make_llm(base, max_loras=1, max_cpu_loras=2, num_gpu_blocks_override=12, block_size=8,
                   max_num_batched_tokens=32)
    names = ["all", "attn", "mlp", None, "attn", "all"]
    prompts = random_prompts(len(names), 512, [30, 25, 12, 28, 7, 19], seed=10)
    loras = [requests[n] if n else None for n in names]
    outputs = llm.generate(prompts, PARAMS, use_tqdm=False, lora_request=loras)
    for name, prompt, out in zip(names, prompts, outputs):
        assert out.outputs[0].finish_reason == "length"
        check_against_peft(base, adapters[name] if name else None, prompt, out.outputs[0])
    assert metric_values(llm).get("pagedllm:num_preemptions", 0) > 0


def _copy_adapter(src: str, dst, edit_config=None) -> str:
    shutil.copytree(src, dst)
    if edit_config is not None:
        path = os.path.join(dst, "adapter_config.json")
        with open(path) as f:
            config = json.load(f)
        edit_config(config)
        with open(path, "w") as f:
            json.dump(config, f)
    return str(dst)


def test_bad_adapters_fail_alone_with_a_named_error(lora_setup: dict, tmp_path) -> None:
    base, requests, adapters = lora_setup["base"], lora_setup["requests"], lora_setup["adapters"]
    llm = make_llm(base, max_lora_rank=8)
    broken_json = _copy_adapter(adapters["all"], tmp_path / "json")
    with open(os.path.join(broken_json, "adapter_config.json"), "w") as f:
        f.write("{not json")
    cases = {
        str(tmp_path / "missing"): "no such adapter directory",
        broken_json: "not valid JSON",
        adapters["attn"]: "max_lora_rank",  # r=16 > 8
        _copy_adapter(adapters["all"], tmp_path / "save", lambda c: c.update(modules_to_save=["lm_head"])):
            "modules_to_save",
        _copy_adapter(adapters["all"], tmp_path / "target", lambda c: c.update(target_modules=["q_proj", "c_attn"])):
            "target_modules",
    }
    prompt = [5, 6, 7]
    for i, (path, field) in enumerate(cases.items()):
        with pytest.raises(ValueError, match=field):
            llm.generate([prompt], PARAMS, use_tqdm=False, lora_request=LoRARequest(f"bad{i}", 100 + i, path))
    # nothing else was harmed: a good adapter and the base still run, and match PEFT
    outs = llm.generate([prompt, prompt], PARAMS, use_tqdm=False, lora_request=[requests["all"], None])
    check_against_peft(base, adapters["all"], prompt, outs[0].outputs[0])
    check_against_peft(base, None, prompt, outs[1].outputs[0])


def test_lora_request_needs_enable_lora(lora_setup: dict) -> None:
    llm = LLM(lora_setup["base"], dtype="float32", max_model_len=128)
    with pytest.raises(ValueError, match="enable_lora"):
        llm.generate([[5, 6]], PARAMS, use_tqdm=False, lora_request=lora_setup["requests"]["all"])
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, "/nowhere")
    # vLLM's older spelling, in its positional place
    assert LoRARequest("x", 3, "", "/some/dir").lora_path == "/some/dir"
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LLM(lora_setup["base"], enable_lora=True, max_loras=4, max_cpu_loras=2)


def test_chat_takes_a_lora_request(lora_setup: dict) -> None:
    base, requests = lora_setup["base"], lora_setup["requests"]
    llm = make_llm(base)
    messages = [{"role": "user", "content": "Hello, world!"}]
    tokens = [tuple(llm.chat(messages, PARAMS, use_tqdm=False, lora_request=lora)[0].outputs[0].token_ids)
              for lora in (None, requests["all"])]
    assert tokens[0] != tokens[1]


MIXED_NAMES = ["all", None, "attn", "mlp"]


def _mixed(lora_setup: dict) -> tuple[list[list[int]], list[LoRARequest | None]]:
    # repetitive prompts, so that n-gram proposals fire
    prompts = [p * 3 for p in random_prompts(len(MIXED_NAMES), 512, [6, 4, 9, 5], seed=11)]
    return prompts, [lora_setup["requests"][n] if n else None for n in MIXED_NAMES]


@pytest.mark.parametrize("engine", ["tp2", "async_scheduling", "ngram", "draft_model"])
def test_adapters_under_tp_speculation_and_async_scheduling(lora_setup: dict, engine: str, tmp_path) -> None:
    """Tensor parallelism (A replicated or column-split, B split as its layer), speculative decoding (the
    draft proposes without the adapter, the target verifies with it) and a worker process with async
    scheduling (the adapter travels with the request) give the plain engine's adapter tokens."""
    from tiny_models import perturbed_copy

    base = lora_setup["base"]
    prompts, loras = _mixed(lora_setup)
    want = [list(o.outputs[0].token_ids) for o in make_llm(base).generate(prompts, PARAMS, use_tqdm=False,
                                                                             lora_request=loras)]
    extra = {"tp2": dict(tensor_parallel_size=2),
             "async_scheduling": dict(async_scheduling=True),
             "ngram": dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                               "prompt_lookup_min": 1, "prompt_lookup_max": 3}),
             "draft_model": dict(speculative_model=perturbed_copy(base, tmp_path / "draft", noise=0.03),
                                 num_speculative_tokens=3)}[engine]
    llm = make_llm(base, **extra)
    try:
        got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, PARAMS, use_tqdm=False, lora_request=loras)]
        assert got == want
        if engine in ("ngram", "draft_model"):
            assert metric_values(llm)["pagedllm:spec_decode_num_draft_tokens"] > 0  # verification ran
    finally:
        llm.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run where a GPU is lent)")
def test_mixed_batch_on_cuda_matches_peft(lora_setup: dict) -> None:
    """The same mixed batch on a GPU: slots, masks and the shrink/expand live on the device."""
    base, requests, adapters = lora_setup["base"], lora_setup["requests"], lora_setup["adapters"]
    llm = make_llm(base, device="cuda")
    names = ["all", None, "attn", "mlp"]
    prompts = random_prompts(len(names), 512, [3, 20, 41, 9], seed=12)
    outputs = llm.generate(prompts, PARAMS, use_tqdm=False, lora_request=[requests[n] if n else None for n in names])
    for name, prompt, out in zip(names, prompts, outputs):
        check_against_peft(base, adapters[name] if name else None, prompt, out.outputs[0])


def test_phi3_adapter_on_fused_checkpoint_projections(tmp_path) -> None:
    """Phi-3 stores q|k|v and gate|up fused, and PEFT targets them as qkv_proj and gate_up_proj: one A over
    the input, one B over the fused output, split here by part as the projection is."""
    base = build_model(tmp_path / "phi3", "phi3", seed=47)
    adapter = build_lora_adapter(base, tmp_path / "phi3_lora", r=8, seed=4,
                                 target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])
    llm = make_llm(base)
    prompts = random_prompts(2, 512, [7, 30], seed=13)
    loras = [LoRARequest("phi", 1, adapter), None]
    outputs = llm.generate(prompts, PARAMS, use_tqdm=False, lora_request=loras)
    for prompt, out, lora in zip(prompts, outputs, loras):
        check_against_peft(base, adapter if lora else None, prompt, out.outputs[0])
    # under tensor parallelism each rank takes its rows of every part of the fused B
    tp = make_llm(base, tensor_parallel_size=2)
    try:
        got = tp.generate(prompts, PARAMS, use_tqdm=False, lora_request=loras)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in outputs]
    finally:
        tp.shutdown()


def test_mlp_adapter_on_a_mixture_of_experts_is_refused_by_name(lora_setup: dict, tmp_path) -> None:
    """A Mixtral's MLP is experts, with no gate_proj / up_proj / down_proj to adapt: an adapter holding
    them is refused, naming target_modules; attention-only adapters still run."""
    moe = build_model(tmp_path / "mixtral", "mixtral", seed=48)
    llm = make_llm(moe)
    with pytest.raises(ValueError, match="target_modules"):
        llm.generate([[5, 6, 7]], PARAMS, use_tqdm=False,
                     lora_request=LoRARequest("all", 1, lora_setup["adapters"]["all"]))
    attn = build_lora_adapter(moe, tmp_path / "moe_attn", r=8, target_modules=["q_proj", "v_proj"], seed=5)
    out = llm.generate([[5, 6, 7]], PARAMS, use_tqdm=False, lora_request=LoRARequest("attn", 2, attn))[0]
    check_against_peft(moe, attn, [5, 6, 7], out.outputs[0])
