"""`python -m k3deploy.runtime.generate --prompt TEXT` with the tokenizer files the checkpoint ships."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from k3deploy.runtime.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[2]


def run(*args):
    r = subprocess.run([sys.executable, "-m", "k3deploy.runtime.generate", *map(str, args)], capture_output=True, text=True,
                       cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


def test_prompt_text_equals_its_token_ids(tiny_ckpt):
    ids = Tokenizer.from_file(tiny_ckpt / "tiktoken.model").encode("the lazy fox")
    assert len(ids) < len("the lazy fox")                               # merges happened: real BPE, not bytes
    by_text = run("--model", tiny_ckpt, "--prompt", "the lazy fox", "--max-tokens", 5, "--ignore-eos", "--max-context", 64)
    by_ids = run("--model", tiny_ckpt, "--prompt-ids", ",".join(map(str, ids)), "--max-tokens", 5, "--ignore-eos", "--max-context", 64)
    assert by_text == by_ids and len(by_text[0].split()) == 5


def test_prompt_without_tokenizer_is_a_clear_error(tiny_ckpt, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(tiny_ckpt, ck)
    (ck / "tiktoken.model").unlink()
    r = subprocess.run([sys.executable, "-m", "k3deploy.runtime.generate", "--model", str(ck), "--prompt", "hi"],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 2 and "tiktoken.model" in r.stderr
