"""The suffix proposer (vLLM's `"method": "suffix"`, suffix decoding): no model, a frequency-counted suffix
tree of what this request and recent requests have said.

Two trees of depth at most `max_tree_depth`:
- a per-request tree over the request's prompt and output, built when it first proposes, extended with
  each sampled token, dropped when it leaves the running set;
- one global tree over the outputs of the last `max_cached_requests` requests (the running ones
  included), evicting the oldest request's output when a new one arrives past the bound.

Every node counts the suffixes that pass through it, so a child's share of its siblings' counts is how
often the pattern continued with that child. To propose, each suffix of the request's last tokens (1 up to
max_tree_depth - 1 tokens) is looked up; from its node the most frequent child is followed while the
product of those frequencies (the confidence that the whole path is right) stays at or above
`min_token_prob`, for at most min(k, match length * max_spec_factor) tokens. Each path scores the sum of
its confidences (its expected number of accepted tokens); the best path of either tree wins, a longer
match on ties. The proposal is deterministic, so the rejection sampler treats it as a point mass and the
output is exactly the target's.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedllm.spec_decode.proposer import ModelFreeProposer

if TYPE_CHECKING:
    from pagedllm.spec_decode.proposer import DraftRequest, ProposeInput

# vLLM's defaults for suffix decoding.
DEFAULT_MAX_TREE_DEPTH = 24
DEFAULT_MAX_CACHED_REQUESTS = 10000
DEFAULT_MAX_SPEC_FACTOR = 1.0
DEFAULT_MIN_TOKEN_PROB = 0.1


class Node:
    """count: suffixes through this node; total: the sum of its children's counts (the occurrences that
    continued); best: its most frequent child (None: to be found again), so a proposal step is O(1)."""

    __slots__ = ("count", "children", "total", "best")

    def __init__(self) -> None:
        self.count = 0
        self.total = 0
        self.children: dict[int, Node] = {}
        self.best: tuple[int, Node] | None = None

    def best_child(self) -> tuple[int, Node]:
        if self.best is None:
            self.best = max(self.children.items(), key=lambda item: item[1].count)
        return self.best


@dataclass
class Candidate:
    token_ids: list[int] = field(default_factory=list)
    score: float = 0.0  # sum of the confidences along the path: its expected accepted tokens
    match_len: int = 0


class SuffixTree:
    """All substrings of up to `max_depth` tokens of the sequences added to it, with occurrence counts.

    Sequences are appended to token by token: each keeps its active nodes (the ends of its last
    max_depth - 1 suffixes), so a token costs max_depth dictionary steps however long the sequence is.
    """

    def __init__(self, max_depth: int):
        assert max_depth >= 2
        self.max_depth = max_depth
        self.root = Node()
        self.num_nodes = 1  # the root included: memory is proportional to it
        # sequence id -> (its tokens, its active nodes, deepest first)
        self._seqs: dict[str, tuple[list[int], list[Node]]] = {}

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._seqs

    def num_tokens(self, seq_id: str) -> int:
        return len(self._seqs[seq_id][0])

    def extend(self, seq_id: str, token_ids: list[int]) -> None:
        tokens, active = self._seqs.setdefault(seq_id, ([], []))
        max_active = self.max_depth - 1
        for token in token_ids:
            tokens.append(token)
            active.append(self.root)
            next_active = []
            for node in active:
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = Node()
                    self.num_nodes += 1
                child.count += 1
                node.total += 1
                if node.best is not None and child.count > node.best[1].count:
                    node.best = (token, child)
                next_active.append(child)
            # The oldest suffix has reached max_depth tokens: it grows no further.
            active[:] = next_active[-max_active:] if len(next_active) > max_active else next_active

    def remove(self, seq_id: str) -> None:
        """Take a sequence's substrings out of the counts; nodes no longer counted are freed."""
        tokens, _ = self._seqs.pop(seq_id)
        for start in range(len(tokens)):
            node = self.root
            for token in tokens[start:start + self.max_depth]:
                child = node.children[token]
                child.count -= 1
                node.total -= 1
                if node.best is not None and node.best[1] is child:
                    node.best = None  # another child may now be the most frequent
                if child.count == 0:
                    # Every deeper node on this path counts only suffixes that pass through here.
                    del node.children[token]
                    self.num_nodes -= _subtree_size(child)
                    break
                node = child

    def suffix_nodes(self, seq_id: str) -> list[Node]:
        """The nodes of the sequence's last 1, 2, ... max_depth - 1 tokens (its active nodes): what matching
        those suffixes from the root would find, without walking."""
        return self._seqs[seq_id][1][::-1]

    def match(self, pattern: list[int]) -> Node | None:
        node = self.root
        for token in pattern:
            node = node.children.get(token)  # type: ignore[assignment]
            if node is None:
                return None
        return node

    def speculate(self, context: list[int], max_tokens: int, max_spec_factor: float,
                  min_token_prob: float, suffix_nodes: list[Node] | None = None) -> Candidate:
        """The best path after any suffix of `context` (its occurrence at the very end, which nothing
        follows yet, does not count). suffix_nodes: the nodes of context's suffixes, shortest first, where
        the caller has them (a sequence's own tree: suffix_nodes(seq_id))."""
        best = Candidate()
        context = context[-(self.max_depth - 1):]
        for match_len in range(1, len(context) + 1):
            if suffix_nodes is not None:
                node = suffix_nodes[match_len - 1] if match_len <= len(suffix_nodes) else None
            else:
                node = self.match(context[len(context) - match_len:])
            if node is None:
                break  # a longer suffix contains this one: it cannot occur either
            limit = min(max_tokens, int(match_len * max_spec_factor + 1e-6), self.max_depth - match_len)
            candidate = _follow(node, limit, min_token_prob)
            if candidate.token_ids and candidate.score >= best.score:
                candidate.match_len = match_len
                best = candidate
        return best


