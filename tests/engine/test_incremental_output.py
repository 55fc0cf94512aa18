"""Incremental host-side output work: the detokenizer, stop strings, and the n-gram index.

:class:`~specdist.engine.output_state.OutputState` must give exactly what the straightforward
algorithm gives (decode the whole output after every token, search the whole text for
the earliest stop string) while decoding only a few tokens per token; NgramIndex must
give exactly what a backward scan of the sequence gives. Checked on random token
streams, appended in random chunk sizes, with four tokenizers: the word-level one of
the test checkpoints, a GPT-2 style byte-level BPE (multi-byte characters split across
tokens), a Llama-style SentencePiece one (``▁`` word prefixes, byte-fallback tokens),
and SmolLM2's real tokenizer. The cost tests count the tokens handed to
``tokenizer.decode``; nothing is timed.
"""

from __future__ import annotations

import random

import pytest
from support.helpers import save_tiny_llama

from specdist.cores.proposers.ngram import NgramIndex
from specdist.engine.output_state import IncrementalDetokenizer, OutputState
from specdist.sampling_params import SamplingParams

CORPUS = [
    "hello world, héllo wörld!",
    "naïve café — “quoted” text… ok",
    "日本語のテキストと中文字符",
    "emoji 🙂🎉👍🏽 and € £ ¥ signs",
    "stop here. END of line\n\tindented",
    "Здравствуй мир; Γειά σου κόσμε",
]


# --------------------------------------------------------------------------- tokenizers
def _byte_level_bpe():
    """GPT-2 style: byte-level pre-tokenizer and decoder, a few hundred merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<eos>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")


def _sentencepiece_like():
    """Llama style: ``▁`` starts a word, other characters are byte tokens, the first space is stripped."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += ["▁", "▁hello", "▁world", "▁stop", "▁é", "a", "b", "é", "▁日本", "語", ".", "!"]
    vocab = {p: i for i, p in enumerate(pieces)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """name -> (tokenizer, eos id) for the three small tokenizers."""
    from transformers import AutoTokenizer

    word = AutoTokenizer.from_pretrained(save_tiny_llama(str(tmp_path_factory.mktemp("tok") / "m"), 1, vocab_size=12))
    bpe, sp = _byte_level_bpe(), _sentencepiece_like()
    return {"word": (word, 7), "bpe": (bpe, bpe.eos_token_id), "sp": (sp, sp.eos_token_id)}


@pytest.fixture(scope="module")
def smollm2(smollm2_tokenizer):
    return smollm2_tokenizer


class CountingTokenizer:
    """Wraps a tokenizer and counts the token ids handed to ``decode``."""

    def __init__(self, inner):
        self.inner, self.decoded, self.calls = inner, 0, 0

    def decode(self, ids, skip_special_tokens=False):
        self.decoded += len(ids)
        self.calls += 1
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)

    def __getattr__(self, name):
        return getattr(self.inner, name)


# --------------------------------------------------------------------------- reference
class QuadraticOutput:
    """The straightforward algorithm: re-decode the whole output after each token, search all of it."""

    def __init__(self, params: SamplingParams, eos_ids: frozenset[int], tokenizer):
        self.params, self.tokenizer = params, tokenizer
        self.stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_ids)
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason = self.stop_reason = None
        self._streamed = 0
        self._holdback = max((len(s) for s in params.stop), default=1) - 1

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, tokens: list[int]) -> int:
        kept = 0
        for tok in tokens:
            if self.finished:
                break
            if tok in self.stop_ids:
                self.finish("stop", tok)
                break
            self.token_ids.append(tok)
            kept += 1
            self.text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
            hits = [(i, s) for s in self.params.stop if (i := self.text.find(s)) >= 0]
            if hits:
                idx, s = min(hits)
                self.text = self.text[:idx]
                self.finish("stop", s)
            if not self.finished and len(self.token_ids) >= self.params.max_tokens:
                self.finish("length")
        return kept

    def finish(self, reason, stop_reason=None) -> None:
        if self.finish_reason is None:
            self.finish_reason, self.stop_reason = reason, stop_reason

    def take_delta(self) -> str:
        end = len(self.text)
        if not self.finished:
            end -= self._holdback
            while end > self._streamed and self.text[end - 1] == "\ufffd":
                end -= 1
        if end <= self._streamed:
            return ""
        delta, self._streamed = self.text[self._streamed : end], end
        return delta


# (tokenizer, stream kind) pairs the equivalence tests run on
CASES = [("word", "ids"), ("bpe", "ids"), ("bpe", "text"), ("sp", "pieces"), ("sp", "text")]

