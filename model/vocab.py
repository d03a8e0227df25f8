"""Tokenizer files of a K3 checkpoint (CHAT.md §1): `tiktoken.model` and `tokenizer_config.json`.

K3's tokenizer is a byte-level BPE in tiktoken's rank-file format (one `base64(bytes) rank` line per token, ranks
dense 0..n-1) followed by exactly 256 reserved special ids n..n+255. `tokenizer_config.json` names them
(`added_tokens_decoder[str(id)].content`); an unnamed id is `<|reserved_token_{id}|>`.

Kimi's rank file is not public, so synthetic checkpoints ship a small one of the same format: `synthetic_ranks(n)`
trains a byte-level BPE on a fixed text (`train_bpe`, deterministic) and, for a vocabulary larger than that, fills
the remaining ranks with distinct 4-byte strings that start with 0xFF, a byte no UTF-8 text contains, so no text
ever encodes to them (they still decode). The special names are K3's, at K3's offsets after the ranks, so a small
vocabulary (k3-tiny: 768 ranks + 256 specials) has its bos/eos/pad/media ids at `n + (K3 id - 163584)`.
"""
from __future__ import annotations

import base64
import collections
import functools
import json
from pathlib import Path

import regex

NUM_SPECIAL = 256

# The pre-tokenizer of Kimi's tokenization_kimi.py (TikTokenTokenizer.pat_str), one alternative per line. The class
# intersections `&&[^\p{Han}]` need tiktoken (Rust regex) or the `regex` module's V1 mode.
PAT_STR = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])

# K3's named special tokens by offset after the ranks (K3: id = 163584 + offset), CHAT.md §1.
K3_SPECIAL_NAMES: dict[int, str] = {
    0: "[BOS]", 1: "[EOS]", 2: "<|end_of_msg|>", 3: "<|open|>", 4: "<|close|>", 5: "<|sep|>",
    18: "<|media_begin|>", 19: "<|media_content|>", 20: "<|media_end|>", 21: "<|media_pad|>",
    254: "[UNK]", 255: "[PAD]",
}

TRAIN_VOCAB = 768   # ranks a synthetic rank file learns from TRAIN_TEXT (the rest, if any, are unreachable fillers)

TRAIN_TEXT = """\
The quick brown fox jumps over the lazy dog. It's a model that reads, thinks and answers; they'll see what we've
done. Here are the available tools, described in JSONSchema. The user asked for the weather in Paris and Berlin.
You MUST call tools in the next message. Your response must be raw JSON data without markdown code blocks.
Kimi K3 is a large language model with linear attention, latent attention, experts and a vision tower.
def fibonacci(n):
    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)

for i in range(10):
    print(i, fibonacci(i))
{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties":
{"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}
message role system user assistant tool think response tools call argument json index key type string number
boolean null object array name content reasoning thinking_effort low high max tool_choice required none
response_format json_object json_schema image 1024x768 Hello World, hello world! HelloWorld don't won't can't
Numbers: 0 1 2 3 12 123 1234 2026 3.14159 -42 1e10 100% $9.99
Kimi K3 是一个多模态模型。它可以阅读文本和图像，并且会思考后再回答问题。今天天气很好，我们去公园散步吧。
Décodage naïve — ünïcödé, emoji 🙂 and tabs\tand   spaces. Ελληνικά, Русский текст, 日本語のテキスト, 한국어.
Questions and answers: What is machine learning? Machine learning is the study of algorithms that improve
through experience. Why is the sky blue? Because shorter wavelengths of sunlight scatter more in the air.
"""


