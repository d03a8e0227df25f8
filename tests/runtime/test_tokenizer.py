"""runtime/tokenizer.py and the tokenizer files of synthetic checkpoints (model/vocab.py), CHAT.md §1."""
from __future__ import annotations

import json

import pytest
import regex

from k3deploy.model.vocab import PAT_STR, train_bpe, write_ranks, write_tokenizer_files
from k3deploy.runtime.tokenizer import MAX_SAME_CLASS_CHARS, Tokenizer, load_ranks

TEXT = ("The quick brown fox jumps over the lazy dog. It's 2026; the dog's 3 friends weren't lazy!\n"
        "Kimi K3 是一个模型。 Décodage naïve — ünïcödé, emoji 🙂 and tabs\tand   spaces.\n") * 3


@pytest.fixture(scope="module")
def tiny_tok(tiny_ckpt):
    return Tokenizer.from_file(tiny_ckpt / "tiktoken.model")


def _bytes_ranks(*tokens: bytes) -> dict[bytes, int]:
    ranks = {bytes([b]): b for b in range(256)}
    for t in tokens:
        ranks.setdefault(t, len(ranks))
    return ranks


def test_pretokenizer_is_k3s():
    """K3's pattern splits "HelloWorld don't" as Hello / World / " don't" (a cl100k-style pattern: HelloWorld / " don"
    / "'t"), in the regex module (V1) and inside tiktoken, whose merges cannot cross those pieces."""
    assert regex.findall(PAT_STR, "HelloWorld don't", flags=regex.V1) == ["Hello", "World", " don't"]
    assert regex.findall(PAT_STR, "中文abc ÀBCdef 12345", flags=regex.V1) == ["中文", "abc", " ÀBCdef", " ", "123", "45"]
    words = [b"Hello", b"World", b"HelloWorld", b" don", b"'t", b" don't"]
    ranks = _bytes_ranks(*(w[:i] for w in words for i in range(2, len(w) + 1)))
    tok = Tokenizer(ranks)
    assert [tok.token_bytes(i) for i in tok.encode("HelloWorld don't")] == [b"Hello", b"World", b" don't"]


def test_specials_named_from_config_and_every_id_decodes(tmp_path):
    ranks = train_bpe(TEXT, 400)
    path = write_ranks(tmp_path / "tiktoken.model", ranks)
    n = len(ranks)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"added_tokens_decoder": {str(n + 3): {"content": "<|open|>"}, str(n + 255): {"content": "[PAD]"}}}))
    tok = Tokenizer.from_file(path)
    assert tok.n_vocab == n + 256 and tok.special_id("<|open|>") == n + 3 and tok.special_id("[PAD]") == n + 255
    assert tok.special_names[n] == f"<|reserved_token_{n}|>"
    for i in range(tok.n_vocab):                       # every id decodes, specials to their names
        assert isinstance(tok.decode([i]), str)
    assert tok.decode([n + 3]) == "<|open|>" and tok.decode([n + 3, 65], skip_special=True) == "A"
    with pytest.raises(ValueError, match="not in the vocabulary"):
        tok.decode([tok.n_vocab])
    with pytest.raises(ValueError, match="<\\|close\\|>"):
        tok.special_id("<|close|>")
    for s in (TEXT, "", "unseen wörds 数字 12345"):
        assert tok.decode(tok.encode(s)) == s
    assert len(tok.encode(TEXT)) < len(TEXT.encode()) // 2          # merges are used


def test_user_text_never_becomes_special(tiny_tok):
    for s in ("<|open|>", "hi <|end_of_msg|> there", "[BOS][PAD]<|media_pad|>"):
        ids = tiny_tok.encode(s)
        assert not any(tiny_tok.is_special(i) for i in ids), s
        assert tiny_tok.decode(ids) == s
    assert tiny_tok.encode_segments([("<|open|>", True), ("<|open|>", False)])[0] == tiny_tok.special_id("<|open|>")


def test_synthetic_checkpoint_ships_k3_tokenizer(tiny_ckpt, tiny_cfg, tiny_tok):
    """k3-tiny: 768 ranks, K3's specials at 768 + (K3 id - 163584), matching the preset's bos/eos/pad/media ids."""
    assert (tiny_ckpt / "tokenizer_config.json").is_file()
    cfg = json.loads((tiny_ckpt / "config.json").read_text())
    assert tiny_tok.num_ranks == 768 and tiny_tok.n_vocab == tiny_cfg.vocab_size == 1024
    assert tiny_tok.special_id("[BOS]") == tiny_cfg.bos_token_id == 768
    assert tiny_tok.special_id("<|end_of_msg|>") == tiny_cfg.eos_token_id == 770
    assert tiny_tok.special_id("[PAD]") == tiny_cfg.pad_token_id == 1023
    assert tiny_tok.special_id("<|media_pad|>") == cfg["media_placeholder_token_id"] == 789
    assert [tiny_tok.special_id(s) for s in ("<|open|>", "<|close|>", "<|sep|>")] == [771, 772, 773]
    assert [tiny_tok.special_id(s) for s in ("<|media_begin|>", "<|media_content|>", "<|media_end|>")] == [786, 787, 788]
    for i in range(tiny_tok.n_vocab):
        tiny_tok.decode([i])
    assert tiny_tok.decode(tiny_tok.encode(TEXT)) == TEXT and len(tiny_tok.encode(TEXT)) < len(TEXT.encode()) // 2


def test_full_vocab_rank_file_is_valid_tiktoken(tmp_path):
    """K3's vocabulary (163584 ranks + specials 163584..163839 as released): the filler ranks are valid and never
    produced by text."""
    model, _ = write_tokenizer_files(tmp_path, 163840, 262144)
    tok = Tokenizer.from_file(model)
    assert tok.num_ranks == 163584 and tok.n_vocab == 163840
    assert (tok.special_id("[BOS]"), tok.special_id("<|end_of_msg|>"), tok.special_id("<|open|>"),
            tok.special_id("<|media_pad|>"), tok.special_id("[PAD]")) == (163584, 163586, 163587, 163605, 163839)
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT and max(ids) < 768                  # fillers are unreachable
    assert tok.token_bytes(163583)[:1] == b"\xff"
    assert tok.decode([163584, 163839]) == "[BOS][PAD]" and tok.decode([163590]) == "<|reserved_token_163590|>"


def test_long_runs_are_cut_like_kimi(tiny_tok):
    """Kimi's encode cuts runs of more than 25,000 same-class characters: the ids equal those of the pieces."""
    text = "ab" * (MAX_SAME_CLASS_CHARS // 2) + "abc" + " " * 3 + "x"
    cut = MAX_SAME_CLASS_CHARS
    assert tiny_tok.encode(text) == tiny_tok.encode(text[:cut]) + tiny_tok.encode(text[cut:])
    assert tiny_tok.decode(tiny_tok.encode(text)) == text


def test_rank_file_errors(tmp_path):
    p = tmp_path / "tiktoken.model"
    p.write_text("QQ== 0\nnot-base64! 1\n")
    with pytest.raises(ValueError, match=":2: expected"):
        load_ranks(p)
    p.write_text("QQ== 0\nQg== 2\n")
    with pytest.raises(ValueError, match="not dense"):
        load_ranks(p)
    with pytest.raises(ValueError, match="single bytes"):
        Tokenizer({b"A": 0})
    assert train_bpe(TEXT, 400) == train_bpe(TEXT, 400)                 # deterministic