# Byte-fallback decoding (SentencePiece, "sp") decodes a run of byte tokens as one
# unit: while its last character is incomplete, the *whole run* decodes to U+FFFD,
# characters completed earlier in it included. The incremental text keeps those
# characters, so the two agree only where no character is split, and appends there
# end at character boundaries. Byte-level BPE decoding has no such effect: any split.
CHAR_ALIGNED = {"sp"}


def char_ends(tok, ids: list[int]) -> list[int]:
    """Positions i (0 < i <= len) where ``ids[:i]`` does not end inside a character."""
    return [i for i in range(1, len(ids) + 1) if not tok.decode(ids[:i], skip_special_tokens=True).endswith("\ufffd")]


def chunk_ends(tok, name: str, ids: list[int]) -> list[int] | None:
    """Where appends may end (None: anywhere)."""
    return char_ends(tok, ids) if name in CHAR_ALIGNED else None


def random_stream(tok, rng: random.Random, length: int, kind: str) -> list[int]:
    """Random token ids, cut at ``length`` (so possibly inside a character).

    ``ids``: uniform over the vocabulary (specials, invalid UTF-8, split characters);
    ``text``: encoded corpus snippets; ``pieces`` (byte-fallback tokenizers): uniform over
    the non-byte pieces, mixed with the byte tokens of whole random characters. A
    byte-fallback decoder turns a whole run of byte tokens into U+FFFD as soon as
    one byte in it is invalid, retroactively changing text already decoded, which no
    bounded-window decoder (nor streaming) can follow; models emit byte tokens as
    whole characters.
    """
    if kind == "ids":
        return [rng.randrange(len(tok)) for _ in range(length)]
    ids: list[int] = []
    if kind == "pieces":
        pieces = [i for i in range(len(tok)) if not tok.convert_ids_to_tokens(i).startswith("<0x")]
        while len(ids) < length:
            if rng.random() < 0.4:
                ids.append(rng.choice(pieces))
                continue
            span = rng.choice([(0x80, 0x800), (0x3000, 0xD800), (0x1F300, 0x1FA00)])  # 2, 3, 4 UTF-8 bytes
            char = chr(rng.randrange(*span))
            ids += tok.convert_tokens_to_ids([f"<0x{b:02X}>" for b in char.encode()])
        return ids[:length]
    while len(ids) < length:
        line = rng.choice(CORPUS)
        a = rng.randrange(len(line))
        ids += tok.encode(line[a : a + rng.randint(1, 12)], add_special_tokens=False)
    return ids[:length]


def random_stops(text: str, rng: random.Random, n: int) -> list[str]:
    """Substrings of ``text`` (so they do occur), 1 to 4 characters long."""
    if not text:
        return ["zz"]
    out = []
    for _ in range(n):
        a = rng.randrange(len(text))
        out.append(text[a : a + rng.randint(1, 4)])
    return out


def next_end(i: int, n: int, ends: list[int] | None, limit: int) -> int:
    """The first allowed chunk end at or after i + n."""
    j = min(i + n, limit)
    if ends is not None:
        j = next((e for e in ends if e >= j), limit)
    return j


def run_both(tok, eos, stream, params, rng: random.Random, read_every_step: bool, ends: list[int] | None = None):
    """Feed the same chunks to OutputState and QuadraticOutput; compare everything observable."""
    new, old = OutputState(params, frozenset({eos}), tok), QuadraticOutput(params, frozenset({eos}), tok)
    if ends is not None:
        stream = stream[: ends[-1]] if ends else []
    streamed, i = [], 0
    while i < len(stream) and not old.finished:
        j = next_end(i, rng.randint(1, 6), ends, len(stream))
        chunk, i = stream[i:j], j
        assert new.append(chunk) == old.append(chunk)
        assert new.token_ids == old.token_ids
        assert (new.finish_reason, new.stop_reason) == (old.finish_reason, old.stop_reason)
        if read_every_step:
            assert new.text == old.text
        if read_every_step or rng.random() < 0.3:
            delta = new.take_delta()
            assert delta == old.take_delta()
            streamed.append(delta)
    new.finish("length")
    old.finish("length")
    streamed.append(new.take_delta())
    assert streamed[-1] == old.take_delta()
    assert new.text == old.text
    assert "".join(streamed) == new.text
    return new


# --------------------------------------------------------------------------- detokenizer
@pytest.mark.parametrize("name,kind", CASES)
def test_detokenizer_matches_full_decode(tokenizers, name, kind):
    tok, _ = tokenizers[name]
    for seed in range(20):
        rng = random.Random(seed)
        ids = random_stream(tok, rng, 120, kind)
        ends = chunk_ends(tok, name, ids)
        detok, released, i = IncrementalDetokenizer(tok), [], 0
        while i < len(ids):
            n = rng.randint(1, 4)
            released.append(detok.push(ids[i : i + n]))
            i = min(i + n, len(ids))
            text = "".join(released) + detok.pending
            if ends is None or i in ends:
                assert text == tok.decode(ids[:i], skip_special_tokens=True), (seed, i)
            else:
                assert text.endswith("\ufffd") and detok.pending, (seed, i)