def train_bpe(text: str, vocab_size: int, pat_str: str = PAT_STR) -> dict[bytes, int]:
    """Deterministic byte-level BPE training: ranks 0..255 are the single bytes, then the most frequent adjacent
    pair within a pre-tokenized piece is merged until `vocab_size` tokens or no pair is left (ties: the
    lexicographically smallest pair of byte strings). Returns {token bytes: rank}, ranks dense from 0.
    Raises ValueError when vocab_size < 256."""
    if vocab_size < 256:
        raise ValueError(f"vocab_size = {vocab_size}: must be >= 256 (one token per byte)")
    ranks = {bytes([b]): b for b in range(256)}
    pat = regex.compile(pat_str, flags=regex.V1)
    words = collections.Counter(tuple(bytes([b]) for b in m.encode()) for m in pat.findall(text))
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
        new: collections.Counter = collections.Counter()
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


def synthetic_ranks(num_ranks: int) -> dict[bytes, int]:
    """A rank file of exactly `num_ranks` tokens: a BPE trained on TRAIN_TEXT (up to TRAIN_VOCAB ranks), then
    distinct unreachable fillers b"\\xff" + 3 bytes (see the module docstring). Raises ValueError when
    num_ranks < 256 or > 256 + 2**24."""
    if not 256 <= num_ranks <= 256 + (1 << 24):
        raise ValueError(f"num_ranks = {num_ranks}: must be in [256, {256 + (1 << 24)}]")
    ranks = dict(_trained(min(num_ranks, TRAIN_VOCAB)))
    i = 0
    while len(ranks) < num_ranks:
        ranks[b"\xff" + i.to_bytes(3, "big")] = len(ranks)
        i += 1
    return ranks


@functools.lru_cache(maxsize=4)
def _trained(vocab_size: int) -> tuple[tuple[bytes, int], ...]:
    return tuple(train_bpe(TRAIN_TEXT, vocab_size).items())


def write_ranks(path: "str | Path", ranks: dict[bytes, int]) -> Path:
    """Write `ranks` as a tiktoken.model file (lines sorted by rank)."""
    path = Path(path)
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in sorted(ranks.items(), key=lambda x: x[1])))
    return path


def special_names(num_ranks: int, named: "dict[int, str] | None" = None) -> list[str]:
    """The 256 special-token names after `num_ranks` ranks: `named[id]` (absolute ids, as tokenizer_config.json
    gives them) where present, else `<|reserved_token_{id}|>` (CHAT.md §1)."""
    named = named or {}
    return [named.get(i, f"<|reserved_token_{i}|>") for i in range(num_ranks, num_ranks + NUM_SPECIAL)]


def tokenizer_config(num_ranks: int, model_max_length: int) -> dict:
    """tokenizer_config.json naming all 256 specials after `num_ranks` ranks with K3's names (module docstring)."""
    names = special_names(num_ranks, {num_ranks + off: n for off, n in K3_SPECIAL_NAMES.items()})
    return {
        "added_tokens_decoder": {str(num_ranks + off): {"content": n, "lstrip": False, "normalized": False,
                                                        "rstrip": False, "single_word": False, "special": True}
                                 for off, n in enumerate(names)},
        "bos_token": K3_SPECIAL_NAMES[0], "eos_token": K3_SPECIAL_NAMES[2], "pad_token": K3_SPECIAL_NAMES[255],
        "unk_token": K3_SPECIAL_NAMES[254], "model_max_length": model_max_length,
        "tokenizer_class": "TikTokenTokenizer",
    }


def write_tokenizer_files(out: "str | Path", vocab_size: int, model_max_length: int) -> tuple[Path, Path]:
    """Write `out/tiktoken.model` (vocab_size - 256 ranks, `synthetic_ranks`) and `out/tokenizer_config.json`.
    Returns both paths. Raises ValueError when vocab_size < 512."""
    if vocab_size < 256 + NUM_SPECIAL:
        raise ValueError(f"vocab_size = {vocab_size}: a K3 tokenizer needs >= 256 byte ranks + {NUM_SPECIAL} specials")
    out = Path(out)
    n = vocab_size - NUM_SPECIAL
    model = write_ranks(out / "tiktoken.model", synthetic_ranks(n))
    cfg = out / "tokenizer_config.json"
    cfg.write_text(json.dumps(tokenizer_config(n, model_max_length), indent=2, ensure_ascii=False) + "\n")
    return model, cfg
