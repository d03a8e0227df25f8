"""TikToken-format byte-level BPE tokenizer (the `tiktoken.model` file K3 ships) with special tokens.

File format: one line per token, `base64(token bytes) rank`, ranks 0..n-1; a piece of text is split by the
pre-tokenizer regex and each piece's bytes are merged pairwise, lowest rank first (tiktoken's algorithm).
Special tokens get ids after the ranks (or the ids given); `tokenizer_config.json` next to the file
(`added_tokens_decoder: {id: {"content": ...}}`) is read when present, as Kimi checkpoints ship it.

Uses the `tiktoken` package when importable (fast), else an equivalent pure-Python BPE. `train_bpe` derives a
tiny rank file from a text, deterministically, for tests.
"""
from __future__ import annotations

import base64
import collections
import json
import logging
from pathlib import Path

import regex

log = logging.getLogger(__name__)

# Kimi-style pre-tokenizer: runs of Han characters, then cl100k-like words / numbers / punctuation / spaces.
PAT_STR = "|".join([
    r"[\p{Han}]+",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)",
    r"[^\r\n\p{L}\p{N}]?\p{L}+",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])


def load_ranks(path: "str | Path") -> dict[bytes, int]:
    """Read a tiktoken.model file. Raises ValueError naming the line for a malformed one."""
    ranks: dict[bytes, int] = {}
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            tok, rank = line.split()
            ranks[base64.b64decode(tok, validate=True)] = int(rank)
        except ValueError as e:
            raise ValueError(f"{path}:{i}: expected 'base64(token) rank', got {line[:60]!r}") from e
    return ranks


def write_ranks(path: "str | Path", ranks: dict[bytes, int]) -> Path:
    """Write ranks as a tiktoken.model file (sorted by rank)."""
    path = Path(path)
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in sorted(ranks.items(), key=lambda x: x[1])))
    return path


def train_bpe(text: str, vocab_size: int, pat_str: str = PAT_STR) -> dict[bytes, int]:
    """Deterministic byte-level BPE training: ranks 0..255 are the single bytes, then the most frequent adjacent
    pair is merged until `vocab_size` tokens (ties: the lexicographically smallest pair of byte strings).
    Raises ValueError when vocab_size < 256."""
    if vocab_size < 256:
        raise ValueError(f"vocab_size = {vocab_size}: must be >= 256 (one token per byte)")
    ranks = {bytes([b]): b for b in range(256)}
    words = collections.Counter(tuple(bytes([b]) for b in m.encode()) for m in regex.findall(pat_str, text))
    while len(ranks) < vocab_size:
        pairs: collections.Counter = collections.Counter()
        for w, c in words.items():
            for a, b in zip(w, w[1:]):
                pairs[(a, b)] += c
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merged = best[0] + best[1]
        if merged not in ranks:
            ranks[merged] = len(ranks)
        new = collections.Counter()
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(merged)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new[tuple(out)] += c
        words = new
    return ranks


def bpe_encode_piece(piece: bytes, ranks: dict[bytes, int]) -> list[int]:
    """Merge one pre-tokenized piece: repeatedly join the adjacent pair with the lowest rank."""
    if piece in ranks:
        return [ranks[piece]]
    parts = [piece[i:i + 1] for i in range(len(piece))]
    while len(parts) > 1:
        best, best_rank = -1, None
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and (best_rank is None or r < best_rank):
                best, best_rank = i, r
        if best < 0:
            break
        parts[best: best + 2] = [parts[best] + parts[best + 1]]
    return [ranks[p] for p in parts]


class Tokenizer:
    """encode(text) -> ids, decode(ids) -> text. special_tokens: {text: id}; bos/eos ids come from the caller
    (the model config). Raises ValueError on a rank file missing one of the 256 single bytes."""

    def __init__(self, ranks: dict[bytes, int], special_tokens: dict[str, int] | None = None,
                 pat_str: str = PAT_STR, use_tiktoken: bool = True):
        missing = [b for b in range(256) if bytes([b]) not in ranks]
        if missing:
            raise ValueError(f"ranks: single bytes {missing[:5]} have no rank; a byte-level BPE needs all 256")
        self.ranks, self.pat_str = ranks, pat_str
        n = max(ranks.values()) + 1
        self.special_tokens = dict(special_tokens or {})
        self.n_vocab = max([n] + [i + 1 for i in self.special_tokens.values()])
        self._decoder = {r: t for t, r in ranks.items()}
        self._special_decoder = {i: s.encode() for s, i in self.special_tokens.items()}
        self._pat = regex.compile(pat_str)
        self._special_pat = (regex.compile("|".join(regex.escape(s) for s in sorted(self.special_tokens, key=len, reverse=True)))
                             if self.special_tokens else None)
        self._tt = None
        if use_tiktoken:
            try:
                import tiktoken
                self._tt = tiktoken.Encoding("k3", pat_str=pat_str, mergeable_ranks=ranks,
                                             special_tokens=self.special_tokens)
            except ImportError:
                log.debug("tiktoken not installed; using the pure-Python BPE")

    @classmethod
    def from_file(cls, path: "str | Path", special_tokens: dict[str, int] | None = None, **kw) -> "Tokenizer":
        """Load `tiktoken.model` and, when present beside it, the special tokens of tokenizer_config.json."""
        path = Path(path)
        ranks = load_ranks(path)
        specials = {}
        cfg = path.with_name("tokenizer_config.json")
        if cfg.is_file():
            for i, t in json.loads(cfg.read_text()).get("added_tokens_decoder", {}).items():
                specials[t["content"]] = int(i)
        specials.update(special_tokens or {})
        return cls(ranks, specials, **kw)

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        """Token ids of text; special token strings map to their ids when allow_special (else encoded as text)."""
        if self._tt is not None:
            return self._tt.encode(text, allowed_special="all" if allow_special else set(), disallowed_special=())
        out: list[int] = []
        pos = 0
        chunks = []
        if allow_special and self._special_pat is not None:
            for m in self._special_pat.finditer(text):
                chunks.append((text[pos:m.start()], None))
                chunks.append((None, self.special_tokens[m.group()]))
                pos = m.end()
        chunks.append((text[pos:], None))
        for part, special in chunks:
            if special is not None:
                out.append(special)
                continue
            for piece in self._pat.findall(part):
                out.extend(bpe_encode_piece(piece.encode(), self.ranks))
        return out

    def decode_bytes(self, ids) -> bytes:
        """Raises KeyError naming an id that is neither a rank nor a special token."""
        try:
            return b"".join(self._decoder[i] if i in self._decoder else self._special_decoder[i] for i in ids)
        except KeyError as e:
            raise KeyError(f"token id {e.args[0]} is not in the vocabulary ({self.n_vocab})") from None

    def decode(self, ids) -> str:
        return self.decode_bytes([int(i) for i in ids]).decode("utf-8", errors="replace")
