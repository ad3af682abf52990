"""The incremental detokenizer decodes a fast tokenizer through its `tokenizers.Tokenizer` directly: the
text must be exactly what transformers' decode gives, for byte-level BPE (multi-byte UTF-8 split across
tokens), SentencePiece-style Metaspace (leading spaces) and WordPiece with clean-up (left to transformers)."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerFast

from pagedllm.engine.detokenizer import ByteLevelBytes, IncrementalDetokenizer, backend_decoder
from tests.tiny_models import SPECIAL_TOKENS, build_tokenizer, training_text

TEXT = training_text()[:20000] + " naïve café ünïcödé 漢字 かな 😀🚀 ok"


def _metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """SentencePiece's layout: '▁' for spaces, a prefix space added at the start and dropped on decode."""
    tok = Tokenizer(models.BPE(byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = None
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    alphabet = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIAL_TOKENS + alphabet, show_progress=False)
    tok.train_from_iterator([TEXT], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIAL_TOKENS[0], eos_token=SPECIAL_TOKENS[1])


def _wordpiece_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=400, special_tokens=["[UNK]", "[CLS]"], show_progress=False)
    tok.train_from_iterator([TEXT], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", cls_token="[CLS]",
                                   clean_up_tokenization_spaces=True)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, PreTrainedTokenizerFast]:
    return {"byte-level BPE": build_tokenizer(tmp_path_factory.mktemp("bpe")),
            "metaspace": _metaspace_tokenizer(), "wordpiece": _wordpiece_tokenizer()}


def _incremental_text(tokenizer, prompt: list[int], output: list[int], skip: bool) -> str:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, skip)
    for token_id in output:
        detokenizer.add_tokens([token_id])
    return detokenizer.text


def _reference_text(tokenizer, prompt: list[int], output: list[int], skip: bool) -> str:
    """The same algorithm through transformers' decode (the detokenizer before its fast path)."""
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, skip)
    detokenizer._backend = detokenizer._stream = detokenizer._bytes = None
    for token_id in output:
        detokenizer.add_tokens([token_id])
    return detokenizer.text


@pytest.mark.parametrize("name", ["byte-level BPE", "metaspace", "wordpiece"])
def test_backend_decode_matches_transformers(tokenizers: dict, name: str) -> None:
    tokenizer = tokenizers[name]
    assert (backend_decoder(tokenizer) is None) == (name == "wordpiece")  # clean-up stays with transformers
    ids = tokenizer.encode(TEXT[-400:], add_special_tokens=False)
    rng = random.Random(0)
    for trial in range(20):
        # real text, random ids (bytes of broken UTF-8 sequences) and special tokens
        output = ids[trial * 7:trial * 7 + 30] if trial % 2 else [rng.randrange(len(tokenizer)) for _ in range(30)]
        output = [0, *output[:10], 1, *output[10:]]
        prompt = ids[:rng.randrange(1, 8)]
        for skip in (True, False):
            assert _incremental_text(tokenizer, prompt, output, skip) == _reference_text(tokenizer, prompt, output,
                                                                                         skip)
            detokenizer = IncrementalDetokenizer(tokenizer, prompt, skip)
            assert [detokenizer.decode_token(t) for t in output] == [tokenizer.decode([t]) for t in output]


def test_text_of_real_text_is_the_text(tokenizers: dict) -> None:
    """Decoded one token at a time after a prompt, an encoded text comes back whole (its leading space
    included: the prompt's last tokens give the SentencePiece decoder its context)."""
    for name in ("byte-level BPE", "metaspace"):
        tokenizer = tokenizers[name]
        ids = tokenizer.encode("x = 1 naïve 漢字 😀 end", add_special_tokens=False)
        assert _incremental_text(tokenizer, ids[:3], ids[3:], True) == tokenizer.decode(ids)[
            len(tokenizer.decode(ids[:3])):]


class _StreamThatGivesUp:
    """The backend's DecodeStream, raising as tokenizers does ("Invalid prefix encountered") at token
    `fail_at`: a decoder whose new window text no longer starts with the old one."""

    def __init__(self, stream, fail_at: int):
        self.stream, self.fail_at, self.num_steps = stream, fail_at, 0

    def step(self, tokenizer, token_id: int):
        if self.num_steps == self.fail_at:
            raise Exception("Invalid prefix encountered")
        self.num_steps += 1
        return self.stream.step(tokenizer, token_id)


@pytest.mark.parametrize("name", ["byte-level BPE", "metaspace"])
def test_python_algorithm_takes_over_where_the_backend_stream_gives_up(tokenizers: dict, name: str) -> None:
    tokenizer = tokenizers[name]
    ids = tokenizer.encode(TEXT[-300:], add_special_tokens=False)
    prompt, output = ids[:4], ids[4:44]
    expected = _reference_text(tokenizer, prompt, output, True)
    for fail_at in (0, 1, 7, 23, 39):
        detokenizer = IncrementalDetokenizer(tokenizer, prompt, True)
        stream = DecodeStream(ids=list(detokenizer.token_ids), skip_special_tokens=True)  # as add_token starts it
        detokenizer._stream = _StreamThatGivesUp(stream, fail_at)
        for token_id in output:
            detokenizer.add_tokens([token_id])
        assert detokenizer._stream is None
        assert detokenizer.text == expected


