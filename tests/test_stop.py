"""Stop strings and stop ids inside the compiled loops: exact against a host reference that decodes
prefixes with the tokenizer, for plain and speculative decoding; the token table; recompilation; errors."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import jspec
from jspec.api import RequestError
from jspec.decode import ar, spec, stop
from jspec.drafters.base import Drafter, Proposal
from jspec.models import transformer
from jspec.models.config import ModelConfig

CORPUS = ["def add(a, b):\n    return a + b\n\n", "The quick brown fox jumps over the lazy dog.\n\n",
          "naïve café — über straße 中文 ✓ \n", "for i in range(10):\n    print(i)\n\n",
          "class Stack:\n    def push(self, x):\n        self.items.append(x)\n\n"] * 10
TEXTS = ["def add(a, b):", "The quick brown", "for i in range(3):\n"]
NEW = 40


def bytelevel_tokenizer() -> Tokenizer:
    """A GPT-2 style byte-level BPE with one special token."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=330, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def metaspace_tokenizer() -> Tokenizer:
    """A sentencepiece-style BPE (Metaspace `▁`, <0xNN> byte fallback) with the Llama decoder chain, which
    strips the text's leading space."""
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.pre_tokenizer = pre_tokenizers.Metaspace()
    base.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=160, special_tokens=["<unk>", "<s>", "</s>"],
                                                         show_progress=False))
    model = json.loads(base.to_str())["model"]
    vocab = dict(model["vocab"])
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return tok


def _target(tok, pad=0, seed=0):
    cfg = ModelConfig(family="qwen3", vocab_size=tok.get_vocab_size() + pad, hidden_size=32, intermediate_size=64,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True)
    return jspec.Target(cfg, transformer.init_params(cfg, jax.random.key(seed), std=0.3), tok)


@pytest.fixture(scope="module")
def setups():
    """name -> (target, text_of): text_of(ids) is the reference text of generated ids, by the tokenizer."""
    byte_tok, meta_tok = bytelevel_tokenizer(), metaspace_tokenizer()
    anchor = meta_tok.token_to_id("d")  # a plain token: decoding after it keeps the next token's leading space
    assert anchor is not None and meta_tok.decode([anchor]) == "d"
    return {
        "bytelevel": (_target(byte_tok, pad=6), lambda ids: byte_tok.decode(list(ids))),
        "metaspace": (_target(meta_tok, seed=1), lambda ids: meta_tok.decode([anchor, *ids])[1:]),
    }


def _prompts(target):
    return [target.encode(t) for t in TEXTS]


def _free(target):
    return jspec.generate(target, _prompts(target), max_new_tokens=NEW, eos_ids=[])


def _first_stop(ids, text_of, stops):
    """Reference: the number of tokens up to the first whose decoded continuation contains a stop string."""
    for k in range(1, len(ids) + 1):
        if any(s in text_of(ids[:k]) for s in stops):
            return k
    return None


def _ascii(s: str) -> bool:
    return bool(s) and s.isascii()


def _pieces(ids, text_of, k):
    """(text before token k, token k's text in context), or None where the prefix's text is not stable
    (an incomplete UTF-8 character)."""
    before, upto = text_of(ids[:k]), text_of(ids[: k + 1])
    return (before, upto[len(before):]) if upto.startswith(before) else None


def _spanning(ids, text_of, start=2):
    """(stop string, cut): a string that starts in one token and ends in the next (no token holds it)."""
    for k in range(start, len(ids) - 1):
        a, b = _pieces(ids, text_of, k), _pieces(ids, text_of, k + 1)
        if a is None or b is None or not a[1] or not b[1]:
            continue
        for w in (2, 1):
            s = a[1][-w:] + b[1][:1]
            if _ascii(s) and s not in b[1] and _first_stop(ids, text_of, [s]) == k + 2:
                return s, k + 2
    return None


