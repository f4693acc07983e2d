"""``SamplingParams.prompt_target_ids``: the raw model log-probs of chosen ids at each prompt
position, read from the prefill's own logits, equal a float64 HF forward of the same model; a
sparse CSR request gets a sparse answer on the same cells; bad ids are refused by name."""

from __future__ import annotations

import copy

import pytest
import torch

from furlong.errors import InputError
from furlong.models import build_preset
from furlong.rollout.engine import EmbeddedEngine
from furlong.rollout.sampling import SamplingParams, csr_tensor

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup():
    model, tokenizer = build_preset("tiny-qwen3", seed=0)
    prompts = [tokenizer(f"Name {i} colours, then {i + 2} fruits.")["input_ids"] for i in (3, 5)]
    reference = copy.deepcopy(model).double().eval()
    return model, tokenizer, prompts, reference


def float64_logp(reference: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    """``[len(prompt) - 1, V]``: row i is the log-softmax predicting prompt position i + 1."""
    with torch.no_grad():
        logits = reference(torch.tensor([prompt])).logits[0, :-1]
    return torch.log_softmax(logits.double(), dim=-1)


def target_ids(prompt: list[int], vocab: int, seed: int, k: int = 3) -> torch.Tensor:
    """Random ids (the true next token in column 0), -1 in a third of the cells."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (len(prompt) - 1, k), generator=g)
    ids[:, 0] = torch.tensor(prompt[1:])
    ids[torch.rand(ids.shape, generator=g) < 1 / 3] = -1
    ids[0, 1] = 7  # at least one id besides column 0 on the first row
    return ids


def expected(logp: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    want = logp.gather(-1, ids.clamp(min=0))
    return torch.where(ids < 0, torch.nan, want)


def test_dense_targets_equal_a_float64_forward_in_a_mixed_batch(setup) -> None:
    model, tokenizer, prompts, reference = setup
    engine = EmbeddedEngine(model, tokenizer, max_running=4)
    vocab = engine.vocab_size
    ids = [target_ids(p, vocab, seed=i) for i, p in enumerate(prompts)]
    assert (ids[0] == -1).any() and (ids[0] >= 0).any()
    params = [  # one with prompt log-probs too, one with targets alone, one with neither
        SamplingParams(max_tokens=3, seed=1, prompt_logprobs=True, prompt_target_ids=ids[0]),
        SamplingParams(max_tokens=3, seed=2, prompt_target_ids=ids[1]),
        SamplingParams(max_tokens=3, seed=3),
    ]
    results = engine.generate([prompts[0], prompts[1], prompts[0]], params)
    for r, prompt, want_ids in zip(results[:2], prompts, ids, strict=True):
        got = r.prompt_target_logprobs
        assert got.dtype == torch.float32 and got.layout == torch.strided
        assert got.shape == want_ids.shape == (len(prompt) - 1, 3)
        want = expected(float64_logp(reference, prompt), want_ids)
        torch.testing.assert_close(got.double(), want, atol=5e-6, rtol=0, equal_nan=True)
        assert torch.isnan(got[want_ids < 0]).all()
    # column 0 names the true next token: the same number prompt_logprobs reports
    lp = torch.tensor(results[0].prompt_logprobs[1:])
    picked = results[0].prompt_target_logprobs[:, 0]
    named = ids[0][:, 0] >= 0
    torch.testing.assert_close(picked[named], lp[named], atol=0, rtol=0)
    assert results[1].prompt_logprobs is None  # targets alone do not add prompt log-probs
    assert results[2].prompt_target_logprobs is None


def test_sparse_targets_come_back_sparse_on_the_same_cells(setup) -> None:
    model, tokenizer, prompts, reference = setup
    engine = EmbeddedEngine(model, tokenizer)
    prompt = prompts[1]
    rows = len(prompt) - 1
    dense = torch.full((rows, 4), -1, dtype=torch.int64)
    dense[1, 2], dense[4, 0], dense[4, 3], dense[rows - 1, 1] = 11, prompt[5], 300, 5
    cells = (dense >= 0).nonzero()  # row-major, as CSR lists them
    crow = torch.cat(
        [torch.zeros(1, dtype=torch.int64), torch.bincount(cells[:, 0], minlength=rows).cumsum(0)]
    )
    col, values = cells[:, 1], dense[cells[:, 0], cells[:, 1]]
    sparse = csr_tensor(crow, col, values, (rows, 4))
    (r,) = engine.generate([prompt], [SamplingParams(max_tokens=2, prompt_target_ids=sparse)])
    got = r.prompt_target_logprobs
    assert got.layout == torch.sparse_csr and got.dtype == torch.float32
    assert got.shape == (rows, 4)
    assert torch.equal(got.crow_indices(), crow) and torch.equal(got.col_indices(), col)
    want = float64_logp(reference, prompt)[cells[:, 0], values]
    torch.testing.assert_close(got.values().double(), want, atol=5e-6, rtol=0)


def test_minus_one_cells_read_nan_and_only_the_first_sample_scores(setup) -> None:
    model, tokenizer, prompts, reference = setup
    engine = EmbeddedEngine(model, tokenizer)
    prompt = prompts[0]
    ids = torch.full((len(prompt) - 1, 1), -1, dtype=torch.int64)
    ids[2, 0] = 40
    first = SamplingParams(max_tokens=2, seed=4, prompt_target_ids=ids)
    rest = SamplingParams(max_tokens=2, seed=5)
    a, b = engine.generate([prompt, prompt], [first, rest])  # the Tinker num_samples shape
    want = float64_logp(reference, prompt)[2, 40]
    assert a.prompt_target_logprobs[2, 0].item() == pytest.approx(want.item(), abs=5e-6)
    assert torch.isnan(a.prompt_target_logprobs[torch.arange(len(ids)) != 2]).all()
    assert b.prompt_target_logprobs is None


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        ([[1, 2]], "expected an int64 tensor"),
        (torch.tensor([[1.0, 2.0]]), "expected an int64 tensor"),
        (torch.tensor([1, 2]), "expected a 2-D dense or sparse CSR"),
        (torch.zeros(3, 0, dtype=torch.int64), "K .* must be >= 1"),
        (torch.tensor([[3, -2]]), "ids must be >= 0, or -1 for none; got -2"),
    ],
)
def test_params_refuse_malformed_target_ids(ids, match: str) -> None:
    with pytest.raises(InputError, match=rf"sampling_params\.prompt_target_ids: {match}"):
        SamplingParams(prompt_target_ids=ids)


def test_the_engine_checks_rows_and_vocabulary_before_queueing(setup) -> None:
    model, tokenizer, prompts, _ = setup
    engine = EmbeddedEngine(model, tokenizer)
    prompt = prompts[0]
    short = torch.zeros(len(prompt) - 2, 2, dtype=torch.int64)
    with pytest.raises(InputError, match=r"params\[1\]\.prompt_target_ids: .* rows .* expected"):
        engine.check_requests(
            [prompt, prompt], [SamplingParams(), SamplingParams(prompt_target_ids=short)]
        )
    big = torch.zeros(len(prompt) - 1, 2, dtype=torch.int64)
    big[3, 1] = engine.vocab_size
    with pytest.raises(InputError, match=rf"token id {engine.vocab_size} outside"):
        engine.generate([prompt], [SamplingParams(prompt_target_ids=big)])
    assert not engine.busy
