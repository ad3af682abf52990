"""pagedllm on a real GGUF file against transformers on the same file (dequantized, fp32).

    python tools/check_real_model.py [--model FILE.gguf] [--prompts 16] [--new-tokens 64]
    python tools/check_real_model.py --memory [--model FILE.gguf]

Prints: greedy tokens equal on chat prompts (pagedllm fp32); teacher-forced top-1 agreement of
pagedllm bf16 with the fp32 reference over the same prompts' continuations; perplexity on a held-out
English text written for this check (no data is downloaded), pagedllm fp32 / bf16 against the
reference. --memory: what loading the bf16 model adds to the resident set, against the file's size
(tools/model_memory.py: libraries loaded first, no KV cache). Default model: the default model.
"""

from __future__ import annotations

import argparse
import gc
import math
import os

import torch

QUESTIONS = [
    "What is the capital of France?", "Name three primary colors.", "Write one sentence about the moon.",
    "What is 12 times 7?", "Give me a tip for sleeping better.", "Explain what a noun is.",
    "What is the boiling point of water in Celsius?", "Write a haiku about autumn.",
    "Why is the sky blue?", "Suggest a name for a pet goldfish.", "What does a bee make?",
    "How many days are in a week?", "Describe a cat in one sentence.", "What is photosynthesis?",
    "Translate 'good morning' into French.", "List two uses of a paperclip.",
]

HELD_OUT_TEXT = """\
The old lighthouse at the end of the harbour had not been lit for thirty years, but the town still
spoke of it as if it were working. Fishermen gave directions by it, children dared one another to touch
its door, and every spring someone painted the lower half of the tower white, as though the sea might
notice and be grateful.

Mara had come to the town to write a report on the harbour walls. She expected to stay a week. On her
second evening she walked out along the breakwater with a notebook, counting the cracks in the stone,
and found the lighthouse door standing open. Inside, the stairs were swept clean and a kettle sat on a
small stove at the bottom, still warm.

A man came down the stairs while she was looking at the kettle. He was older than her father and wore a
coat that had clearly belonged to someone taller. He did not seem surprised to see her. "The lamp does
not work," he said, "but the view is the same as it always was. You may as well come up."

From the top of the tower the whole coast was visible: the curve of the bay, the grey roofs of the town,
the line of the road climbing into the hills. Far out, a single fishing boat was turning for home. The
man pointed at it and named the family who owned it, and the name of the boat before this one, and the
year the one before that had been lost in a storm.

Mara wrote none of it down. When she returned to her room that night she opened her report and looked at
the list of cracks for a long time. In the morning she added a paragraph that the engineers would never
read closely: that the harbour walls were sound, but that a town is held together by other things as
well, and that some of them are kept in lighthouses that no longer shine.
"""


def _reference(path: str):
    from transformers import AutoModelForCausalLM, GgufConfig

    directory, name = os.path.split(path)
    return AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32,
                                                quantization_config=GgufConfig(dequantize=True)).eval()


@torch.no_grad()
def _ref_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log-softmax [len(ids) - 1, vocab] predicting ids[1:]."""
    logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1)


def _prompt_logprobs(llm, ids: list[int]) -> list[tuple[float, int]]:
    """(log-probability of each token after the first, the top-1 token there), teacher-forced."""
    from pagedllm import SamplingParams

    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    rows = []
    for token, position in zip(ids[1:], out.prompt_logprobs[1:]):
        top = min(position.items(), key=lambda item: item[1].rank or 10**9)[0]
        rows.append((position[token].logprob, top))
    return rows


def memory(path: str) -> None:
    """What loading the model adds to the resident set, counted after everything else is loaded."""
    from model_memory import measure  # tools/model_memory.py, beside this script

    print(measure(path, "bfloat16").describe())


def main() -> None:
    from pagedllm import LLM, SamplingParams
    from pagedllm.assets import default_model_path
    from pagedllm.models.gguf import load_gguf_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--memory", action="store_true")
    args = parser.parse_args()
    path = args.model or default_model_path()
    if args.memory:
        return memory(path)
    tokenizer = load_gguf_tokenizer(path)
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS[:args.prompts]]
    prompts = [tokenizer(tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False).input_ids for c in conversations]

    llm32 = LLM(model=path, dtype="float32", max_model_len=1024, kv_cache_memory_bytes=1 << 30)
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm32.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                          use_tqdm=False)]
    reference = _reference(path)
    equal = 0
    for ids, tokens in zip(prompts, ours):
        input_ids = torch.tensor([ids])
        with torch.no_grad():
            expected = reference.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                          max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                          eos_token_id=None)[0, len(ids):].tolist()
        equal += tokens == expected
    print(f"greedy fp32: {equal}/{len(prompts)} prompts x {args.new_tokens} tokens equal transformers")

    text_ids = tokenizer(HELD_OUT_TEXT, add_special_tokens=False).input_ids
    ref_text = _ref_logprobs(reference, text_ids)
    ref_ppl = math.exp(-ref_text.gather(1, torch.tensor(text_ids[1:]).view(-1, 1)).mean().item())
    ppl32 = math.exp(-sum(lp for lp, _ in _prompt_logprobs(llm32, text_ids)) / (len(text_ids) - 1))
    del llm32
    gc.collect()

    llm16 = LLM(model=path, dtype="bfloat16", max_model_len=1024, kv_cache_memory_bytes=1 << 30)
    agree = total = 0
    for ids, tokens in zip(prompts, ours):
        sequence = ids + tokens
        ref_top = _ref_logprobs(reference, sequence).argmax(-1).tolist()
        rows = _prompt_logprobs(llm16, sequence)
        for position in range(len(ids) - 1, len(sequence) - 1):  # the continuation's positions
            agree += rows[position][1] == ref_top[position]
            total += 1
    ppl16 = math.exp(-sum(lp for lp, _ in _prompt_logprobs(llm16, text_ids)) / (len(text_ids) - 1))
    print(f"teacher-forced top-1 agreement, pagedllm bf16 vs fp32 reference: {agree}/{total} = "
          f"{100 * agree / total:.2f}%")
    print(f"perplexity on {len(text_ids)} held-out tokens: transformers fp32 {ref_ppl:.4f}, pagedllm fp32 "
          f"{ppl32:.4f} ({100 * (ppl32 / ref_ppl - 1):+.3f}%), bf16 {ppl16:.4f} ({100 * (ppl16 / ref_ppl - 1):+.3f}%)")


if __name__ == "__main__":
    main()
