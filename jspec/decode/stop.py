"""Stop strings, matched exactly on the device inside the compiled decode loops.

A stop string ends a row at the first committed token whose bytes complete it, across token
boundaries and inside a token alike. The host builds, once per request, a byte-level Aho-Corasick
automaton over the stop strings' UTF-8 bytes and folds it over the vocabulary into a token table

    T[state, token] = the automaton's state after feeding the token's bytes, or STOPPED (-1) when one
                      of the strings is completed at any byte of the token.

Only the automaton's live states (those where no string has been completed) are rows of T, and a row
that reaches STOPPED is done, so T has at most 1 + (total stop bytes) - (number of strings) rows,
padded to a bucket of STATE_BUCKETS. The compiled loops read T as a traced input (`ar.Request`): other
stop strings of the same bucket reuse the compiled program. Per row, the loop carries its automaton
state and `ar.append_tokens` advances it over the offered tokens.

Token bytes (`token_bytes`) are the bytes a token adds to the text in context: a ByteLevel (GPT-2
style) token maps its characters back through the byte-to-unicode table; a Metaspace / sentencepiece
token turns its `▁` into a space (kept for the first generated token too, as the text reads after the
prompt) and a `<0xNN>` byte-fallback token is that byte; any other tokenizer gives the UTF-8 of
`tokenizer.decode([id])`. Special tokens (which `decode` skips) add no bytes, nor do ids past the
tokenizer's vocabulary.

`trim` is the host-side text convention: the text cut just before the first stop string.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import re

import numpy as np

MAX_STOP_BYTES = 256  # total UTF-8 bytes of a request's stop strings
STATE_BUCKETS = (8, 16, 32, 64, 128, 256)  # table rows a request's automaton is padded to
STOPPED = -1  # table entry: a stop string is completed inside this token
TABLE_DTYPE = np.int16

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def check_stops(stops) -> tuple[str, ...]:
    """The request's stop strings, de-duplicated in order; ValueError naming the problem and the fix for a
    bare string, a non-string, an empty string or more than MAX_STOP_BYTES bytes in all."""
    if isinstance(stops, (str, bytes)):
        raise ValueError(f"stop must be a list of strings, got the single {type(stops).__name__} {stops!r}: pass "
                         f"stop=[{stops!r}]")
    try:
        stops = list(stops)
    except TypeError:
        raise ValueError(f"stop must be a list of strings, got {stops!r}: pass e.g. stop=['\\n\\n']") from None
    bad = [s for s in stops if not isinstance(s, str)]
    if bad:
        raise ValueError(f"stop strings must be str, got {bad[:4]!r}: pass text (token ids go in stop_ids)")
    if any(s == "" for s in stops):
        raise ValueError("an empty stop string would stop every row at once: drop it from stop")
    out = tuple(dict.fromkeys(stops))
    total = sum(len(s.encode("utf-8")) for s in out)
    if total > MAX_STOP_BYTES:
        raise ValueError(f"the stop strings have {total} UTF-8 bytes in all, more than the {MAX_STOP_BYTES} the "
                         "on-device matcher holds: pass fewer or shorter stop strings")
    return out


def trim(text: str, stops) -> str:
    """`text` cut just before the earliest occurrence of any of `stops` (unchanged when none occurs): the
    returned text never contains a stop string, while a stopped row's tokens end with the token that
    completed one."""
    cut = len(text)
    for s in stops:
        if s:
            at = text.find(s, 0, cut + len(s) - 1)  # an occurrence starting before the current cut
            if 0 <= at < cut:
                cut = at
    return text[:cut]


def byte_unicode_table() -> dict[int, str]:
    """The GPT-2 ByteLevel map from a byte to the printable character that stands for it in a token."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _types(node) -> list[dict]:
    """A tokenizer.json component and, for a Sequence, its members (flattened)."""
    if not isinstance(node, dict):
        return []
    if node.get("type") == "Sequence":
        members = node.get("decoders") or node.get("pretokenizers") or node.get("normalizers") or []
        return [m for member in members for m in _types(member)]
    return [node]