def _mid_token(ids, text_of, start=2):
    """(stop string, cut): a string completed strictly inside one token (the token's text goes on after it)."""
    for k in range(start, len(ids)):
        p = _pieces(ids, text_of, k)
        if p is None:
            continue
        piece = p[1]
        for i in range(len(piece) - 1):
            for w in (2, 1):
                s = piece[i: i + w]
                if i + w < len(piece) and _ascii(s) and _first_stop(ids, text_of, [s]) == k + 1:
                    return s, k + 1
    return None


NEVER = "zq~never~qz"


def _stops_for(target, text_of, free):
    """Stop strings that end two rows at different points, one spanning two tokens, one completed inside a
    token, and one that never occurs; every row stops where the reference says (if at all)."""
    n = len(free.tokens)
    for r0 in range(n):
        found = _spanning(free.tokens[r0], text_of)
        if found is None:
            continue
        for r1 in range(n):
            mid = _mid_token(free.tokens[r1], text_of) if r1 != r0 else None
            if mid is None:
                continue
            stops = [found[0], mid[0], NEVER]
            cuts = [_first_stop(ids, text_of, stops) for ids in free.tokens]
            if cuts[r0] == found[1] and cuts[r1] == mid[1] and cuts[r0] != cuts[r1]:
                assert all(NEVER not in text_of(ids) for ids in free.tokens)
                return stops, cuts
    raise AssertionError("no pair of rows to stop at different points")


@dataclasses.dataclass(frozen=True)
class Replay(Drafter):
    """Proposes the reference continuation (its params: the free run's text buffer [B, S]), so every round
    accepts all drafts and a stop has to cut a round short."""

    g: int = 4

    @property
    def num_drafts(self):
        return self.g

    def propose(self, ref, state, ctx):
        idx = jnp.minimum(ctx.length[:, None] + jnp.arange(self.g)[None], ref.shape[1] - 1)
        return Proposal(jnp.take_along_axis(ref, idx, axis=1)), state


def _replay(target, free):
    """(Replay drafter, its params): the free continuation in buffer layout."""
    prompts = _prompts(target)
    width = max(len(p) for p in prompts) + NEW + 8
    ref = np.zeros((len(prompts), width), np.int32)
    for row, (p, t) in enumerate(zip(prompts, free.tokens)):
        ref[row, : len(p) + len(t)] = p + t
    return Replay(4), jnp.asarray(ref)


def _expect(res, free, cuts):
    for row, cut in enumerate(cuts):
        assert res.tokens[row] == free.tokens[row][: cut or NEW], row
        np.testing.assert_allclose(res.logprobs[row], free.logprobs[row][: cut or NEW], atol=1e-4)
    assert res.stats["stopped_by"] == ["stop" if cut else "max_new_tokens" for cut in cuts]


@pytest.mark.parametrize("name", ["bytelevel", "metaspace"])
@pytest.mark.parametrize("drafter", [None, "lookup", "replay"])
def test_stop_strings_end_rows_exactly(setups, name, drafter):
    target, text_of = setups[name]
    free = _free(target)
    stops, cuts = _stops_for(target, text_of, free)
    dr = {None: {}, "lookup": dict(drafter="lookup", block_size=3), "replay": dict(drafter=_replay(target, free))}
    res = jspec.generate(target, _prompts(target), max_new_tokens=NEW, eos_ids=[], stop=stops, **dr[drafter])
    _expect(res, free, cuts)
    for row, ids in enumerate(res.tokens):  # vLLM's text convention: cut just before the stop string
        text = stop.trim(text_of(ids), stops)
        assert not any(s in text for s in stops)
        if cuts[row]:
            assert text_of(ids).startswith(text) and any(text_of(ids)[len(text):].startswith(s) for s in stops)


def test_the_prompt_does_not_count(setups):
    """A stop string made of the prompt's last character and the first generated one does not stop the row
    at its first token."""
    target, text_of = setups["bytelevel"]
    free = _free(target)
    first = text_of(free.tokens[0][:1])
    s = TEXTS[0][-1] + first[:1]
    assert _ascii(first[:1]) and (TEXTS[0] + first).find(s) == len(TEXTS[0]) - 1
    cut = _first_stop(free.tokens[0], text_of, [s])
    assert cut != 1
    res = jspec.generate(target, _prompts(target)[:1], max_new_tokens=NEW, eos_ids=[], stop=[s])
    assert res.tokens[0] == free.tokens[0][: cut or NEW]


