"""Who may call `furlong rollout-server`'s control routes, over real HTTP on 127.0.0.1: without
the admin token (or with a wrong one) every control route is 401 and changes nothing, with it
they work, generation and the read-only routes stay open; `--weights-dir` refusals all read
alike and leak nothing about the file; a weight bucket over its cap is 413; `SGLangClient`
publishes through a protected server with the token and says so clearly without it."""

from __future__ import annotations

import httpx
import pytest
import torch
from safetensors.torch import load_file, save, save_file

from furlong import cli
from furlong.models import build_preset
from furlong.rollout import server as rollout_server
from furlong.rollout.control import ControlPolicy, Unauthorized
from furlong.rollout.engine import EmbeddedEngine
from furlong.rollout.sampling import SamplingParams
from furlong.rollout.server import create_app
from furlong.rollout.sglang_client import SGLangClient
from furlong.serving import background_server

pytestmark = pytest.mark.usefixtures("one_thread")
TOKEN = "control-test-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CAP = 256 << 10  # tiny-qwen3's largest tensor is 192 KiB; the whole model is 770 KiB
PARAM = "model.layers.0.self_attn.q_proj.weight"


def shifted(engine: EmbeddedEngine, by: float) -> dict[str, torch.Tensor]:
    return {n: p.detach() + by for n, p in engine.model.named_parameters()}


@pytest.fixture(scope="module")
def served(one_thread, tmp_path_factory):
    engine = EmbeddedEngine(*build_preset("tiny-qwen3", seed=0), max_running=4)
    root = tmp_path_factory.mktemp("control")
    (root / "weights" / "step").mkdir(parents=True)
    save_file(shifted(engine, 0.5), str(root / "weights" / "step" / "model.safetensors"))
    policy = ControlPolicy(admin_token=TOKEN, weights_dir=root / "weights")
    app = create_app(engine, policy=policy, max_bucket_bytes=CAP)
    with background_server(app) as url, httpx.Client(base_url=url) as client:
        yield engine, client, root


def state(engine: EmbeddedEngine) -> tuple:
    """What a refused call must leave as it was."""
    weights = engine.model.get_parameter(PARAM).detach().clone()
    return weights, engine.weight_version, engine.paused, set(engine.offloaded)


def assert_same_state(engine: EmbeddedEngine, before: tuple) -> None:
    weights, *rest = state(engine)
    assert torch.equal(weights, before[0]) and rest == list(before[1:])


def control_calls(engine: EmbeddedEngine, root) -> list[tuple[str, str, dict]]:
    """Each control route with a body that would act if the caller had the token."""
    step = str(root / "weights" / "step")
    bucket = save({PARAM: engine.model.get_parameter(PARAM).detach() + 1})
    return [
        ("post", "/update_weights_from_disk", {"json": {"model_path": step}}),
        ("post", "/furlong/update_weights_bucket", {"content": bucket}),
        ("post", "/pause_generation", {"json": {"mode": "abort"}}),
        ("post", "/continue_generation", {"json": {}}),
        ("post", "/release_memory_occupation", {"json": {"tags": None}}),
        ("post", "/resume_memory_occupation", {"json": {"tags": None}}),
        ("post", "/flush_cache", {}),
        ("post", "/abort_request", {"json": {"abort_all": True}}),
    ]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong-token-0123456789"}])
def test_control_routes_refuse_a_missing_or_wrong_token(served, headers) -> None:
    engine, client, root = served
    calls = control_calls(engine, root)
    assert [path for _, path, _ in calls] == list(rollout_server.CONTROL_ROUTES)
    before = state(engine)
    for method, path, kwargs in calls:
        response = client.request(method, path, headers=headers, **kwargs)
        assert response.status_code == 401, (path, response.text)
        assert response.headers["www-authenticate"] == "Bearer"
        assert "admin token" in response.json()["error"]["message"]
    # the token is checked before the body is read: an oversized bucket is 401, not 413
    big = client.post("/furlong/update_weights_bucket", content=b"x" * (2 * CAP), headers=headers)
    assert big.status_code == 401
    assert_same_state(engine, before)


def test_control_routes_work_with_the_token(served) -> None:
    engine, client, _ = served
    assert client.post("/pause_generation", json={}, headers=AUTH).status_code == 200
    assert engine.paused
    assert client.post("/continue_generation", json={}, headers=AUTH).status_code == 200
    assert not engine.paused
    release = client.post("/release_memory_occupation", json={"tags": ["kv_cache"]}, headers=AUTH)
    assert release.status_code == 200 and engine.offloaded == {"kv_cache"}
    onload = client.post("/resume_memory_occupation", json={"tags": ["kv_cache"]}, headers=AUTH)
    assert onload.status_code == 200 and not engine.offloaded
    assert client.post("/flush_cache", headers=AUTH).text == "Cache flushed."
    assert client.post("/abort_request", json={"abort_all": True}, headers=AUTH).status_code == 200


def test_open_routes_need_no_token(served) -> None:
    engine, client, _ = served
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
    assert 1 <= len(client.post("/generate", json=body).json()["output_ids"]) <= 2
    for path in ("/health", "/health_generate", "/get_weight_version", "/get_server_info"):
        assert client.get(path).status_code == 200, path
    assert client.get("/get_model_info").json()["furlong"]["vocab_size"] == engine.vocab_size