def tokenizer_kind(tokenizer) -> tuple[str, dict]:
    """("bytelevel" | "metaspace" | "decode", details) from the tokenizer's JSON (`to_str()`)."""
    return _kind(json.loads(tokenizer.to_str()))


def _kind(spec: dict) -> tuple[str, dict]:
    decoders = _types(spec.get("decoder"))
    names = [d.get("type") for d in decoders]
    model = spec.get("model") or {}
    pre = [p.get("type") for p in _types(spec.get("pre_tokenizer"))]
    if "ByteLevel" in names or (not decoders and "ByteLevel" in pre):
        return "bytelevel", {}
    space = None
    for d in decoders:
        if d.get("type") == "Metaspace":
            space = d.get("replacement", "▁")
        elif d.get("type") == "Replace" and (d.get("content") == " ") and isinstance(d.get("pattern"), dict):
            space = d["pattern"].get("String") or space
    if space is not None or "ByteFallback" in names:
        return "metaspace", {"space": space or "▁", "byte_fallback": bool(model.get("byte_fallback"))
                             or "ByteFallback" in names}
    return "decode", {}


def token_bytes(tokenizer, vocab_size: int) -> list[bytes]:
    """The bytes each id in [0, vocab_size) adds to the text (see the module's docstring)."""
    spec = json.loads(tokenizer.to_str())
    kind, info = _kind(spec)
    added = {int(t["id"]): bool(t.get("special")) for t in spec.get("added_tokens") or []}
    strings: list[str | None] = [None] * vocab_size
    for s, i in tokenizer.get_vocab(with_added_tokens=True).items():
        if 0 <= i < vocab_size:
            strings[i] = s
    out = [b""] * vocab_size
    by_decode = []  # ids whose bytes come from tokenizer.decode
    if kind == "bytelevel":
        inverse = {c: b for b, c in byte_unicode_table().items()}
    for i, s in enumerate(strings):
        if s is None or added.get(i):  # no token, or a special token decode skips
            continue
        if i in added or kind == "decode":
            by_decode.append(i)
        elif kind == "bytelevel":
            try:
                out[i] = bytes(inverse[c] for c in s)
            except KeyError:
                by_decode.append(i)
        else:
            m = _BYTE_FALLBACK.fullmatch(s) if info["byte_fallback"] else None
            out[i] = bytes([int(m.group(1), 16)]) if m else s.replace(info["space"], " ").encode("utf-8")
    if by_decode:
        for i, text in zip(by_decode, tokenizer.decode_batch([[i] for i in by_decode], skip_special_tokens=True)):
            out[i] = text.encode("utf-8")
    return out


@dataclasses.dataclass(frozen=True)
class VocabBytes:
    """A vocabulary's token bytes, laid out for the table fold: ids sorted by byte length (longest first),
    so the tokens still being fed at byte position j are a prefix of `order`."""

    order: np.ndarray  # [V] ids, by decreasing byte length
    lengths: np.ndarray  # [V] byte lengths in that order
    starts: np.ndarray  # [V] offsets into flat, in that order
    flat: np.ndarray  # [sum of lengths] uint8

    @classmethod
    def of(cls, tokens: list[bytes]) -> "VocabBytes":
        lengths = np.fromiter((len(t) for t in tokens), np.int64, len(tokens))
        order = np.argsort(-lengths, kind="stable")
        flat = np.frombuffer(b"".join(tokens[i] for i in order), np.uint8)
        sorted_len = lengths[order]
        starts = np.concatenate([[0], np.cumsum(sorted_len)[:-1]]).astype(np.int64)
        return cls(order, sorted_len, starts, flat)