@pytest.mark.parametrize("name", ["byte-level BPE", "metaspace"])
def test_random_prompts_and_outputs_match_the_python_algorithm(tokenizers: dict, name: str) -> None:
    """Random ids split UTF-8 sequences anywhere, the prompt's end included (there the detokenizer keeps
    the Python algorithm, which counts the prompt's bytes as read)."""
    tokenizer = tokenizers[name]
    rng = random.Random(1)
    for _ in range(100):
        prompt = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 9))]
        output = [rng.randrange(len(tokenizer)) for _ in range(30)]
        for skip in (True, False):
            assert _incremental_text(tokenizer, prompt, output, skip) == _reference_text(tokenizer, prompt, output,
                                                                                         skip)


@pytest.mark.parametrize("name", ["byte-level BPE", "metaspace"])
def test_tokens_fed_together_give_the_text_of_tokens_fed_one_by_one(tokenizers: dict, name: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A final-only output is decoded in one call once its request ends (byte-level decoders), a
    streamed one token by token: the texts must be the same, with UTF-8 sequences split anywhere (the
    run's end included, where the one-by-one decode holds back only the last, incomplete character)."""
    tokenizer = tokenizers[name]
    ids = tokenizer.encode(TEXT[-600:], add_special_tokens=False)
    rng = random.Random(2)
    runs: list[bool] = []  # per run of tokens: decoded in one call (True), or one by one
    add_run = IncrementalDetokenizer._add_run

    def counted_add_run(self: IncrementalDetokenizer, new_token_ids: list[int]) -> str | None:
        piece = add_run(self, new_token_ids)
        runs.append(piece is not None)
        return piece

    monkeypatch.setattr(IncrementalDetokenizer, "_add_run", counted_add_run)
    for trial in range(150):
        if trial % 3 == 0:
            start = rng.randrange(len(ids) - 40)
            prompt, output = ids[start:start + 4], ids[start + 4:start + 40]
        else:
            prompt = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 9))]
            output = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(2, 40))]
        for skip in (True, False):
            expected = _incremental_text(tokenizer, prompt, output, skip)
            detokenizer = IncrementalDetokenizer(tokenizer, prompt, skip)
            position, pieces = 0, []
            while position < len(output):
                size = rng.choice([1, 2, 5, len(output)])
                pieces.append(detokenizer.add_tokens(output[position:position + size]))
                position += size
            assert detokenizer.text == "".join(pieces) == expected
    if name == "byte-level BPE":  # both ways were taken: in one call, and one by one (a split character)
        assert sum(runs) > 100 and not all(runs)
    else:
        assert not runs  # a decoder that strips a leading space: always one by one


def test_byte_level_table_decodes_as_the_tokenizer_does(tmp_path) -> None:
    """A byte-level vocabulary's table gives the Rust decode's text: special tokens kept or skipped, UTF-8
    sequences broken anywhere (each maximal invalid sequence one U+FFFD), an added token outside the byte
    alphabet as its own text; an id past the vocabulary is left to the tokenizer (None)."""
    tokenizer = build_tokenizer(tmp_path)
    tokenizer.add_tokens(["<tool_call>", "naïve•"])  # plain added tokens, one with characters off the alphabet
    backend = backend_decoder(tokenizer)
    table = ByteLevelBytes.build(backend)
    assert table is not None
    vocab = backend.get_vocab_size(with_added_tokens=True)
    byte_tokens = [token_id for token_id in range(vocab) if len(table.tables[False][token_id]) == 1]
    assert len(byte_tokens) > 200  # the alphabet's lone bytes: every broken sequence can be written
    rng = random.Random(3)
    for _ in range(2000):
        pool = byte_tokens if rng.random() < 0.5 else range(vocab)
        ids = [rng.choice(pool) for _ in range(rng.randrange(1, 24))]
        for skip in (False, True):
            assert table.decode(ids, skip) == backend.decode(ids, skip_special_tokens=skip)
    assert table.decode([vocab + 5], False) is None
    assert IncrementalDetokenizer(tokenizer, [5], True)._decode([5, vocab + 5]) == backend.decode([5, vocab + 5])


def test_a_table_that_disagrees_with_the_tokenizer_is_not_used(tokenizers: dict,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    backend = backend_decoder(tokenizers["byte-level BPE"])
    monkeypatch.setattr("pagedllm.engine.detokenizer._byte_level_chars", lambda: {})  # every token as UTF-8
    assert ByteLevelBytes.build(backend) is None
