"""K3's tokenizer (CHAT.md §1): tiktoken byte-level BPE over `tiktoken.model` with K3's pre-tokenizer, plus the 256
reserved special ids after the ranks.

    tok = Tokenizer.from_file(ckpt / "tiktoken.model")     # names the specials from tokenizer_config.json beside it
    tok.encode("user text")                                 # ordinary text only: "<|open|>" typed by a user is BPE
    tok.special_id("<|open|>")                              # a special token's id (the renderer's markers)
    tok.decode(ids)                                         # every id in [0, n_vocab) decodes

`encode` reproduces Kimi's `TikTokenTokenizer.encode`: the text is cut into 400,000-character pieces, each piece
into runs of at most 25,000 consecutive whitespace / non-whitespace characters, and each run is encoded by tiktoken
with special tokens disabled. A special id decodes to its name (`decode(..., skip_special=True)` drops them).
"""
from __future__ import annotations

import base64
import json
import logging
from pathlib import Path
from typing import Iterable, Iterator

import tiktoken

from k3deploy.model.vocab import NUM_SPECIAL, PAT_STR, special_names

log = logging.getLogger(__name__)

__all__ = ["Tokenizer", "load_ranks", "PAT_STR", "NUM_SPECIAL"]

MAX_ENCODE_CHARS = 400_000          # Kimi's tiktoken chunk (characters)
MAX_SAME_CLASS_CHARS = 25_000       # Kimi's longest run of whitespace / non-whitespace characters per encode


def load_ranks(path: "str | Path") -> dict[bytes, int]:
    """Read a tiktoken.model file -> {token bytes: rank}. Raises ValueError naming the line for a malformed one, and
    when the ranks are not dense 0..n-1 or a token repeats."""
    ranks: dict[bytes, int] = {}
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            tok, rank = line.split()
            b = base64.b64decode(tok, validate=True)
            r = int(rank)
        except ValueError as e:
            raise ValueError(f"{path}:{i}: expected 'base64(token) rank', got {line[:60]!r}") from e
        if b in ranks:
            raise ValueError(f"{path}:{i}: token {b!r} repeats (first at rank {ranks[b]})")
        ranks[b] = r
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks are not dense 0..{len(ranks) - 1}; tiktoken.model lists each rank once")
    return ranks


def _runs(text: str) -> Iterator[str]:
    """Kimi's encode chunks: pieces of MAX_ENCODE_CHARS characters, each cut so that no run of consecutive
    whitespace (str.isspace) or non-whitespace characters exceeds MAX_SAME_CLASS_CHARS."""
    for start in range(0, len(text), MAX_ENCODE_CHARS):
        piece = text[start:start + MAX_ENCODE_CHARS]
        cut, run, space = 0, 0, piece[:1].isspace()
        for i, ch in enumerate(piece):
            if ch.isspace() != space:
                space, run = not space, 1
                continue
            run += 1
            if run > MAX_SAME_CLASS_CHARS:
                yield piece[cut:i]
                cut, run = i, 1
        yield piece[cut:]