def test_refused_paths_all_read_alike_and_leak_nothing(served, tmp_path) -> None:
    engine, client, root = served
    weights = root / "weights"
    outside = tmp_path / "secret.safetensors"  # loadable: only the policy refuses it
    save_file(shifted(engine, 1.0), str(outside))
    (weights / "notes.txt").write_bytes(b"n" * 12345)
    link = weights / "link.safetensors"
    link.unlink(missing_ok=True)
    link.symlink_to(outside)
    paths = [
        str(outside),  # absolute, outside
        str(weights / ".." / ".." / tmp_path.name / outside.name),  # `..` out of it
        str(link),  # a link inside pointing out
        str(weights / "missing.safetensors"),
        str(weights / "notes.txt"),  # not safetensors
        str(weights),  # a directory holding only the link (which points out)
    ]
    before = state(engine)
    messages = set()
    for path in paths:
        response = client.post("/update_weights_from_disk", json={"model_path": path}, headers=AUTH)
        assert response.status_code == 400 and response.json()["success"] is False, path
        message = response.json()["message"].replace(repr(path), "PATH")
        assert not any(leak in message for leak in ("12345", "rrno", "No such", "outside"))
        messages.add(message)
    assert messages == {
        "model_path: no loadable safetensors weights at PATH inside the server's weights directory"
    }
    assert_same_state(engine, before)
    link.unlink()  # leave the weights directory loadable for the other tests


def test_a_file_inside_the_weights_dir_applies(served) -> None:
    engine, client, root = served
    expected = engine.model.get_parameter(PARAM).detach() + 0.5
    body = {"model_path": str(root / "weights" / "step"), "weight_version": "7"}
    response = client.post("/update_weights_from_disk", json=body, headers=AUTH)
    assert response.status_code == 200 and response.json()["success"] is True
    assert engine.weight_version == 7
    assert torch.equal(engine.model.get_parameter(PARAM).detach(), expected)


def test_a_bucket_over_the_cap_is_413_and_changes_nothing(served) -> None:
    engine, client, _ = served
    before = state(engine)
    blob = save(shifted(engine, 2.0))  # the whole model: 770 KiB, over the 256 KiB cap
    declared = client.post("/furlong/update_weights_bucket", content=blob, headers=AUTH)
    streamed = client.post(  # no declared length: refused as it arrives
        "/furlong/update_weights_bucket", content=iter([blob[:CAP], blob[CAP:]]), headers=AUTH
    )
    for response in (declared, streamed):
        assert response.status_code == 413
        message = response.json()["error"]["message"]
        assert message.startswith("body:") and str(CAP) in message
    assert_same_state(engine, before)


def test_the_client_publishes_with_the_token_and_says_why_without(served) -> None:
    engine, client, root = served
    url = str(client.base_url)
    with SGLangClient(url, admin_token=TOKEN, bucket_bytes=CAP // 2) as trainer:
        new = shifted(engine, 0.25)
        assert trainer.update_weights(new, version=20) == 20  # several buckets
        assert torch.equal(engine.model.get_parameter(PARAM).detach(), new[PARAM])
        step = root / "weights" / "step"
        assert trainer.update_weights(step) == 21  # a path inside the weights directory
        on_disk = load_file(str(step / "model.safetensors"))[PARAM]
        assert torch.equal(engine.model.get_parameter(PARAM).detach(), on_disk)
        trainer.pause("abort")
        trainer.resume()
    before = state(engine)
    with SGLangClient(url, bucket_bytes=CAP // 2) as anonymous:
        with pytest.raises(Unauthorized, match="update_weights: .*admin token is missing or wrong"):
            anonymous.update_weights(shifted(engine, 3.0))
        with pytest.raises(Unauthorized, match="pause: .*admin token"):
            anonymous.pause("abort")
        (result,) = anonymous.generate([[1, 2, 3]], SamplingParams(max_tokens=2, seed=0))
        assert 1 <= len(result.output_ids) <= 2  # generation stays open
    assert_same_state(engine, before)


def test_the_cli_always_runs_with_a_token(monkeypatch, tmp_path, capsys) -> None:
    seen: list = []
    monkeypatch.setattr(rollout_server, "serve", lambda *args, **kw: seen.append(args))
    monkeypatch.delenv("FURLONG_ADMIN_TOKEN", raising=False)

    def run(*flags: str) -> int:  # the CLI opens the port before serve(): a free one
        return cli.main(["rollout-server", "--port", "0", *flags])

    assert run() == 0  # a generated token, shown once
    policy, bucket = seen[-1][-2:]
    assert bucket == rollout_server.MAX_BUCKET_BYTES == 4 << 30 and policy.weights_dir is None
    line = f"furlong rollout-server: admin token for control routes: {policy.admin_token}"
    assert capsys.readouterr().err.strip() == line
    monkeypatch.setenv("FURLONG_ADMIN_TOKEN", "from-the-environment-0123")
    assert run("--weights-dir", str(tmp_path), "--max-bucket-bytes", "1000") == 0
    policy, bucket = seen[-1][-2:]
    assert policy.admin_token == "from-the-environment-0123" and bucket == 1000
    assert policy.weights_dir == tmp_path.resolve() and capsys.readouterr().err == ""
    (tmp_path / "token").write_text(TOKEN + "\n")
    assert run("--admin-token-file", str(tmp_path / "token")) == 0
    assert seen[-1][-2].admin_token == TOKEN
    assert run("--admin-token-file", str(tmp_path / "none")) == 2
    assert "--admin-token-file: cannot read" in capsys.readouterr().err
