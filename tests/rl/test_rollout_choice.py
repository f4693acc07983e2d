"""`rollout.engine` from config: an SGLang fleet (two `furlong rollout-server` apps on
127.0.0.1) samples exactly what the embedded engine samples, spreads requests over its
servers and publishes weights to all of them; every registered kind implements the
protocols of the front doors it serves; bad kinds and URLs are InputErrors naming the field."""

from __future__ import annotations

import inspect
import socket
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import pytest
import torch
from fastapi import FastAPI

from furlong.errors import InputError
from furlong.models import build_preset
from furlong.rl.rollout_choice import build_rollout
from furlong.rollout.base import RolloutEngine, SamplingEngine, SessionEngine, protocol_members
from furlong.rollout.engine import EmbeddedEngine
from furlong.rollout.registry import engine_class
from furlong.rollout.sampling import SamplingParams
from furlong.rollout.server import create_app
from furlong.serving import background_server

pytestmark = pytest.mark.usefixtures("one_thread")


class Counted:
    """An engine behind a rollout server, counting the requests it was sent."""

    def __init__(self, preset: str, seed: int):
        self.engine = EmbeddedEngine(*build_preset(preset, seed=seed), max_running=8)
        self.requests = 0
        submit_many = self.engine.submit_many

        def counting(prompts, *args, **kwargs):
            self.requests += len(prompts)
            return submit_many(prompts, *args, **kwargs)

        self.engine.submit_many = counting  # type: ignore[method-assign]


@contextmanager
def servers(preset: str, n: int, seed: int = 1) -> Iterator[tuple[list[Counted], list[str]]]:
    """``n`` rollout servers whose weights (``seed``) differ from the policy's (seed 0)."""
    backends = [Counted(preset, seed) for _ in range(n)]
    with ExitStack() as stack:
        urls = [stack.enter_context(background_server(create_app(b.engine))) for b in backends]
        yield backends, urls


def requests(tokenizer, n: int) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = [tokenizer(f"What is {i} + {2 * i}?")["input_ids"] for i in range(n)]
    params = [
        SamplingParams(max_tokens=6, seed=i, top_p=0.9, return_sampling_mask=True) for i in range(n)
    ]
    return prompts, params


def assert_same(ours, theirs) -> None:
    for a, b in zip(ours, theirs, strict=True):
        assert a.output_ids == b.output_ids and a.finish_reason == b.finish_reason
        assert a.sampling_mask == b.sampling_mask and a.weight_version == b.weight_version
        # other requests share each server's batch: fp32 noise only
        torch.testing.assert_close(
            torch.tensor(a.output_logprobs), torch.tensor(b.output_logprobs), atol=1e-5, rtol=0
        )


def test_a_fleet_samples_like_the_embedded_engine_and_takes_weights_everywhere() -> None:
    policy, tokenizer = build_preset("tiny-qwen3", seed=0)
    reference = build_rollout("embedded", [], policy, tokenizer, batch=8)
    prompts, params = requests(tokenizer, 8)
    with servers("tiny-qwen3", 2) as (backends, urls):
        fleet = build_rollout("sglang", urls, policy, tokenizer, batch=8)
        try:
            # the servers started from other weights: build_rollout sent them the policy's
            assert [b.engine.weight_version for b in backends] == [0, 0]
            assert_same(fleet.generate(prompts, params), reference.generate(prompts, params))
            counts = [b.requests for b in backends]
            assert sum(counts) == 8 and min(counts) >= 3, counts  # spread, not all on one

            g = torch.Generator().manual_seed(3)
            new = {
                n: p.detach() + 0.05 * torch.randn(p.shape, generator=g)
                for n, p in policy.named_parameters()
            }
            assert fleet.update_weights(new, version=3) == 3
            assert [b.engine.weight_version for b in backends] == [3, 3]
            reference.update_weights(new, version=3)
            results = fleet.generate(prompts, params)
            assert {r.weight_version for r in results} == {3}
            assert_same(results, reference.generate(prompts, params))

            fleet.pause("in_place")
            assert all(b.engine.paused for b in backends)
            fleet.resume()
            assert not any(b.engine.paused for b in backends)
            assert fleet.weight_version == 3
        finally:
            fleet.close()


