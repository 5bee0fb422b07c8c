"""engine.text: incremental detokenization (exact for any way of splitting the ids, linear work) and stop
strings, with real byte-level BPE, byte-fallback and id-only tokenizers."""

from __future__ import annotations

import itertools
import random

import pytest

from kdtree_engine.engine.text import IncrementalDetokenizer, TextStream
from kdtree_engine.engine.tokenizer import Tokenizer as EngineTokenizer

tokenizers = pytest.importorskip("tokenizers")
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

TEXTS = [
    "Café 日本語 ok",
    "naïve 👍🏽 thumbs, 🇫🇷 flag, 👨‍👩‍👧 family",
    "combining: e\u0301 n\u0303 a\u030a\u0323 — Ǆ",
    "𝄞 music, ∑ math, 中文 한국어 العربية",
    "日本語 日本語 ok ok 🎉🎉",
]


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    """A tiny byte-level BPE trained on TEXTS: few merges, so multi-byte characters span tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<|eos|>"]
    )
    tok.train_from_iterator(TEXTS, trainer)
    return tok


def _splits(n: int, rng: random.Random, limit: int = 512):
    """Ways to cut n ids into consecutive pushes (cut positions): all of them for small n, else a sample
    (with empty pushes and everything-at-once among them)."""
    if n <= 10:
        for mask in itertools.product((0, 1), repeat=n - 1):
            yield [i + 1 for i, m in enumerate(mask) if m]
        return
    yield []
    yield list(range(1, n))
    for _ in range(limit):
        yield sorted(rng.sample(range(0, n + 1), rng.randint(1, min(n, 12))))


def _stream(tokenizer, ids, cuts, **kw) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, **kw)
    bounds = [0, *cuts, len(ids)]
    pieces = [detok.push(ids[a:b]) for a, b in zip(bounds, bounds[1:])]
    return [*pieces, detok.flush()]


def _check_all_splits(tokenizer, ids, full, seed=0, limit=512, **kw):
    rng = random.Random(seed)
    for cuts in _splits(len(ids), rng, limit):
        pieces = _stream(tokenizer, ids, cuts, **kw)
        assert "".join(pieces) == full, (ids, cuts, pieces)


@pytest.mark.parametrize("max_held", [0, 8])
def test_byte_level_bpe_every_split(bpe, max_held):
    """Whole texts and short windows of them (every split of those), non-ASCII included."""
    for text in TEXTS:
        ids = bpe.encode(text).ids
        assert bpe.decode(ids) == text
        _check_all_splits(bpe, ids, text, max_held=max_held)
        for start in range(0, len(ids) - 6, 3):  # windows that start and end inside characters
            window = ids[start : start + 9]
            _check_all_splits(bpe, window, bpe.decode(window), max_held=max_held)
    cafe = bpe.encode("Café 日本語 ok").ids
    assert any("\ufffd" in bpe.decode([i]) for i in cafe)  # characters really are cut by tokens


def test_byte_level_bpe_invalid_utf8_and_specials(bpe):
    """Random ids (invalid UTF-8, lone continuation bytes, special tokens): still the full decode."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|eos|>")
    rng = random.Random(1)
    for _ in range(150):
        ids = [rng.randrange(bpe.get_vocab_size()) for _ in range(rng.randint(1, 30))]
        for max_held in (0, 8):
            _check_all_splits(bpe, ids, bpe.decode(ids), seed=2, limit=20, max_held=max_held)
        for skip in (True, False):
            full = hf.decode(ids, skip_special_tokens=skip)
            _check_all_splits(hf, ids, full, seed=3, limit=10, skip_special_tokens=skip)
    eos = hf.convert_tokens_to_ids("<|eos|>")
    ids = bpe.encode("Café").ids + [eos]
    assert "".join(_stream(hf, ids, [1])) == "Café"
    assert "".join(_stream(hf, ids, [1], skip_special_tokens=False)) == "Café<|eos|>"


def test_tokens_that_straddle_characters():
    """A byte-level vocabulary whose tokens are 2-byte chunks: almost no token boundary is a character
    boundary, so text only comes out through the all-but-the-last-character path."""
    raw = "日本語𝄞é👍🏽中文".encode()
    chunks = [raw[i : i + 2] for i in range(0, len(raw), 2)]
    byte_to_char = _byte_level_map()
    vocab = {}
    for chunk in chunks:
        vocab.setdefault("".join(byte_to_char[b] for b in chunk), len(vocab))
    tok = Tokenizer(models.BPE(vocab, []))
    tok.decoder = decoders.ByteLevel()
    ids = [vocab["".join(byte_to_char[b] for b in c)] for c in chunks]
    assert tok.decode(ids) == raw.decode()
    for max_held in (0, 3, 8):
        _check_all_splits(tok, ids, raw.decode(), max_held=max_held)