class Tokenizer:
    """K3's tokenizer over `ranks` (dense 0..n-1) and NUM_SPECIAL specials n..n+255.

    Args:
        ranks: {token bytes: rank}; must hold the 256 single bytes.
        special_names: {id: name} for ids n..n+255 (tokenizer_config.json's); others are `<|reserved_token_{id}|>`.
    Raises:
        ValueError: a single byte has no rank, or a special id lies outside n..n+255.
    """

    def __init__(self, ranks: dict[bytes, int], special_names_by_id: "dict[int, str] | None" = None):
        missing = [b for b in range(256) if bytes([b]) not in ranks]
        if missing:
            raise ValueError(f"ranks: single bytes {missing[:5]} have no rank; a byte-level BPE needs all 256")
        n = len(ranks)
        named = dict(special_names_by_id or {})
        bad = [i for i in named if not n <= i < n + NUM_SPECIAL]
        if bad:
            raise ValueError(f"special tokens {bad[:5]}: ids must be in [{n}, {n + NUM_SPECIAL}) (the {NUM_SPECIAL} "
                             f"reserved ids after the {n} ranks)")
        names = special_names(n, named)
        if len(set(names)) != len(names):
            raise ValueError("special tokens: two ids share a name in tokenizer_config.json")
        self.num_ranks = n
        self.n_vocab = n + NUM_SPECIAL
        self.special_ids: dict[str, int] = {name: n + off for off, name in enumerate(names)}
        self.special_names: dict[int, str] = {i: s for s, i in self.special_ids.items()}
        self._enc = tiktoken.Encoding("k3", pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens=self.special_ids)

    @classmethod
    def from_file(cls, path: "str | Path") -> "Tokenizer":
        """Load `tiktoken.model` and name the specials from `tokenizer_config.json` beside it (when present).
        Raises ValueError for a malformed file (naming it), FileNotFoundError when `path` is missing."""
        path = Path(path)
        ranks = load_ranks(path)
        named: dict[int, str] = {}
        cfg = path.with_name("tokenizer_config.json")
        if cfg.is_file():
            try:
                added = json.loads(cfg.read_text()).get("added_tokens_decoder", {})
                named = {int(i): t["content"] for i, t in added.items()}
            except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
                raise ValueError(f"{cfg}: added_tokens_decoder must map ids to {{'content': name}} ({e})") from e
        else:
            log.warning("%s: no tokenizer_config.json beside it; special tokens are unnamed "
                        "(<|reserved_token_N|>)", path)
        return cls(ranks, named)

    # ---- encoding ---------------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of `text` as ordinary text: special-token names in it are BPE-encoded like any characters."""
        if not isinstance(text, str):
            raise ValueError(f"encode: expected str, got {type(text).__name__}")
        out: list[int] = []
        for run in _runs(text):
            out += self._enc.encode_ordinary(run)
        return out

    def special_id(self, name: str) -> int:
        """The id of special token `name`. Raises ValueError naming it when the tokenizer has no such token."""
        try:
            return self.special_ids[name]
        except KeyError:
            raise ValueError(f"special token {name!r} is not in this tokenizer (tokenizer_config.json beside "
                             "tiktoken.model names K3's special tokens)") from None

    def encode_segments(self, segments: Iterable[tuple[str, bool]]) -> list[int]:
        """Segments `(text, special)` -> ids: each text segment encoded on its own (no merge crosses a boundary),
        each special segment one id (CHAT.md §2)."""
        out: list[int] = []
        for text, special in segments:
            if special:
                out.append(self.special_id(text))
            else:
                out += self.encode(text)
        return out

    # ---- decoding ---------------------------------------------------------------------------------------------
    def is_special(self, token_id: int) -> bool:
        return self.num_ranks <= token_id < self.n_vocab

    def token_bytes(self, token_id: int) -> bytes:
        """Bytes of one id (a special's name in UTF-8). Raises ValueError for an id outside [0, n_vocab)."""
        if not 0 <= token_id < self.n_vocab:
            raise ValueError(f"token id {token_id} is not in the vocabulary [0, {self.n_vocab})")
        if token_id >= self.num_ranks:
            return self.special_names[token_id].encode()
        return self._enc.decode_single_token_bytes(token_id)

    def decode_bytes(self, ids: Iterable[int], skip_special: bool = False) -> bytes:
        """Bytes of ids; specials as their names unless skip_special. ValueError for an id outside the vocabulary."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.n_vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is not in the vocabulary [0, {self.n_vocab})")
        if skip_special:
            ids = [i for i in ids if i < self.num_ranks]
        return self._enc.decode_bytes(ids)

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of ids (invalid UTF-8 replaced by U+FFFD)."""
        return self.decode_bytes(ids, skip_special).decode("utf-8", errors="replace")
