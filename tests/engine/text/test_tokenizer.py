from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swaserve.engine.text.tokenizer import BYTE, CONTROL, IncrementalDetokenizer, Tokenizer
from swaserve.models.demo.tokenizer import CONTROL_TOKENS, demo_tokenizer_metadata

TEXTS = [
    "",
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces,   runs of   spaces and a trailing one ",
    "line one\nline two\n\n\nafter blank lines\n",
    "\n",
    "tabs\tand\r\ncarriage returns",
    "café crème brûlée, naïve résumé, Zürich",
    "emoji 😀👍🏽 and flags 🇫🇷, CJK 日本語の文章, Arabic مرحبا, Cyrillic привет",
    "math ∑ x² ≤ ∞ — “quotes” … ‰",
    "def f(x):\n    return x * 2  # comment\n",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    "<|turn>user\nHi there<turn|>\n<|turn>model\n<|channel>thought\n<channel|>",
    "literal <0x41> and <bos> inside text and <not_a_token>",
    "\x00\x01 control chars \x7f",
]


@pytest.fixture(scope="module")
def meta() -> dict:
    return demo_tokenizer_metadata()


@pytest.fixture(scope="module")
def tok(meta) -> Tokenizer:
    return Tokenizer.from_metadata(meta)


# ---- an independent brute-force oracle of the Gemma 4 BPE on the same vocabulary ----------------

def brute_force_encode(meta: dict, text: str) -> list[int]:
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta["tokenizer.ggml.token_type"]
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(meta["tokenizer.ggml.merges"])}
    specials = sorted((t for t, ty in zip(tokens, types) if ty in (2, 3, 4)), key=len, reverse=True)
    out: list[int] = []

    def bpe(chunk: str) -> None:
        syms = list(chunk.replace(" ", "▁"))
        while len(syms) > 1:
            best = None
            for j in range(len(syms) - 1):
                r = ranks.get((syms[j], syms[j + 1]))
                if r is not None and (best is None or r < best[0]):
                    best = (r, j)
            if best is None:
                break
            j = best[1]
            syms[j : j + 2] = [syms[j] + syms[j + 1]]
        for s in syms:
            if s in vocab:
                out.append(vocab[s])
            else:
                out.extend(vocab[f"<0x{b:02X}>"] for b in s.encode("utf-8"))

    buf = ""
    i = 0
    while i < len(text):
        hit = next((s for s in specials if text.startswith(s, i)), None)
        if hit is None:
            buf += text[i]
            i += 1
            continue
        for chunk in re.findall(r"[^\n]+|\n+", buf):
            bpe(chunk)
        buf = ""
        out.append(vocab[hit])
        i += len(hit)
    for chunk in re.findall(r"[^\n]+|\n+", buf):
        bpe(chunk)
    return out


# ---- tests ------------------------------------------------------------------------------------------

def test_demo_metadata_layout(meta):
    tokens = meta["tokenizer.ggml.tokens"]
    assert meta["tokenizer.ggml.model"] == "gemma4" and meta["tokenizer.ggml.pre"] == "gemma4"
    assert tokens[:4] == ["<pad>", "<eos>", "<bos>", "<unk>"]
    assert len(tokens) == len(set(tokens)) == len(meta["tokenizer.ggml.scores"]) == len(
        meta["tokenizer.ggml.token_type"]
    )
    assert 2000 <= len(tokens) <= 4096
    for b in range(256):
        i = tokens.index(f"<0x{b:02X}>")
        assert meta["tokenizer.ggml.token_type"][i] == BYTE
    for name in CONTROL_TOKENS:
        assert name in tokens
    vocab = set(tokens)
    for m in meta["tokenizer.ggml.merges"]:
        a, b = m.split(" ", 1)
        assert a in vocab and b in vocab and a + b in vocab
    assert demo_tokenizer_metadata() == meta  # deterministic and not aliased


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(
    st.text(st.characters(blacklist_characters="\u2581", blacklist_categories=("Cs",)), max_size=40),
    st.sampled_from(list(CONTROL_TOKENS) + [" ", "\n", "  "])), max_size=8))
def test_matches_brute_force_bpe_and_round_trips(tok, meta, parts):
    text = "".join(parts)
    ids = tok.encode(text)
    assert ids == brute_force_encode(meta, text)
    assert tok.decode(ids) == text


def test_matches_brute_force_on_corpus_lines(tok, meta):
    from swaserve.models.demo.tokenizer import _PASSAGE

    for line in _PASSAGE.split("\n\n"):
        assert tok.encode(line) == brute_force_encode(meta, line)


