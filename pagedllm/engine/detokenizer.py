"""Incremental detokenization that is right for multi-byte UTF-8 and BPE merges.

Each step decodes a short window of tokens twice (with and without the newest ones) and emits only the
difference, holding text back while it ends in an incomplete UTF-8 sequence. The window starts with a
few prompt tokens so tokenizers that drop a leading space at the start of a decode (SentencePiece)
produce the same text as decoding everything at once. Where the tokenizer's Rust backend decodes for it,
the same algorithm runs inside `tokenizers` (DecodeStream): one call per token instead of two decodes and
the bookkeeping in Python.

Tokens that arrive together (a final-only output decoded once its request ends, a verified draft) give
exactly the text that feeding them one by one would. Where the decoder is byte-level (GPT-2's, Llama 3's,
Qwen's: the tokens' bytes joined, then one lossy UTF-8 decode) the text of a window that ends on a whole
character is a prefix of the text of any longer window, so the pieces of one-by-one steps join into the
difference that one decode of the whole window gives: one Rust call for the lot instead of one per token
(about ten times faster on a 32-token output). Where the window would end inside a UTF-8 sequence, or
another decoder (SentencePiece's strips a leading space, WordPiece's joins "##" pieces) might not keep
that property, the tokens go one by one. A byte-level decoder's text of any window is known without it: each
token's bytes (ByteLevelBytes, built once per tokenizer) joined and decoded as UTF-8 with the same
replacement of invalid sequences, about four times faster than the Rust call on a 37-token window.
"""

from __future__ import annotations

import random
import weakref

from tokenizers.decoders import ByteLevel, DecodeStream

INITIAL_CONTEXT_TOKENS = 5
_UNSTARTED = object()  # IncrementalDetokenizer._stream to be started at the next lone token (on its window)


def backend_decoder(tokenizer):
    """The `tokenizers.Tokenizer` under a transformers fast tokenizer, when decoding through it directly
    gives exactly what `tokenizer.decode` gives; else None. transformers' decode wraps that one Rust call
    in Python (argument conversion, kwargs, the clean-up check) that costs more than the decode itself of
    the few tokens an incremental step looks at, twice per token of every request."""
    from transformers import PreTrainedTokenizerBase
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    cls = type(tokenizer)
    if not (isinstance(tokenizer, TokenizersBackend) and cls.decode is PreTrainedTokenizerBase.decode
            and cls._decode is TokenizersBackend._decode):
        return None  # a slow tokenizer, or a class with a decode of its own
    backend = tokenizer.backend_tokenizer
    # TokenizersBackend._decode cleans up tokenization spaces when asked, except for BPE models (unless
    # forced); only where it would not, is its output the backend's.
    forced = getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
    cleans_up = tokenizer.clean_up_tokenization_spaces and (type(backend.model).__name__ != "BPE" or forced)
    return None if cleans_up else backend


def _byte_level_chars() -> dict[str, int]:
    """The byte-level alphabet (GPT-2's bytes_to_unicode), reversed: the printable character standing for each
    byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    others = [b for b in range(256) if b not in printable]
    chars = {chr(b): b for b in printable}
    chars.update({chr(256 + i): b for i, b in enumerate(others)})
    return chars


class ByteLevelBytes:
    """Every token's bytes under a byte-level decoder, for both settings of skip_special_tokens, so a window's
    text is one join and one UTF-8 decode instead of a call into `tokenizers`. The decoder maps each character
    of a token to its byte, or, for a token with a character outside the alphabet (an added token such as
    "<|im_end|>" written plainly), takes the token's own UTF-8; the pieces are joined and decoded lossily, each
    maximal invalid sequence becoming one U+FFFD, as Python's "replace" handler does. A table that disagrees
    with the tokenizer's own decode on a sample of tokens at build time is not used (None from build)."""

    def __init__(self, with_special: list[bytes], without_special: list[bytes]):
        self.tables = {False: with_special, True: without_special}

    @classmethod
    def build(cls, backend) -> ByteLevelBytes | None:
        chars = _byte_level_chars()
        special = {token_id for token_id, token in backend.get_added_tokens_decoder().items() if token.special}
        with_special: list[bytes] = []
        for token_id in range(backend.get_vocab_size(with_added_tokens=True)):
            token = backend.id_to_token(token_id)
            if token is None:
                with_special.append(b"")
                continue
            try:
                with_special.append(bytes([chars[c] for c in token]))
            except KeyError:
                with_special.append(token.encode())
        without_special = [b"" if token_id in special else piece for token_id, piece in enumerate(with_special)]
        table = cls(with_special, without_special)
        return table if table._agrees_with(backend, special) else None

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str | None:
        """The tokenizer's text of `ids`; None for an id past the vocabulary (the model's padding rows)."""
        table = self.tables[skip_special_tokens]
        try:
            return b"".join([table[token_id] for token_id in ids]).decode("utf-8", "replace")
        except IndexError:
            return None

    def _agrees_with(self, backend, special: set[int]) -> bool:
        """The same text as backend.decode on every special token and on windows of sampled tokens, each
        setting of skip_special_tokens."""
        vocab = len(self.tables[False])
        rng = random.Random(0)
        windows = [[token_id] for token_id in sorted(special)]
        windows += [[rng.randrange(vocab) for _ in range(rng.randrange(1, 8))] for _ in range(256)]
        return all(self.decode(ids, skip) == backend.decode(ids, skip_special_tokens=skip)
                   for ids in windows for skip in (False, True))


_BACKENDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def prepare_detokenizer(tokenizer) -> None:
    """Work out once what every detokenizer of this tokenizer shares (a byte-level table: some 0.1 s for a
    150k vocabulary)."""
    _cached_backend_decoder(tokenizer)


def _cached_backend_decoder(tokenizer):
    """(backend_decoder, whether its decoder is byte-level, its ByteLevelBytes or None), worked out once per
    tokenizer, not for every sample's detokenizer (a step that ends a batch of requests makes many at once)."""
    try:
        return _BACKENDS[tokenizer]
    except (KeyError, TypeError):  # TypeError: an object without weak references (a test double)
        backend = backend_decoder(tokenizer)
    byte_level = backend is not None and isinstance(backend.decoder, ByteLevel)
    found = backend, byte_level, ByteLevelBytes.build(backend) if byte_level else None
    try:
        _BACKENDS[tokenizer] = found
    except TypeError:
        pass
    return found


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool,
                 spaces_between_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        # vLLM decodes a slow (Python) tokenizer's added tokens itself, each as its own piece, joined to the
        # text around them with a space when spaces_between_special_tokens (its default), else directly.
        # A fast tokenizer's decode never spaces them, and vLLM leaves it at that: so do we.
        self.added_vocab: dict[str, int] = {}
        self._backend, byte_level, self._bytes = _cached_backend_decoder(tokenizer)
        if not getattr(tokenizer, "is_fast", True):
            self.added_vocab = tokenizer.get_added_vocab()
            self.special_tokens = set(tokenizer.all_special_tokens)
        context = prompt_token_ids[-INITIAL_CONTEXT_TOKENS:]
        self.token_ids: list[int] = list(context)
        self.prefix_offset = 0
        self.read_offset = len(context)
        # The backend's own incremental decoder, started on the same context (when the first token comes
        # alone: a final-only output's tokens come together, and never need it); None: the Python
        # algorithm. A context that ends inside a UTF-8 sequence is not emitted when the stream is started
        # on it, so the stream's first piece would carry the prompt's last characters: there the Python
        # algorithm, which counts the context as read, runs instead.
        self._stream = None
        # The context's text, kept for the first run's decode of the text already read (_add_run): a
        # final-only output's one run then costs two decodes, not three.
        self._context_text = self._decode(context) if self._backend is not None else None
        self._context_len = len(context)
        # Whether the text read so far ends on a whole character (every emitted piece does)
        self._read_whole = self._context_text is not None and not self._context_text.endswith("\ufffd")
        if self._read_whole:
            self._stream = _UNSTARTED
        # Whether a run of tokens may be decoded in one call (see the module's docstring).
        self._byte_level = byte_level
        # The text as the pieces each step added: appending is O(piece), where `text += piece` on an
        # attribute copies the whole text every step (O(n^2) over a long output).
        self._pieces: list[str] = []
        self.text_len = 0

    @property
    def text(self) -> str:
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def text_from(self, start: int) -> str:
        """text[start:], reading only the pieces it spans."""
        if start >= self.text_len:
            return ""
        tail: list[str] = []
        position = self.text_len
        for piece in reversed(self._pieces):
            tail.append(piece)
            position -= len(piece)
            if position <= start:
                break
        return "".join(reversed(tail))[start - position:]

    def truncate(self, end: int) -> None:
        """Keep text[:end] (a stop string ended the output)."""
        self._pieces = [self.text[:end]]
        self.text_len = end

    def _decode(self, ids: list[int]) -> str:
        if self._bytes is not None:
            text = self._bytes.decode(ids, self.skip_special_tokens)
            if text is not None:
                return text
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        if not self.added_vocab:
            return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        pieces: list[str] = []
        run: list[str] = []
        for token in self.tokenizer.convert_ids_to_tokens(ids):
            if self.skip_special_tokens and token in self.special_tokens:
                continue
            if token in self.added_vocab:
                if run:
                    pieces.append(self.tokenizer.convert_tokens_to_string(run))
                    run = []
                pieces.append(token)
            else:
                run.append(token)
        if run:
            pieces.append(self.tokenizer.convert_tokens_to_string(run))
        return (" " if self.spaces_between_special_tokens else "").join(pieces)

    def add_tokens(self, new_token_ids: list[int]) -> str:
        """Feed newly generated tokens; returns the text they complete (may be empty): the same text as
        feeding them one at a time."""
        if len(new_token_ids) < 2 or not self._byte_level:
            return "".join([self.add_token(token_id) for token_id in new_token_ids])
        pieces = []
        start = 0
        # A context that ends inside a character (a prompt of arbitrary ids): one by one until a piece is
        # emitted, after which the text read ends on a whole character.
        while start < len(new_token_ids) and not self._read_whole:
            pieces.append(self.add_token(new_token_ids[start]))
            start += 1
        if len(new_token_ids) - start > 1:
            piece = self._add_run(new_token_ids[start:])
            if piece is not None:
                pieces.append(piece)
                return "".join(pieces)
        pieces.extend([self.add_token(token_id) for token_id in new_token_ids[start:]])
        return "".join(pieces)

    def _add_run(self, new_token_ids: list[int]) -> str | None:
        """A byte-level decoder's text of a run of tokens, from one decode of the window (see the module's
        docstring). None, and nothing fed, where the window's text, or the text already read, ends inside a
        UTF-8 sequence: only one by one gives the text of the tokens fed so far there."""
        window = self.token_ids[self.prefix_offset:]
        if self.prefix_offset == 0 and self.read_offset == self._context_len:  # nothing read past the context
            read_text = self._context_text
        else:
            read_text = self._decode(window[:self.read_offset - self.prefix_offset])
        window.extend(new_token_ids)
        text = self._decode(window)
        if text.endswith("\ufffd") or read_text.endswith("\ufffd"):
            return None
        self.token_ids.extend(new_token_ids)
        if self._stream is not None:  # it has not seen these tokens: started again at the next one
            self._stream = _UNSTARTED
        if len(text) <= len(read_text):  # skipped special tokens only: they count as read
            self.read_offset = len(self.token_ids)
            return ""
        piece = text[len(read_text):]
        self._emit(piece)
        return piece

    def add_token(self, token_id: int) -> str:
        """Feed one generated token; returns the text it completes (may be empty)."""
        self.token_ids.append(token_id)
        if self._stream is _UNSTARTED:  # not started yet, or a run was decoded without it: on the window, all read
            self._stream = DecodeStream(ids=self.token_ids[self.prefix_offset:-1],
                                        skip_special_tokens=self.skip_special_tokens)
        if self._stream is not None:
            try:
                piece = self._stream.step(self._backend, token_id)
            except Exception:  # noqa: BLE001 - tokenizers raises a bare Exception
                # "Invalid prefix encountered": the window's new decode does not start with its old one
                # (a decoder that rewrites earlier text). The Python algorithm, which compares lengths
                # only, takes over from the same offsets.
                self._stream = None
            else:
                if piece is None:
                    return ""
                self._emit(piece)
                return piece
        return self._step()

    def _emit(self, piece: str) -> None:
        """Append a piece of text; the window moves on past the tokens it completes (both algorithms)."""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self._read_whole = True  # a piece is emitted only where the window's text does not end inside one
        self._pieces.append(piece)
        self.text_len += len(piece)

    def _step(self) -> str:
        """One step of the Python algorithm over the tokens fed so far."""
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset:])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            delta = full_text[len(prefix_text):]
            self._emit(delta)
            return delta
        return ""

    def decode_token(self, token_id: int) -> str:
        if self._backend is not None:
            return self._backend.decode([token_id], skip_special_tokens=False)
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