def _byte_level_map() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what the ByteLevel decoder inverts)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def test_byte_fallback_metaspace_every_split():
    """A SentencePiece-style tokenizer (Llama 2's decoder: Metaspace + byte fallback, leading space
    stripped): missing characters are <0xNN> byte tokens, and a word's space comes from its token."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for word in ["▁", "▁Caf", "é", "▁ok", "▁hello", "▁world"]:
        vocab[word] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    pieces = ["▁Caf", "é", "▁", "日", "本", "語", "▁ok", "▁", "👍", "🏽", "▁hello", "▁world", "▁", "𝄞"]
    ids = []
    for p in pieces:
        ids += [vocab[p]] if p in vocab else [vocab[f"<0x{b:02X}>"] for b in p.encode()]
    full = tok.decode(ids)
    assert full == "Café 日本語 ok 👍🏽 hello world 𝄞"
    _check_all_splits(tok, ids, full, limit=2000)
    # Windows that start or end inside a character: a byte-fallback decoder turns the whole run of
    # byte tokens around an incomplete character into U+FFFD, so only windows that decode to valid text
    # are compared (at the very end of a stream the detokenizer has printed the complete characters).
    windows = [ids[a:b] for a in range(len(ids)) for b in range(a + 1, min(a + 10, len(ids)) + 1)]
    valid = [w for w in windows if "\ufffd" not in tok.decode(w)]
    assert len(valid) > 50
    for window in valid:
        _check_all_splits(tok, window, tok.decode(window), limit=50)


def test_id_only_tokenizer_every_split():
    """The CLI's tokenizer without tokenizer files: the text is the ids, space-separated."""
    tok = EngineTokenizer(None)
    ids = [5, 17, 3, 99, 0, 127, 42, 8, 8, 1]
    _check_all_splits(tok, ids, "5 17 3 99 0 127 42 8 8 1")


class _Counting:
    """Wraps a tokenizer and counts decode calls and the ids they decode."""

    def __init__(self, tok) -> None:
        self.tok, self.calls, self.ids, self.widest = tok, 0, 0, 0

    def decode(self, ids, skip_special_tokens=True):
        self.calls += 1
        self.ids += len(ids)
        self.widest = max(self.widest, len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("kind", ["bpe", "random_ids", "id_only"])
def test_linear_work(bpe, kind):
    """4000 ids in pushes of 1..16: every decode covers a bounded window and the total work is a
    bounded multiple of the length (decoding the whole output each time would be ~n^2 / 2 ids)."""
    rng = random.Random(4)
    if kind == "bpe":
        ids = (bpe.encode(" ".join(TEXTS)).ids * 100)[:4000]
        tok = bpe
    elif kind == "random_ids":  # mostly invalid UTF-8: the held-back path must stay bounded too
        ids = [rng.randrange(bpe.get_vocab_size()) for _ in range(4000)]
        tok = bpe
    else:
        ids, tok = [rng.randrange(1000) for _ in range(4000)], EngineTokenizer(None)
    counting = _Counting(tok)
    detok = IncrementalDetokenizer(counting)
    pieces, i = [], 0
    while i < len(ids):
        k = rng.randint(1, 16)
        pieces.append(detok.push(ids[i : i + k]))
        i += k
    pieces.append(detok.flush())
    assert "".join(pieces) == tok.decode(ids)
    assert counting.widest <= 16 + detok.CONTEXT + detok.max_held + 1
    assert counting.ids <= 40 * len(ids) and counting.calls <= 8 * len(ids)


def test_text_stream_stop_strings(bpe):
    text = "Café 日本語 ok 👍🏽 STOP here 日本語 STOP"
    ids = bpe.encode(text).ids
    rng = random.Random(5)
    for stops, expected in [
        (["STOP"], "Café 日本語 ok 👍🏽 "),
        (["本語", "STOP"], "Café 日"),
        (["👍"], "Café 日本語 ok "),
        (["nowhere"], text),
        ([], text),
    ]:
        for cuts in _splits(len(ids), rng, limit=40):
            stream = TextStream(bpe, stops)
            bounds = [0, *cuts, len(ids)]
            out = "".join(stream.push(ids[a:b]) for a, b in zip(bounds, bounds[1:])) + stream.flush()
            assert out == expected == stream.text, (stops, cuts)
            assert stream.stopped == (expected != text)
    # While streaming, an end of the text that could begin a stop string waits for the next piece;
    # anything else is printed at once.
    stream = TextStream(bpe, ["STOP", "ok!"])
    assert stream.push(bpe.encode("ok SX o").ids) == "ok SX "
    assert stream.push(bpe.encode("k ST").ids) == "ok "
    assert stream.push(bpe.encode("OP more").ids) == "" and stream.stopped
    assert stream.push([1, 2, 3]) == "" and stream.flush() == "" and stream.text == "ok SX ok "
