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
                        extra_keys: tuple = ()) -> None:
    """Append the hashes of every full block of `token_ids` not hashed yet (computed once per block)."""
    start = len(block_hashes)
    num_full_blocks = len(token_ids) // block_size
    if start >= num_full_blocks:
        return
    extra = repr(extra_keys).encode() if extra_keys else b""
    parent = block_hashes[start - 1] if start else NONE_HASH
    for i in range(start, num_full_blocks):
        parent = hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size], extra)
        block_hashes.append(parent)