def test_spaces_are_metaspace_and_words_merge(tok):
    ids = tok.encode("the answer")
    pieces = [tok.id_to_piece(i) for i in ids]
    assert pieces[-1] == "▁answer" and "".join(pieces) == "the▁answer"
    assert tok.encode(" x")[0] != tok.encode("x")[0]  # no prefix space is added
    assert [tok.id_to_piece(i) for i in tok.encode("a\n\nb")] == ["a", "\n\n", "b"]


def test_lone_surrogate_becomes_replacement_char(tok):
    assert tok.encode("a\ud800b") == tok.encode("a\ufffdb")
    with pytest.raises(ValueError, match="str"):
        tok.encode(b"bytes")  # type: ignore[arg-type]


def test_literal_metaspace_decodes_as_space(tok):
    # inherent to sentencepiece-style vocabularies (HF and llama.cpp do the same)
    assert tok.decode(tok.encode("a\u2581b")) == "a b"


def test_control_tokens_matched_whole(tok):
    for name in CONTROL_TOKENS:
        i = tok.piece_to_id(name)
        assert tok.encode(name) == [i]
        assert tok.encode(f"ab{name}cd") == tok.encode("ab") + [i] + tok.encode("cd")
        assert i in tok.special_ids
    turn = tok.piece_to_id("<|turn>")
    assert tok.encode("<|turn><|turn>") == [turn, turn]
    assert tok.encode("<|turn") != [turn]  # partial names are plain text
    assert tok.decode(tok.encode("<|turn>user\nhi<turn|>"), skip_special_tokens=True) == "user\nhi"


def test_byte_fallback(tok):
    for ch in ["😀", "日", "\x00", "ß" * 3]:
        ids = tok.encode(ch)
        assert tok.decode(ids) == ch
    ids = tok.encode("😀")
    assert [tok.id_to_piece(i) for i in ids] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    assert all(tok.token_type(i) == BYTE for i in ids)
    assert tok.unk_id not in tok.encode(TEXTS[8])


def test_ids_and_flags(tok, meta):
    assert tok.bos_id == 2 and tok.pad_id == 0 and tok.unk_id == 3
    assert tok.eos_ids == {1, tok.piece_to_id("<turn|>"), tok.piece_to_id("<|tool_response>")}
    assert tok.vocab_size == len(meta["tokenizer.ggml.tokens"])
    assert tok.encode("hi", add_bos=True) == [2, *tok.encode("hi")]
    assert tok.encode("<bos>hi") == [2, *tok.encode("hi")]
    assert tok.piece_to_id("no such piece") is None
    assert tok.encode_batch(["a b", "c"]) == [tok.encode("a b"), tok.encode("c")]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])
    m = dict(meta, **{"tokenizer.ggml.eos_token_ids": [1, 5]})
    assert 5 in Tokenizer.from_metadata(m).eos_ids


def test_model_keys_accepted_and_rejected(meta):
    t = Tokenizer.from_metadata({**meta, "tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "gemma4"})
    assert t.encode("hello world") == Tokenizer.from_metadata(meta).encode("hello world")
    for model, pre in [("gpt2", "gemma4"), ("llama", "default"), (None, None)]:
        bad = dict(meta, **{"tokenizer.ggml.model": model, "tokenizer.ggml.pre": pre})
        with pytest.raises(ValueError, match="tokenizer.ggml.model"):
            Tokenizer.from_metadata(bad)
    with pytest.raises(ValueError, match="tokenizer.ggml.tokens"):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "gemma4"})
    with pytest.raises(ValueError, match="bos_token_id"):
        Tokenizer.from_metadata(dict(meta, **{"tokenizer.ggml.bos_token_id": 10**6}))


def test_scores_only_vocab(meta):
    """Without merges (sentencepiece-style files), merges come from the scores."""
    m = {k: v for k, v in meta.items() if k != "tokenizer.ggml.merges"}
    t = Tokenizer.from_metadata(m)
    for text in TEXTS:
        assert t.decode(t.encode(text)) == text
    assert [t.id_to_piece(i) for i in t.encode(" answer")] == ["▁answer"]


def _utf8_prefix(full: str, nbytes: int) -> str:
    """Longest prefix of `full` whose UTF-8 encoding fits in the first `nbytes` bytes."""
    return full.encode("utf-8")[:nbytes].decode("utf-8", errors="ignore")


@pytest.mark.parametrize("text", [TEXTS[7], TEXTS[8], TEXTS[9], "😀😀 x 日本 🇫🇷\n<|turn>é"])
def test_incremental_detokenizer_every_prefix(tok, text):
    ids = tok.encode(text)
    det = IncrementalDetokenizer(tok, skip_special_tokens=False)
    acc, nbytes = "", 0
    for k, i in enumerate(ids):
        piece = det.push(i)
        assert "\ufffd" not in piece
        acc += piece
        nbytes += len(tok.token_bytes(i))
        assert acc == _utf8_prefix(text, nbytes), k
    acc += det.flush()
    assert acc == tok.decode(ids) == text