def automaton(patterns) -> tuple[np.ndarray, int]:
    """The byte automaton of `patterns` (non-empty bytes) over its live states: (delta [L + 1, 256] int32, L).
    State 0 is the start; row L is absorbing: a pattern was completed (live states are those where none is)."""
    goto: list[dict[int, int]] = [{}]
    end = [False]
    for p in patterns:
        s = 0
        for b in p:
            if b not in goto[s]:
                goto[s][b] = len(goto)
                goto.append({})
                end.append(False)
            s = goto[s][b]
        end[s] = True
    n = len(goto)
    delta = np.zeros((n, 256), np.int32)
    fail = [0] * n
    out = list(end)
    queue = collections.deque()
    for b, c in goto[0].items():
        delta[0, b] = c
        queue.append(c)
    while queue:  # breadth first: a state's failure state is shallower, so complete already
        s = queue.popleft()
        out[s] = out[s] or out[fail[s]]
        delta[s] = delta[fail[s]]
        for b, c in goto[s].items():
            fail[c] = int(delta[fail[s], b])
            delta[s, b] = c
            queue.append(c)
    out = np.asarray(out)
    live = np.flatnonzero(~out)  # state 0 first: no pattern is empty
    n_live = len(live)
    renum = np.full(n, n_live, np.int32)
    renum[live] = np.arange(n_live, dtype=np.int32)
    live_delta = np.full((n_live + 1, 256), n_live, np.int32)
    live_delta[:n_live] = renum[delta[live]]  # a completed state is renumbered to the absorbing row
    return live_delta, n_live


def bucket(states: int) -> int:
    for b in STATE_BUCKETS:
        if states <= b:
            return b
    raise ValueError(f"{states} automaton states exceed the largest table of {STATE_BUCKETS[-1]}: pass fewer or "
                     "shorter stop strings")


def fold(patterns, vocab: VocabBytes, vocab_size: int) -> np.ndarray:
    """The token table T [bucket, vocab_size] (TABLE_DTYPE) of `patterns` over a vocabulary's bytes."""
    delta, n_live = automaton(patterns)
    cur = np.broadcast_to(np.arange(n_live, dtype=np.int32)[:, None], (n_live, vocab_size)).copy()
    longest = int(vocab.lengths[0]) if vocab_size else 0
    fed = np.searchsorted(-vocab.lengths, -np.arange(longest), side="left")  # [j]: tokens longer than j bytes
    for j in range(longest):
        n = int(fed[j])
        byte = vocab.flat[vocab.starts[:n] + j]
        cur[:, :n] = delta[cur[:, :n], byte[None, :]]
    table = np.zeros((bucket(n_live), vocab_size), TABLE_DTYPE)  # padding rows are never reached
    table[:n_live, vocab.order] = np.where(cur == n_live, STOPPED, cur)
    return table


_VOCABS: collections.OrderedDict = collections.OrderedDict()  # (id(tokenizer), V) -> (tokenizer, VocabBytes)
_TABLES: collections.OrderedDict = collections.OrderedDict()  # (id(tokenizer), V, stops) -> (tokenizer, T)


def _remember(cache: collections.OrderedDict, key, value, size: int):
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > size:
        cache.popitem(last=False)
    return value


def vocab_bytes(tokenizer, vocab_size: int) -> VocabBytes:
    """`token_bytes` laid out for `fold`, kept for the last few tokenizers (it reads the whole vocabulary)."""
    key = (id(tokenizer), vocab_size)
    hit = _VOCABS.get(key)
    if hit is not None and hit[0] is tokenizer:
        _VOCABS.move_to_end(key)
        return hit[1]
    return _remember(_VOCABS, key, (tokenizer, VocabBytes.of(token_bytes(tokenizer, vocab_size))), 4)[1]


def build_table(tokenizer, stops, vocab_size: int) -> np.ndarray:
    """The token table T [bucket, vocab_size] of the stop strings `stops` (checked by `check_stops`) for
    this tokenizer; what `ar.DecodeConfig.stop_table` takes."""
    stops = check_stops(stops)
    key = (id(tokenizer), vocab_size, stops)
    hit = _TABLES.get(key)
    if hit is not None and hit[0] is tokenizer:
        _TABLES.move_to_end(key)
        return hit[1]
    table = fold([s.encode("utf-8") for s in stops], vocab_bytes(tokenizer, vocab_size), vocab_size)
    table.setflags(write=False)
    return _remember(_TABLES, key, (tokenizer, table), 4)[1]
