"""Prefix-cache block hashes: each full block's hash chains its parent's hash, its token ids and extra
keys (room for a LoRA id or a cache salt). SHA-256 makes a collision out of reach, so a hash hit is
trusted without comparing tokens."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes
NONE_HASH: BlockHash = b"\x00" * 32


def hash_block_tokens(parent_hash: BlockHash, token_ids: Sequence[int], extra: bytes) -> BlockHash:
    """SHA-256 of the parent's hash (NONE_HASH for a first block), the tokens as int64 and the extra keys'
    repr, encoded (b"" for none)."""
    return hashlib.sha256(parent_hash + array("q", token_ids).tobytes() + extra).digest()


def extend_block_hashes(block_hashes: list[BlockHash], token_ids: Sequence[int], block_size: int,
                        extra_keys: tuple = (), num_prompt_tokens: int | None = None) -> None:
    """Append the hashes of every full block of `token_ids` not hashed yet (computed once per block).
    `num_prompt_tokens`, where given: a block past the request's prompt, or holding its end, is keyed by
    where the prompt ends in it, for models that compute prompt and generated tokens by different
    arithmetic (pagedllm/forward_context.py): such a block is a hit only for a request whose prompt ends
    at the same place in it, never as part of a longer prompt (the next turn of a chat)."""
    start = len(block_hashes)
    num_full_blocks = len(token_ids) // block_size
    if start >= num_full_blocks:
        return
    extra = repr(extra_keys).encode() if extra_keys else b""
    parent = block_hashes[start - 1] if start else NONE_HASH
    for i in range(start, num_full_blocks):
        block_extra = extra
        if num_prompt_tokens is not None and (i + 1) * block_size > num_prompt_tokens:
            block_extra = repr((*extra_keys, "prompt_end", max(0, num_prompt_tokens - i * block_size))).encode()
        parent = hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size], block_extra)
        block_hashes.append(parent)
