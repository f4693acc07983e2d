"""A byte-level BPE tokenizer trained locally with the `tokenizers` library, ChatML template.

Digits are split one per token (as Qwen does), so arithmetic tasks see every digit.
"""

from __future__ import annotations

import functools

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from furlong.models.corpus import synthetic_corpus

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD, IM_START, IM_END)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@functools.lru_cache(maxsize=4)
def _trained_json(vocab_size: int, seed: int) -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(synthetic_corpus(seed=seed), trainer)
    return tok.to_str()


def train_tokenizer(vocab_size: int = 2048, seed: int = 0) -> PreTrainedTokenizerFast:
    """The offline tokenizer (about 1 s to train; cached per process)."""
    tok = Tokenizer.from_str(_trained_json(vocab_size, seed))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD,
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
    )