def test_incremental_detokenizer_skip_special_and_flush(tok):
    ids = tok.encode("<|turn>model\nhé 😀<turn|>")
    det = IncrementalDetokenizer(tok)  # skip_special_tokens=True by default
    assert det.push_many(ids) + det.flush() == tok.decode(ids, skip_special_tokens=True) == "model\nhé 😀"
    # a cut-off character is held back, then flushed as one replacement character
    det = IncrementalDetokenizer(tok)
    assert det.push_many(tok.encode("😀")[:2]) == ""
    assert det.flush() == "\ufffd"
    assert det.push_many(tok.encode("ok")) == "ok"  # state was reset


def _byte_ids(tok, data: bytes) -> list[int]:
    return [tok.piece_to_id(f"<0x{b:02X}>") for b in data]


def test_incremental_detokenizer_byte_fallback_split(tok):
    """A character split into byte-fallback tokens comes out with its last byte, not before and not
    later; a byte that cannot continue (or start) a character is U+FFFD at once, never held."""
    det = IncrementalDetokenizer(tok)
    ids = _byte_ids(tok, "日😀".encode())
    assert [det.push(i) for i in ids] == ["", "", "日", "", "", "", "😀"]
    skipped = tok.piece_to_id("<|turn>")  # a skipped control token between two bytes of a character
    split = [*_byte_ids(tok, b"\xc3"), skipped, *_byte_ids(tok, b"\xa9")]
    assert [det.push(i) for i in split] == ["", "", "é"]
    assert det.push(_byte_ids(tok, b"\x97")[0]) == "\ufffd"  # a lone continuation byte
    assert [det.push(i) for i in [*_byte_ids(tok, b"\xe6\x97"), *tok.encode("a")]] == ["", "", "\ufffda"]
    assert det.push(_byte_ids(tok, b"\xc0")[0]) == "\ufffd"  # never the start of a character
    # a surrogate's first bytes can never be valid (codecs' incremental decoder held them)
    assert [det.push(i) for i in _byte_ids(tok, b"\xed\xa0")] == ["", "\ufffd\ufffd"]
    assert det.push(_byte_ids(tok, b"\xf0")[0]) == "" and det.flush() == "\ufffd"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([*range(0x80, 0x100), 0x41, 0x20]), max_size=24))
def test_incremental_detokenizer_holds_only_an_incomplete_character(tok, data):
    """After every byte token the text out so far is the whole decode but for a trailing valid prefix of
    a character (at most 3 bytes)."""
    det = IncrementalDetokenizer(tok)
    out = ""
    for k in range(len(data)):
        out += det.push(_byte_ids(tok, data[k:k + 1])[0])
        buf = bytes(data[:k + 1])
        hold = max([j for j in range(1, min(3, len(buf)) + 1) if _incomplete(buf[-j:])], default=0)
        assert out == buf[:len(buf) - hold].decode("utf-8", errors="replace"), buf
    assert out + det.flush() == bytes(data).decode("utf-8", errors="replace")


def _incomplete(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError as e:
        return e.start == 0 and e.reason == "unexpected end of data"
    return False


def test_metadata_survives_a_gguf_file(tmp_path, meta):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "tok.gguf"
    w = gguf.GGUFWriter(str(path), "gemma4")
    for k, v in meta.items():
        if isinstance(v, bool):
            w.add_bool(k, v)
        elif isinstance(v, int):
            w.add_uint32(k, v)
        elif isinstance(v, str):
            w.add_string(k, v)
        elif k.endswith("scores"):
            w.add_array(k, [float(x) for x in v])
        else:
            w.add_array(k, v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = gguf.GGUFReader(str(path))
    back = {}
    for k in meta:
        f = r.fields[k]
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            back[k] = f.contents()
        else:
            back[k] = f.contents()
    assert back["tokenizer.ggml.tokens"] == meta["tokenizer.ggml.tokens"]
    assert back["tokenizer.ggml.merges"] == meta["tokenizer.ggml.merges"]
    assert [int(x) for x in back["tokenizer.ggml.token_type"]] == meta["tokenizer.ggml.token_type"]
    assert back["tokenizer.chat_template"] == meta["tokenizer.chat_template"]
    t = Tokenizer.from_metadata(back)
    assert t.encode(TEXTS[12]) == Tokenizer.from_metadata(meta).encode(TEXTS[12])
    assert CONTROL == 3