# what each built-in kind serves: the loop, and (in process or over HTTP) the session server
# and the Tinker service's sampling
SERVES = {
    "embedded": [RolloutEngine, SessionEngine, SamplingEngine],
    "sglang": [RolloutEngine, SessionEngine],
    "ray": [RolloutEngine],
    "vllm": [RolloutEngine, SessionEngine, SamplingEngine],
}


def assert_implements(cls: type, protocol: type) -> None:
    """Every protocol member is there (read statically: no property runs, no HTTP), and each
    method takes the protocol's parameters, in order, extra ones optional."""
    for name in protocol_members(protocol):
        declared = next(
            vars(c)[name] for c in protocol.__mro__ if name in vars(c)
        )  # the protocol's own declaration
        if isinstance(declared, property):  # a property or an annotated instance attribute
            continue  # (the registry's own check, above, found it)
        found = inspect.getattr_static(cls, name)  # AttributeError if missing
        wanted = list(inspect.signature(declared).parameters.values())[1:]
        have = list(inspect.signature(found).parameters.values())[1:]
        assert [p.name for p in have[: len(wanted)]] == [p.name for p in wanted], name
        assert all(
            p.default is not p.empty or p.kind == p.KEYWORD_ONLY for p in have[len(wanted) :]
        )


@pytest.mark.parametrize("kind", sorted(SERVES))
def test_every_kind_implements_the_protocols_it_serves(kind: str) -> None:
    for protocol in SERVES[kind]:
        cls = engine_class(kind, protocol)  # the registry's own check passes
        assert_implements(cls, protocol)


def test_the_registry_refuses_a_kind_that_cannot_serve_a_front_door() -> None:
    with pytest.raises(InputError, match=r"--engine: 'ray' cannot serve here: RayRollout lacks"):
        engine_class("ray", SessionEngine, "--engine")
    with pytest.raises(InputError, match=r"--engine: 'nope' is not one of \['embedded'"):
        engine_class("nope", SessionEngine, "--engine")


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sglang_lookalike() -> FastAPI:
    """What a real SGLang server's /get_model_info says: no furlong block."""
    app = FastAPI()

    @app.get("/get_model_info")
    async def info() -> dict:
        return {"model_path": "Qwen/Qwen3-0.6B", "is_generation": True}

    return app


def test_bad_kinds_and_urls_name_the_field() -> None:
    policy, tokenizer = build_preset("tiny-qwen3", seed=0)

    def build(kind, urls, **kw):
        return build_rollout(kind, urls, policy, tokenizer, batch=2, **kw)

    with pytest.raises(InputError, match=r"rollout\.engine: 'nope' is not one of"):
        build("nope", [])
    with pytest.raises(InputError, match=r'rollout\.engine: "ray" runs the engines as Ray actors'):
        build("ray", [])
    with pytest.raises(InputError, match=r"rollout\.urls: .*needs at least one server URL"):
        build("sglang", [])
    with pytest.raises(InputError, match=r"rollout\.urls: expected a list"):
        build("sglang", "http://127.0.0.1:30000")
    with pytest.raises(InputError, match=r"rollout\.urls: only used with"):
        build("embedded", ["http://127.0.0.1:30000"])
    with pytest.raises(InputError, match=r"rollout\.urls\[0\]: 'localhost:30000' is not"):
        build("sglang", ["localhost:30000"])
    with pytest.raises(InputError, match=r"rollout\.urls\[1\]: 'ftp://h' is not"):
        build("sglang", ["http://127.0.0.1:30000", "ftp://h"])
    with pytest.raises(InputError, match=r"rollout\.urls\[1\]: .*bad port"):
        build("sglang", ["http://127.0.0.1:30000", "http://127.0.0.1:99999"])
    with pytest.raises(InputError, match=r"rollout\.urls\[1\]: .* listed twice"):
        build("sglang", ["http://127.0.0.1:30000", "http://127.0.0.1:30000/"])
    port = closed_port()
    with pytest.raises(InputError, match=rf"rollout\.urls\[0\]: .*:{port} does not answer"):
        build("sglang", [f"http://127.0.0.1:{port}"])
    moe_shape = r"rollout\.urls\[0\]: .*routed experts of shape"
    with servers("tiny-qwen3-moe", 1) as (_, moe), pytest.raises(InputError, match=moe_shape):
        build("sglang", moe)
    on_disk = r"rollout\.staging_dir: .*loads published weights"
    with background_server(sglang_lookalike()) as url, pytest.raises(InputError, match=on_disk):
        build("sglang", [url])
