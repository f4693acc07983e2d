"""The offline BPE tokenizer: deterministic, lossless, digit-split, ChatML template."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from furlong.models.tokenizer import (
    CHAT_TEMPLATE,
    IM_END,
    IM_START,
    PAD,
    _trained_json,
    train_tokenizer,
)

TEXTS = [
    "The answer is 42.",
    "café 東京 привет 🙂",
    "0123456789 and 12345 + 678 = 7023",
    "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n7<|im_end|>\n",
    "def add(x, y):\n    return x + y  # tabs\tand  spaces  ",
    "",
]
MESSAGES = [
    {"role": "user", "content": "What is 3 + 4?"},
    {"role": "assistant", "content": "7"},
]
CHATML = "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n7<|im_end|>\n"


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


@pytest.fixture(scope="module")
def reloaded(tokenizer, tmp_path_factory):
    out: Path = tmp_path_factory.mktemp("tok")
    tokenizer.save_pretrained(out)
    return AutoTokenizer.from_pretrained(out)


def test_training_is_deterministic() -> None:
    first = _trained_json(2048, 0)
    _trained_json.cache_clear()
    second = _trained_json(2048, 0)
    assert first is not second  # really trained twice
    assert first == second


def test_vocab_size_and_cache(tokenizer) -> None:
    assert 256 < len(tokenizer) <= 2048
    assert train_tokenizer().get_vocab() == tokenizer.get_vocab()


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_after_reload(tokenizer, reloaded, text: str) -> None:
    ids = tokenizer(text)["input_ids"]
    assert reloaded(text)["input_ids"] == ids
    assert tokenizer.decode(ids) == text
    assert reloaded.decode(ids) == text


def test_reloaded_vocab_and_specials(tokenizer, reloaded) -> None:
    assert reloaded.get_vocab() == tokenizer.get_vocab()
    assert len(reloaded) == len(tokenizer)
    assert reloaded.eos_token == IM_END
    assert reloaded.pad_token == PAD
    assert reloaded.eos_token_id == tokenizer.eos_token_id
    assert reloaded.pad_token_id == tokenizer.pad_token_id


def test_no_bos_added(tokenizer) -> None:
    assert tokenizer("hi")["input_ids"] == tokenizer.encode("hi", add_special_tokens=False)


@pytest.mark.parametrize("text", ["12345", " 12345", "x=12345"])
def test_digits_split_one_per_token(tokenizer, text: str) -> None:
    pieces = tokenizer.convert_ids_to_tokens(tokenizer(text)["input_ids"])
    digits = [p for p in pieces if any(c.isdigit() for c in p)]
    assert digits == list("12345")


@pytest.mark.parametrize("special", [PAD, IM_START, IM_END])
def test_special_tokens_are_single(tokenizer, special: str) -> None:
    ids = tokenizer(special)["input_ids"]
    assert len(ids) == 1
    assert tokenizer.convert_ids_to_tokens(ids) == [special]
    # Also inside running text.
    ids = tokenizer(f"a{special}b")["input_ids"]
    assert tokenizer.convert_tokens_to_ids(special) in ids
    assert len(ids) == 3


def test_eos_and_pad(tokenizer) -> None:
    assert tokenizer.eos_token == IM_END
    assert tokenizer.pad_token == PAD
    assert tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids(IM_END)
    assert tokenizer.pad_token_id == tokenizer.convert_tokens_to_ids(PAD)
    assert tokenizer.eos_token_id != tokenizer.pad_token_id


def test_chat_template_chatml(tokenizer) -> None:
    assert tokenizer.chat_template == CHAT_TEMPLATE
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False)
    assert text == CHATML
    prompt = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert prompt == CHATML + "<|im_start|>assistant\n"


def test_chat_template_persisted(tokenizer, reloaded) -> None:
    assert reloaded.chat_template == tokenizer.chat_template
    for gen in (False, True):
        assert reloaded.apply_chat_template(
            MESSAGES, tokenize=False, add_generation_prompt=gen
        ) == tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen)
    ids = reloaded(CHATML)["input_ids"]
    assert ids[0] == reloaded.convert_tokens_to_ids(IM_START)
    assert ids[-2] == reloaded.eos_token_id