def test_a_stop_string_at_the_first_token(setups):
    """A stop string inside the prefill's token (the first generated) ends the row there."""
    target, text_of = setups["bytelevel"]
    free = _free(target)
    first = text_of(free.tokens[0][:1])
    s = next(c for c in first if _ascii(c))
    res = jspec.generate(target, _prompts(target), max_new_tokens=NEW, eos_ids=[], stop=[s])
    cuts = [_first_stop(ids, text_of, [s]) for ids in free.tokens]
    assert cuts[0] == 1
    _expect(res, free, cuts)


def test_stop_ids_end_rows_like_eos(setups):
    target, _ = setups["bytelevel"]
    free = _free(target)
    sid = free.tokens[0][6]
    eos = next(t for t in free.tokens[1][3:] if t not in free.tokens[0][:7] and t != sid)
    for kw in ({}, dict(drafter="lookup", block_size=3), dict(drafter=_replay(target, free))):
        res = jspec.generate(target, _prompts(target), max_new_tokens=NEW, eos_ids=[eos], stop_ids=[sid], **kw)
        why = []
        for row, ids in enumerate(free.tokens):
            cut = next((i + 1 for i, t in enumerate(ids) if t in (sid, eos)), None)
            assert res.tokens[row] == ids[: cut or NEW]
            why.append("max_new_tokens" if cut is None else "eos" if ids[cut - 1] == eos else "stop")
        assert res.stats["stopped_by"] == why
        assert why[0] == "stop" and why[1] == "eos"
    both = jspec.generate(target, _prompts(target)[:1], max_new_tokens=NEW, eos_ids=[sid], stop_ids=[sid])
    assert both.stats["stopped_by"] == ["eos"]  # an id in both lists reports EOS


def test_stop_strings_and_stop_ids_together(setups):
    target, text_of = setups["bytelevel"]
    free = _free(target)
    stops, cuts = _stops_for(target, text_of, free)
    sid = free.tokens[0][cuts[0] - 2]  # a stop id one token before row 0's stop string
    res = jspec.generate(target, _prompts(target), max_new_tokens=NEW, eos_ids=[], stop=stops, stop_ids=[sid],
                         drafter=_replay(target, free))
    for row, ids in enumerate(free.tokens):
        by_id = next((i + 1 for i, t in enumerate(ids) if t == sid), None)
        cut = min(c for c in (by_id, cuts[row], NEW) if c)
        assert res.tokens[row] == ids[:cut]
    assert res.stats["stopped_by"][0] == "stop"


def test_other_stop_strings_reuse_the_compiled_loops(setups):
    target, text_of = setups["bytelevel"]
    free = _free(target)
    stops, cuts = _stops_for(target, text_of, free)
    others = ["def ", "ab", "x y z"]
    vocab = target.cfg.vocab_size
    table = stop.build_table(target.tokenizer, stops, vocab)
    assert table.dtype == stop.TABLE_DTYPE and table.shape == stop.build_table(target.tokenizer, others, vocab).shape
    kw = dict(max_new_tokens=NEW, eos_ids=[])
    jspec.generate(target, _prompts(target), stop=others, **kw)
    jspec.generate(target, _prompts(target), stop=others, drafter="lookup", block_size=3, **kw)
    compiled = ar.generate_ar._cache_size(), spec.generate_spec._cache_size()
    plain = jspec.generate(target, _prompts(target), stop=stops, **kw)
    fast = jspec.generate(target, _prompts(target), stop=stops, drafter="lookup", block_size=3, **kw)
    jspec.generate(target, _prompts(target), stop=["ab", "x y z", "def "], **kw)
    assert (ar.generate_ar._cache_size(), spec.generate_spec._cache_size()) == compiled
    _expect(plain, free, cuts)
    _expect(fast, free, cuts)
    # Another bucket is another program; no stop strings at all is the program without a table.
    assert stop.build_table(target.tokenizer, ["y" * 40], vocab).shape[0] == 64 != table.shape[0]
    jspec.generate(target, _prompts(target), stop=["y" * 40], **kw)
    assert ar.generate_ar._cache_size() == compiled[0] + 1
    assert ar.DecodeConfig(8, 32).request().stop_table is None
    static = ar.DecodeConfig(8, 32, stop_table=table).static()
    assert static.stop_table == jax.ShapeDtypeStruct(table.shape, table.dtype) and hash(static)


