"""`python -m k3deploy.runtime.generate --prompt TEXT` with a TikToken-format tokenizer shipped next to the checkpoint."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from k3deploy.runtime.tokenizer import Tokenizer, train_bpe, write_ranks

ROOT = Path(__file__).resolve().parents[2]
TEXT = "the quick brown fox jumps over the lazy dog. " * 20


def run(*args):
    r = subprocess.run([sys.executable, "-m", "k3deploy.runtime.generate", *map(str, args)], capture_output=True, text=True,
                       cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


def test_prompt_text_equals_its_token_ids(tiny_ckpt, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(tiny_ckpt, ck)
    write_ranks(ck / "tiktoken.model", train_bpe(TEXT, 300))          # 300 < vocab 1024: every id is valid
    ids = Tokenizer.from_file(ck / "tiktoken.model").encode("the lazy fox")
    assert len(ids) < len("the lazy fox")                               # merges happened: real BPE, not bytes
    by_text = run("--model", ck, "--prompt", "the lazy fox", "--max-tokens", 5, "--ignore-eos")
    by_ids = run("--model", ck, "--prompt-ids", ",".join(map(str, ids)), "--max-tokens", 5, "--ignore-eos")
    assert by_text == by_ids and len(by_text[0].split()) == 5


def test_prompt_without_tokenizer_is_a_clear_error(tiny_ckpt):
    r = subprocess.run([sys.executable, "-m", "k3deploy.runtime.generate", "--model", str(tiny_ckpt), "--prompt", "hi"],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 2 and "tiktoken.model" in r.stderr
