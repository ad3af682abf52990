"""Prefix-cache block hashes: each full block's hash chains its parent's hash, its token ids and extra
keys (room for a LoRA id or a cache salt). SHA-256 makes a collision out of reach, so a hash hit is
trusted without comparing tokens."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes
NONE_HASH: BlockHash = b"\x00" * 32


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int],
                      extra_keys: tuple = ()) -> BlockHash:
    h = hashlib.sha256(parent_hash or NONE_HASH)
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


def extend_block_hashes(block_hashes: list[BlockHash], token_ids: Sequence[int], block_size: int,
                        extra_keys: tuple = ()) -> None:
    """Append the hashes of every full block of `token_ids` not hashed yet (computed once per block)."""
    num_full_blocks = len(token_ids) // block_size
    for i in range(len(block_hashes), num_full_blocks):
        parent = block_hashes[i - 1] if i else None
        block_hashes.append(hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size],
                                              extra_keys))