def test_stop_strings_with_streaming(setups):
    target, text_of = setups["bytelevel"]
    free = _free(target)
    stops, cuts = _stops_for(target, text_of, free)
    chunks = []
    res = jspec.generate(target, _prompts(target), max_new_tokens=NEW, eos_ids=[], stop=stops,
                         drafter=_replay(target, free), on_commit=chunks.append)
    _expect(res, free, cuts)
    for row in range(len(TEXTS)):
        assert sum((c[row] for c in chunks), []) == res.tokens[row]


# --- the token table, host side ------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [bytelevel_tokenizer, metaspace_tokenizer])
def test_token_bytes_match_the_tokenizer(make):
    tok = make()
    n = tok.get_vocab_size()
    got = stop.token_bytes(tok, n + 3)
    assert got[n:] == [b""] * 3  # ids past the tokenizer's vocabulary add nothing
    kind = stop.tokenizer_kind(tok)[0]
    assert kind == ("bytelevel" if make is bytelevel_tokenizer else "metaspace")
    specials = {t["id"] for t in json.loads(tok.to_str())["added_tokens"] if t["special"]}
    anchor = tok.token_to_id("d")
    for i in range(n):
        if i in specials:
            assert got[i] == b""
        if kind == "bytelevel":
            assert got[i].decode("utf-8", "replace") == tok.decode([i]), i
        else:  # after a plain token, so the decoder's strip of the text's leading space does not apply
            assert (b"d" + got[i]).decode("utf-8", "replace") == tok.decode([anchor, i]), i
    if kind == "metaspace":
        assert got[tok.token_to_id("<0xE4>")] == b"\xe4" and got[tok.token_to_id("▁")] == b" "


def test_other_tokenizers_fall_back_to_decode():
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2, "[SEP]": 3}, unk_token="[UNK]"))
    tok.add_special_tokens(["[SEP]"])
    assert stop.tokenizer_kind(tok)[0] == "decode"
    assert stop.token_bytes(tok, 4) == [b"[UNK]", b"hello", b"world", b""]


def test_table_matches_a_byte_search():
    """Random token sequences fed through the table stop exactly where the bytes first contain a string."""
    rng = np.random.default_rng(0)
    alphabet = b"ab\n x"
    vocab = [bytes(rng.choice(list(alphabet), size=rng.integers(0, 5))) for _ in range(60)]
    vb = stop.VocabBytes.of(vocab)
    for stops in ([b"ab"], [b"\n\n", b"xa"], [b"aba", b"ba", b"b"], [b"a b a", b"b a b x"], [b"x" * 9]):
        table = stop.fold(stops, vb, len(vocab))
        assert table.shape[0] == stop.bucket(table.shape[0]) >= 1
        for _ in range(200):
            seq = rng.integers(0, len(vocab), size=20)
            state, got = 0, None
            for k, t in enumerate(seq):
                state = int(table[state, t])
                if state == stop.STOPPED:
                    got = k + 1
                    break
            text, want = b"", None
            for k, t in enumerate(seq):
                text += vocab[t]
                if any(s in text for s in stops):
                    want = k + 1
                    break
            assert got == want, (stops, [vocab[t] for t in seq])