def test_detokenizer_holds_back_incomplete_characters(tokenizers):
    tok, _ = tokenizers["bpe"]
    euro = [tok.convert_tokens_to_ids(c) for c in "âĤ¬"]  # the byte-level symbols of b"\xe2\x82\xac" ("€")
    detok = IncrementalDetokenizer(tok)
    assert detok.push(tok.encode("ab", add_special_tokens=False)) == "ab"
    assert detok.push(euro[:1]) == "" and detok.pending == "\ufffd"
    assert detok.push(euro[1:2]) == "" and detok.pending.endswith("\ufffd")
    assert detok.push(euro[2:]) == "€" and detok.pending == ""

    sp, _ = tokenizers["sp"]
    detok = IncrementalDetokenizer(sp)
    ids = [sp.convert_tokens_to_ids(t) for t in ("▁hello", "<0xE2>", "<0x82>", "<0xAC>", "▁world")]
    assert [detok.push([i]) for i in ids] == ["hello", "", "", "€", " world"]


def test_detokenizer_special_tokens_are_skipped_and_free(tokenizers):
    """skip_special_tokens=True drops them; a long run of them (ignore_eos) decodes nothing."""
    tok, eos = tokenizers["sp"]
    counting = CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counting)
    word = tok.convert_tokens_to_ids("▁world")
    out = detok.push([word]) + detok.push([eos] * 1000) + detok.push([word])
    assert out == tok.decode([word] + [eos] * 1000 + [word], skip_special_tokens=True) == "world world"
    assert counting.decoded <= 8


def test_detokenizer_long_invalid_run_stays_cheap(tokenizers):
    """Bytes that never form a character keep every window ending in U+FFFD; the window is still cut."""
    tok, _ = tokenizers["bpe"]
    cont = tok.convert_tokens_to_ids("Ģ")  # the byte-level symbol of byte 0x80, a lone continuation byte
    assert tok.decode([cont]) == "\ufffd"
    ids = tok.encode("ok", add_special_tokens=False) + [cont] * 500 + tok.encode("€ done", add_special_tokens=False)
    counting = CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counting)
    text = "".join(detok.push([i]) for i in ids) + detok.pending
    assert text == tok.decode(ids)
    assert counting.decoded <= 40 * len(ids)


# --------------------------------------------------------------------------- OutputState
@pytest.mark.parametrize("name,kind", CASES)
def test_output_state_matches_quadratic_reference(tokenizers, name, kind):
    """No stop strings: text == decode(token_ids) after every append, deltas identical, EOS / max_tokens identical."""
    tok, eos = tokenizers[name]
    for seed in range(16):
        rng = random.Random(seed)
        stream = random_stream(tok, rng, 150, kind)
        ends = chunk_ends(tok, name, stream)
        max_tokens = rng.choice(ends) if ends else rng.randint(1, 160)
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=seed % 2 == 0)
        out = run_both(tok, eos, stream, params, rng, seed % 4 < 2, ends)
        assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("name,kind", CASES)
def test_stop_strings_match_quadratic_reference(tokenizers, name, kind):
    """Earliest stop string wins, text cut before it, token_ids end at the token that completed it."""
    tok, eos = tokenizers[name]
    stopped = 0
    for seed in range(24):
        rng = random.Random(1000 + seed)
        stream = random_stream(tok, rng, 150, kind)
        ends = chunk_ends(tok, name, stream)
        stops = random_stops(tok.decode(stream[40:], skip_special_tokens=True), rng, rng.randint(1, 3))
        if ends is not None:  # mid-character texts differ (see CHAR_ALIGNED), so must stop strings with U+FFFD
            stops = [s for s in stops if "\ufffd" not in s] or ["zz"]
        elif seed % 6 == 0:
            stops.append("\ufffd")  # matches a character still incomplete, exactly as the full decode does
        params = SamplingParams(max_tokens=200, stop=stops, ignore_eos=True)
        out = run_both(tok, eos, stream, params, rng, seed % 3 == 0, ends)
        stopped += out.finish_reason == "stop"
    assert stopped >= 12


