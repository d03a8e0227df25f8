"""The prefix cache of the hybrid decode state (docs/PREFIX_CACHING.md; MODEL.md §4.4-4.5, §5.3, §9).

A hybrid model can resume a prefix only where it has BOTH the MLA latents of every earlier token and the KDA
recurrent state + conv history at exactly that position (the KDA state is a running summary: it cannot be cut
back to an earlier position). So the unit of reuse is a **snapshot entry** at a token position `length`:

* its KDA rows: a copy of every KDA layer's `state` [H, V, K] and `conv` [3P, W-1] after `length` tokens, in a
  separate snapshot pool (`SnapshotPool`, one row per entry);
* its latent blocks: the `length // block_size` full blocks of the request that wrote it, shared read-only
  (reference counts in `runtime.cache.HybridCache`), plus for a `length` that is not a block multiple the partial
  last block (entries at the end of a finished request only: nobody appends to it any more);
* its key: a hash chain over the token ids. `PrefixChain` digests block i from the digest of block i-1, the
  block's token ids and the content keys overlapping it; an entry's key digests its base (the chain digest of its
  full blocks) with the tokens of the partial tail. Equal keys mean equal tokens [0, length) and equal content
  (up to a 128-bit BLAKE2b collision).

Content keys (the image hook): a request may carry `(start, end, digest)` spans: tokens [start, end) of its prompt
stand for content (an image's placeholder tokens) whose bytes hash to `digest`. They are folded into the digest
of every block and tail they overlap, so two prompts with the same placeholder ids but different images never
share state, and no snapshot position lies strictly inside a span (a resumed prefill never starts mid-image).

Every decision (what matches, which entry is evicted, where chunks are cut) is a function of token ids, content
keys and the order of scheduler events only, so every TP rank takes the same ones.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
from typing import Callable, Sequence

import numpy as np
import torch

ContentKey = tuple[int, int, bytes]     # (start, end, digest): prompt tokens [start, end) stand for this content
TokenSlice = Callable[[int, int], list[int]]   # (start, stop) -> token ids [start, stop) of one request

DEFAULT_SNAPSHOT_INTERVAL = 1024        # tokens between periodic snapshots (rounded up to a block multiple)
_ROOT = hashlib.blake2b(b"k3deploy prefix chain v1", digest_size=16).digest()


def default_snapshot_interval(block_size: int) -> int:
    """DEFAULT_SNAPSHOT_INTERVAL rounded up to a multiple of `block_size` tokens."""
    return -(-DEFAULT_SNAPSHOT_INTERVAL // block_size) * block_size


def default_num_snapshots(max_batch: int) -> int:
    """Snapshot pool rows when none are asked for: two per running request (the end of its reply, where its next
    turn resumes, and one periodic snapshot such as the end of a shared system prompt)."""
    return 2 * max_batch


def check_content_keys(keys, num_tokens: int, field: str = "content_keys") -> tuple[ContentKey, ...]:
    """Validate a request's content keys: an iterable of (start, end, digest) with 0 <= start < end <= num_tokens,
    digest a non-empty bytes or str (str is UTF-8 encoded), spans not overlapping. Returns them as a tuple sorted by
    start. Raises ValueError naming `field`."""
    if keys is None:
        return ()
    out = []
    try:
        items = list(keys)
    except TypeError:
        raise ValueError(f"{field}: expected a list of (start, end, digest) spans, got {type(keys).__name__}") from None
    for item in items:
        try:
            start, end, digest = item
        except (TypeError, ValueError):
            raise ValueError(f"{field}: {item!r} is not a (start, end, digest) triple") from None
        if any(isinstance(v, bool) or not isinstance(v, int) for v in (start, end)) or not 0 <= start < end <= num_tokens:
            raise ValueError(f"{field}: span ({start!r}, {end!r}) must be token positions with 0 <= start < end <= "
                             f"{num_tokens} (the prompt length)")
        if isinstance(digest, str):
            digest = digest.encode()
        if not isinstance(digest, (bytes, bytearray)) or not digest:
            raise ValueError(f"{field}: digest of span ({start}, {end}) must be a non-empty bytes or str content hash")
        out.append((start, end, bytes(digest)))
    out.sort()
    for (s0, e0, _), (s1, _, _) in zip(out, out[1:]):
        if s1 < e0:
            raise ValueError(f"{field}: spans starting at {s0} and {s1} overlap; give each content item its own "
                             "token span")
    return tuple(out)


def inside_span(pos: int, keys: Sequence[ContentKey]) -> bool:
    """True when position `pos` (a token count) cuts a content span: start < pos < end."""
    return any(s < pos < e for s, e, _ in keys)


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.digest()


def _tokens(ids: list[int]) -> bytes:
    return np.asarray(ids, dtype="<i8").tobytes()


def _keys(keys: Sequence[ContentKey], lo: int, hi: int) -> bytes:
    """The content keys overlapping tokens [lo, hi), serialized."""
    return b"".join(s.to_bytes(8, "little") + e.to_bytes(8, "little") + _digest(d)
                    for s, e, d in keys if s < hi and e > lo)


class PrefixChain:
    """Chain digests of one request's full blocks, extended lazily as they are needed.

    digests[0] is the root; digests[i + 1] = H(digests[i], token ids of block i, content keys overlapping it)."""

    def __init__(self, block_size: int, keys: Sequence[ContentKey] = ()):
        self.block_size, self.keys = block_size, tuple(keys)
        self.digests = [_ROOT]

    def base(self, k: int, tokens: TokenSlice) -> bytes:
        """The digest of the first k full blocks."""
        B = self.block_size
        while len(self.digests) <= k:
            i = len(self.digests) - 1
            self.digests.append(_digest(self.digests[i], _tokens(tokens(i * B, (i + 1) * B)),
                                        _keys(self.keys, i * B, (i + 1) * B)))
        return self.digests[k]

    def key(self, length: int, tokens: TokenSlice) -> tuple[bytes, bytes]:
        """(entry key, base digest) of the prefix of `length` tokens."""
        k = length // self.block_size
        base = self.base(k, tokens)
        lo = k * self.block_size
        return _digest(base, b"tail", _tokens(tokens(lo, length)), _keys(self.keys, lo, length)), base


@dataclasses.dataclass(eq=False)
class Snapshot:
    """One published prefix: KDA rows `row` of the snapshot pool after `length` tokens, and the latent `blocks`
    holding tokens [0, length) (length // block_size full blocks, then the partial block if any); `final`: taken at
    the end of a finished request, else at a periodic position."""

    key: bytes
    base: bytes
    length: int
    row: int
    blocks: tuple[int, ...]
    final: bool = False              # the end of a finished request (else a periodic snapshot)


class SnapshotPool:
    """Snapshot rows of the KDA state: per KDA layer `state [R, H, V, K] f32` and `conv [R, 3P, W-1] act`, the same
    per-row shapes and dtypes as the cache's slot pools (`like`: {layer: {"state", "conv"}}), on their device."""

    def __init__(self, like: dict, kda_layers: list[int], rows: int):
        self.rows, self.kda_layers = rows, list(kda_layers)
        self.pools = {l: {n: torch.zeros((rows,) + tuple(like[l][n].shape[1:]), dtype=like[l][n].dtype,
                                         device=like[l][n].device) for n in ("state", "conv")}
                      for l in self.kda_layers}

    @property
    def bytes_per_row(self) -> int:
        return sum(t[0].numel() * t.element_size() for p in self.pools.values() for t in p.values()) if self.rows else 0

    def save(self, slots: dict, slot: int, row: int) -> None:
        """Copy KDA slot `slot` of the cache pools `slots` into row `row` (in place, on the pools' stream)."""
        copy_tensors([self.pools[l][n][row] for l in self.kda_layers for n in ("state", "conv")],
              [slots[l][n][slot] for l in self.kda_layers for n in ("state", "conv")])

    def load(self, slots: dict, row: int, slot: int) -> None:
        """Copy row `row` into KDA slot `slot` of the cache pools (in place: CUDA graphs keep their addresses)."""
        copy_tensors([slots[l][n][slot] for l in self.kda_layers for n in ("state", "conv")],
              [self.pools[l][n][row] for l in self.kda_layers for n in ("state", "conv")])


def copy_tensors(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """dst[i] <- src[i] in place; one multi-tensor launch on CUDA (a snapshot touches 2 tensors per KDA layer)."""
    if dst and dst[0].is_cuda:
        torch._foreach_copy_(dst, src)
    else:
        for d, s in zip(dst, src):
            d.copy_(s)


class PrefixIndex:
    """Published snapshots by key, least recently used first, and which tail lengths exist under each base digest
    (a lookup walks the request's block digests deepest first and tries only those tails).

    Holds no tensors and no reference counts: `runtime.cache.HybridCache` owns the blocks and the pool rows and
    calls `add` / `remove`; `lru()` is the eviction candidate."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.entries: "collections.OrderedDict[bytes, Snapshot]" = collections.OrderedDict()
        self._tails: dict[bytes, collections.Counter] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self.entries

    def touch(self, key: bytes) -> None:
        self.entries.move_to_end(key)

    def add(self, snap: Snapshot) -> None:
        self.entries[snap.key] = snap
        self._tails.setdefault(snap.base, collections.Counter())[snap.length % self.block_size] += 1

    def remove(self, key: bytes) -> Snapshot:
        snap = self.entries.pop(key)
        tails = self._tails[snap.base]
        tails[snap.length % self.block_size] -= 1
        if not tails[snap.length % self.block_size]:
            del tails[snap.length % self.block_size]
        if not tails:
            del self._tails[snap.base]
        return snap

    def lru(self) -> Snapshot | None:
        return next(iter(self.entries.values()), None)

    def match(self, chain: PrefixChain, tokens: TokenSlice, limit: int) -> Snapshot | None:
        """The deepest entry whose tokens are a prefix of the request's, with length <= limit and not inside a
        content span; it becomes the most recently used. None when there is none."""
        B = self.block_size
        for k in range(limit // B, -1, -1):
            tails = self._tails.get(chain.base(k, tokens))
            if not tails:
                continue
            for r in sorted(tails, reverse=True):
                length = k * B + r
                if length == 0 or length > limit or inside_span(length, chain.keys):
                    continue
                snap = self.entries.get(chain.key(length, tokens)[0])
                if snap is not None:
                    self.touch(snap.key)
                    return snap
        return None
