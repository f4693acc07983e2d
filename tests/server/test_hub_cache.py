"""The hub-cache writer: a served name resolves offline to the served tokenizer."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from furlong.errors import InputError
from furlong.models.loading import load_tokenizer
from furlong.server.hub_cache import write_hub_cache


def test_hub_cache_resolves_offline_by_name(tmp_path):
    snap = write_hub_cache(tmp_path, "Qwen/Qwen3-8B-Base", "tiny-qwen3")
    assert write_hub_cache(tmp_path, "Qwen/Qwen3-8B-Base", "tiny-qwen3") == snap  # idempotent
    repo = tmp_path / "hub" / "models--Qwen--Qwen3-8B-Base"
    assert (repo / "refs" / "main").read_text() == snap.name
    assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= {
        p.name for p in snap.iterdir()
    }
    text = "User: What is 12 + 7?\n\nAssistant:"
    code = (
        "from transformers import AutoConfig, AutoTokenizer;"
        "t = AutoTokenizer.from_pretrained('Qwen/Qwen3-8B-Base');"
        f"print(t.encode({text!r}), AutoConfig.from_pretrained('Qwen/Qwen3-8B-Base').vocab_size)"
    )
    env = dict(os.environ, HF_HOME=str(tmp_path), HF_HUB_OFFLINE="1")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.split("] ")
    tokenizer = load_tokenizer("tiny-qwen3")
    assert out[0] + "]" == str(tokenizer.encode(text))
    assert int(out[1]) >= len(tokenizer)


@pytest.mark.parametrize("name", ["../x", "a/b/c", "a--b/c", "Org/", "a:b", ""])
def test_hub_cache_rejects_non_repo_ids(tmp_path, name):
    with pytest.raises(InputError):
        write_hub_cache(tmp_path, name, "tiny-qwen3")