def _follow(node: Node, max_tokens: int, min_token_prob: float) -> Candidate:
    """The most frequent path below `node` while its confidence stays at or above min_token_prob."""
    candidate = Candidate()
    prob = 1.0
    while len(candidate.token_ids) < max_tokens and node.children:
        token, child = node.best_child()
        # Among the occurrences that continued: the one at the very end of the request (and any cut off
        # by the depth bound) says nothing about what follows.
        prob *= child.count / node.total
        if prob < min_token_prob:
            break
        candidate.token_ids.append(token)
        candidate.score += prob
        node = child
    return candidate


def _subtree_size(node: Node) -> int:
    size, stack = 0, [node]
    while stack:
        current = stack.pop()
        size += 1
        stack.extend(current.children.values())
    return size


class SuffixProposer(ModelFreeProposer):
    def __init__(self, max_tree_depth: int = DEFAULT_MAX_TREE_DEPTH,
                 max_cached_requests: int = DEFAULT_MAX_CACHED_REQUESTS,
                 max_spec_factor: float = DEFAULT_MAX_SPEC_FACTOR, min_token_prob: float = DEFAULT_MIN_TOKEN_PROB):
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        # request id -> its own tree (prompt and output); only requests in the running set
        self.local: dict[str, SuffixTree] = {}
        self.global_tree = SuffixTree(max_tree_depth)
        # request ids whose output the global tree holds, oldest first; with the prompt length of each
        self.cached: OrderedDict[str, int] = OrderedDict()

    def observe(self, request: DraftRequest) -> None:
        """Bring both trees up to the request's tokens (called for every request that sampled)."""
        tokens = request.all_token_ids
        local = self.local.get(request.request_id)
        if local is None:
            local = self.local[request.request_id] = SuffixTree(self.max_tree_depth)
            local.extend("", tokens)
        else:
            local.extend("", tokens[local.num_tokens(""):])
        if self.max_cached_requests == 0:
            return
        request_id = request.request_id
        if request_id not in self.global_tree:
            self.cached[request_id] = request.num_prompt_tokens
            while len(self.cached) > self.max_cached_requests:
                oldest, _ = self.cached.popitem(last=False)
                self.global_tree.remove(oldest)
            self.global_tree.extend(request_id, [])
        output_start = self.cached[request_id]
        self.global_tree.extend(request_id, tokens[output_start + self.global_tree.num_tokens(request_id):])

    def propose_tokens(self, request: DraftRequest, num_tokens: int) -> list[int]:
        context = request.all_token_ids[-(self.max_tree_depth - 1):]
        best = Candidate()
        local = self.local.get(request.request_id)
        trees = [(local, local.suffix_nodes(""))] if local is not None else []
        if self.max_cached_requests:
            trees.append((self.global_tree, None))
        for tree, suffix_nodes in trees:
            candidate = tree.speculate(context, num_tokens, self.max_spec_factor, self.min_token_prob, suffix_nodes)
            if candidate.score > best.score or (candidate.score == best.score
                                                and candidate.match_len > best.match_len):
                best = candidate
        return best.token_ids

    def propose(self, inputs: ProposeInput) -> dict[str, tuple[list[int], None]]:
        proposals: dict[str, tuple[list[int], None]] = {}
        for request, k in zip(inputs.requests, inputs.num_spec_tokens):
            self.observe(request)
            tokens = self.propose_tokens(request, k) if k > 0 else []
            if tokens:
                proposals[request.request_id] = (tokens, None)
        return proposals

    def free(self, request_ids: set[str]) -> None:
        """Drop the per-request trees of requests that left the running set; their outputs stay in the
        global tree until evicted (a preempted request continues its entry when it resumes)."""
        for request_id in request_ids:
            self.local.pop(request_id, None)