def test_smollm2_tokenizer(smollm2):
    """SmolLM2's GPT-2 style byte-level tokenizer: random ids (specials, split characters) and real text."""
    tok, eos = smollm2, smollm2.eos_token_id
    text = "Héllo wörld! 日本語のテキスト 🙂🎉 — “naïve café” € done.\n" * 3
    real = tok.encode(text, add_special_tokens=False)
    for seed in range(12):
        rng = random.Random(seed)
        stream = real if seed < 3 else [rng.randrange(len(tok)) for _ in range(200)]
        stops = random_stops(tok.decode(stream[30:], skip_special_tokens=True), rng, 2) if seed % 2 else []
        params = SamplingParams(max_tokens=300, stop=stops, ignore_eos=True)
        out = run_both(tok, eos, stream, params, rng, read_every_step=seed % 3 == 0)
        if not stops:
            assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)
        if seed < 3 and not stops:
            assert out.text == text


def test_output_without_tokenizer():
    out = OutputState(SamplingParams(max_tokens=3, stop=["x"]), frozenset({9}), None)
    assert out.append([1, 2, 3, 4]) == 3 and out.token_ids == [1, 2, 3]
    assert out.text == "" and out.take_delta() == "" and out.finish_reason == "length"


# --------------------------------------------------------------------------- cost
N_COST = 4000


@pytest.mark.parametrize("name", ["word", "bpe"])
@pytest.mark.parametrize("stop", [(), ("never appears \x00",)])
def test_decode_work_is_linear(tokenizers, name, stop, monkeypatch):
    """Appending 4,000 tokens one at a time decodes O(n) tokens in total and searches O(1) text per token.

    The old code decoded all of ``token_ids`` after each token: 1 + 2 + ... + n =
    n (n + 1) / 2 = 8,002,000 token ids for n = 4,000 (shown on the reference below
    for n = 400: 80,200), i.e. 2,000 per token here against the bound of 16.
    """
    tok, eos = tokenizers[name]
    rng = random.Random(7)
    stream = random_stream(tok, rng, N_COST, "text" if name == "bpe" else "ids")
    counting = CountingTokenizer(tok)
    params = SamplingParams(max_tokens=N_COST, stop=stop, ignore_eos=True)

    spans: list[int] = []
    suffix = OutputState._suffix
    monkeypatch.setattr(OutputState, "_suffix", lambda self, start: spans.append(len(r := suffix(self, start))) or r)
    out = OutputState(params, frozenset({eos}), counting)
    streamed = []
    for t in stream:
        out.append([t])
        streamed.append(out.take_delta())
    streamed.append(out.take_delta())
    assert out.finish_reason == "length"
    assert "".join(streamed) == out.text == tok.decode(stream, skip_special_tokens=True)
    assert counting.decoded <= 16 * N_COST
    assert max(spans) <= 64  # stop search and take_delta look at the newest few characters only

    small = CountingTokenizer(tok)
    ref = QuadraticOutput(SamplingParams(max_tokens=400, stop=stop, ignore_eos=True), frozenset({eos}), small)
    for t in stream[:400]:
        ref.append([t])
    assert small.decoded == 400 * 401 // 2 > 16 * 400


# --------------------------------------------------------------------------- n-gram index
def reference_lookup(seq: list[int], k: int, ngram_min: int, ngram_max: int) -> list[int]:
    """Continuation (up to k tokens) of the latest earlier match of the longest suffix n-gram."""
    length = len(seq)
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        suffix = seq[length - n :]
        for start in range(length - n - 1, -1, -1):
            if seq[start : start + n] == suffix:
                return seq[start + n : start + n + k]
    return []


@pytest.mark.parametrize("ngram_min,ngram_max", [(1, 1), (1, 3), (2, 2), (2, 4), (3, 5)])
def test_ngram_index_matches_backward_scan(ngram_min, ngram_max):
    for seed in range(60):
        rng = random.Random(seed)
        vocab = rng.choice([1, 2, 3, 5, 8])
        length = rng.randint(0, 200)
        seq = [rng.randrange(vocab) for _ in range(length)]
        index, i = NgramIndex(ngram_min, ngram_max), 0
        assert index.lookup(3) == []
        while i < length:
            n = rng.choice([0, 1, 1, 1, 2, 3, 7])
            index.extend(seq[i : i + n])
            i = min(length, i + n)
            assert len(index) == i and index.seq == seq[:i]
            for k in range(6):
                assert index.lookup(k) == reference_lookup(seq[:i], k, ngram_min, ngram_max), (seed, i, k)


def test_ngram_index_examples():
    index = NgramIndex(1, 3)
    index.extend([1, 2, 3, 4, 1, 2, 3])
    assert index.lookup(2) == [4, 1]  # the 3-gram (1, 2, 3) occurred at 0, followed by 4, 1
    index.extend([9])
    assert index.lookup(2) == []  # 9 never occurred before
    index.extend([1])
    assert index.lookup(3) == [2, 3, 9]  # 1 last occurred with a token after it at 4
    with pytest.raises(ValueError):
        NgramIndex(0, 2)