def test_table_rows_fit_the_bucket():
    vb = stop.VocabBytes.of([bytes([b]) for b in range(256)])
    assert stop.fold([b"a" * 7], vb, 256).shape == (8, 256)  # 7 live states: the completed one is no row
    assert stop.fold([b"a" * 9], vb, 256).shape == (16, 256)
    assert stop.fold([bytes([65 + i % 26]) * 4 for i in range(64)], vb, 256).shape[0] <= 256
    assert stop.fold([b"q" * 256], vb, 256).shape == (256, 256)


def test_trim():
    assert stop.trim("a\n\nb def c", ["\n\n", "def "]) == "a"
    assert stop.trim("abc", ["x"]) == "abc"
    assert stop.trim("xxabcd", ["bc", "abcd"]) == "xx"  # the earliest occurrence
    assert stop.trim("", ["a"]) == "" and stop.trim("abc", []) == "abc"


# --- refusals -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw, match", [
    (dict(stop="\n\n"), r"list of strings.*stop=\['\\n\\n'\]"),
    (dict(stop=[5]), "must be str"),
    (dict(stop=["ok", ""]), "empty stop string"),
    (dict(stop=["é" * 129]), "258 UTF-8 bytes.*256"),
    (dict(stop=3), "list of strings"),
    (dict(stop_ids=7), "list of token ids"),
    (dict(stop_ids=[1.5]), "integer token ids"),
    (dict(stop_ids=[10**6]), "outside the vocabulary"),
    (dict(on_commit=5), "callable"),
])
def test_bad_stop_arguments_are_refused(setups, kw, match):
    target, _ = setups["bytelevel"]
    before = ar.generate_ar._cache_size()
    with pytest.raises(RequestError, match=match):
        jspec.generate(target, [[1, 2, 3]], max_new_tokens=4, **kw)
    assert ar.generate_ar._cache_size() == before


def test_stop_strings_need_a_tokenizer(setups):
    target, _ = setups["bytelevel"]
    bare = dataclasses.replace(target, tokenizer=None)
    with pytest.raises(RequestError, match="tokenizer.*stop_ids"):
        jspec.generate(bare, [[1, 2, 3]], max_new_tokens=4, stop=["\n"])


def test_streaming_is_refused_with_a_mesh(setups):
    target, _ = setups["bytelevel"]
    mesh = jspec.parallel.make_mesh(devices=jax.devices()[:1])
    with pytest.raises(RequestError, match="mesh"):
        jspec.generate(target, [[1, 2, 3]], max_new_tokens=4, on_commit=print, mesh=mesh)


def test_a_special_tokens_text_stops_on_its_id(setups):
    """A special token decodes to no text: a stop string that is one (`<|im_end|>`) stops on its id, and one
    that holds one among other text, which could never match, is refused."""
    target, _ = setups["bytelevel"]
    free = _free(target)
    tok = Tokenizer.from_str(target.tokenizer.to_str())
    at = next(i for i, t in enumerate(free.tokens[0]) if i >= 3 and tok.id_to_token(t) is not None)
    sid = free.tokens[0][at]
    name = tok.id_to_token(sid)
    tok.add_special_tokens([name])
    assert tok.token_to_id(name) == sid and tok.decode([sid]) == ""
    special = dataclasses.replace(target, tokenizer=tok)
    by_id = jspec.generate(special, _prompts(target), max_new_tokens=NEW, eos_ids=[], stop_ids=[sid])
    by_name = jspec.generate(special, _prompts(target), max_new_tokens=NEW, eos_ids=[], stop=[name])
    assert by_name.tokens == by_id.tokens and by_name.stats["stopped_by"] == by_id.stats["stopped_by"]
    assert by_name.tokens[0] == free.tokens[0][: free.tokens[0].index(sid) + 1]
    assert by_name.stats["stopped_by"][0] == "stop"
    with pytest.raises(RequestError, match=f"holds the special token {name!r}.*stop_ids=\\[{sid}\\]"):
        jspec.generate(special, _prompts(target), max_new_tokens=NEW, stop=["x" + name])
