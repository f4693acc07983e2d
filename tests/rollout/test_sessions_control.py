"""The session server's control plane, through a real server on 127.0.0.1: a refused weight
publication stops no turn; a client that hangs up stops its turn (the engine aborts it, the
session notes it, nothing commits, the retry starts at once); with an admin token, an agent
holding one session's URL reaches only that session's chat, and a weights directory confines
what a publication may load, answering every refusal alike."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import save_file

from furlong.errors import InputError
from furlong.rollout.control import ADMIN_TOKEN_ENV, ControlPolicy, admin_token_from
from furlong.rollout.engine import EmbeddedEngine
from furlong.rollout.sessions import SessionServer, SessionServerConfig, create_app
from furlong.serving import background_server

from .session_helpers import chat, info, model, open_session, serve, turn

pytestmark = pytest.mark.usefixtures("one_thread")
USER = [{"role": "user", "content": "What is 2 + 3?"}]
TOKEN = "t0ken-for-the-trainer-only"


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def weights_of(engine: EmbeddedEngine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.model.named_parameters()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------- 1. check before pausing


@pytest.mark.parametrize("bad", ["unknown name", "wrong shape"])
def test_a_refused_publication_aborts_no_turn(bad: str, tmp_path: Path) -> None:
    with serve(pause_mode="abort") as (server, spy, client):
        engine = spy.engine
        name, param = next(iter(engine.model.named_parameters()))
        tensor = torch.ones(3, 3) if bad == "wrong shape" else param.detach().clone()
        save_file({name if bad == "wrong shape" else "not.a.weight": tensor}, tmp_path / "w.st")
        before = weights_of(engine)
        sid = open_session(client)
        engine.pause("in_place")  # hold the turn in the engine's queue
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(chat, client, sid, USER, seed=1)
            wait_for(lambda: engine.busy, "the turn never reached the engine")
            refused = client.post("/weights", json={"path": str(tmp_path / "w.st")})
            assert refused.status_code == 400
            assert "update_weights" in refused.json()["error"]["message"]
            assert engine.paused and engine.busy  # still held, not aborted
            engine.resume()
            response = pending.result(timeout=60)
        assert response.status_code == 200, response.text  # today: 503, aborted
        assert engine.weight_version == 0 and same(weights_of(engine), before)
        assert info(client, sid)["aborted"] == [] and len(server.get(sid).records) == 1


# ---------------------------------------------------------------- 2. a client that hangs up


def hang_up(client: httpx.Client, sid: str, **params) -> None:
    """A turn whose client gives up after 0.3 s and closes the connection."""
    body = {"messages": USER, "max_tokens": 8, **params}
    with pytest.raises(httpx.ReadTimeout):
        client.post(f"/sessions/{sid}/v1/chat/completions", json=body, timeout=0.3)


def test_a_client_that_hangs_up_aborts_its_queued_turn() -> None:
    with serve(pause_mode="abort") as (server, spy, client):
        engine = spy.engine
        sid = open_session(client)
        engine.pause("in_place")  # the turn can only wait: only the disconnect can end it
        hang_up(client, sid, seed=1)
        wait_for(lambda: info(client, sid)["aborted"], "the turn was never aborted")
        (aborted,) = info(client, sid)["aborted"]
        assert aborted["reason"] == "client_disconnected" and aborted["output_tokens"] == 0
        assert not engine.busy  # the engine dropped the request
        assert server.get(sid).records == [] and info(client, sid)["tokens"] == []
        engine.resume()
        turn(client, sid, USER, seed=1)  # the retry is served
        assert len(server.get(sid).records) == 1


def hold_after_first_token(engine: EmbeddedEngine) -> None:
    """Make the engine's first step wait until an abort is asked for: the turn is then
    mid-generation when its client hangs up, however fast the machine (a fast CPU writes the
    whole reply in under the client's 0.3 s)."""
    step = engine._step

    def held(joining):
        finished = step(joining)
        if engine.steps == 1:
            wait_for(lambda: engine._to_abort, "the hang-up never asked for an abort")
        return finished

    engine._step = held  # type: ignore[method-assign]


def test_a_client_that_hangs_up_mid_generation_frees_the_session_at_once() -> None:
    with serve(pause_mode="abort") as (server, spy, client):
        sid = open_session(client)
        hold_after_first_token(spy.engine)
        hang_up(client, sid, seed=1, max_tokens=1500)
        retry = turn(client, sid, USER, seed=2, max_tokens=4)
        (aborted,) = info(client, sid)["aborted"]
        assert aborted["reason"] == "client_disconnected"
        assert aborted["output_tokens"] == 1  # stopped part way, after its first token
        (record,) = server.get(sid).records  # only the retry committed
        assert len(record.output_ids) <= 4 and retry["role"] == "assistant"
        assert not spy.engine.busy


# ---------------------------------------------------------------- 3. who may call what


@contextmanager
def guarded(weights_dir: Path | None = None) -> Iterator[tuple[EmbeddedEngine, str]]:
    engine = EmbeddedEngine(*model("tiny-qwen3"))
    server = SessionServer(engine, SessionServerConfig(pause_mode="abort"))
    policy = ControlPolicy(admin_token=TOKEN, weights_dir=weights_dir)
    with background_server(create_app(server, policy=policy)) as url:
        yield engine, url


def test_an_agent_reaches_its_own_chat_and_nothing_else(tmp_path: Path) -> None:
    admin = {"authorization": f"Bearer {TOKEN}"}
    with guarded() as (engine, url), httpx.Client(base_url=url, timeout=60) as http:
        assert http.post("/sessions").status_code == 401
        mine = http.post("/sessions", headers=admin).json()
        theirs = http.post("/sessions", headers=admin).json()
        assert len(mine["id"]) == 32 and mine["id"] != theirs["id"]  # unguessable capabilities
        # the agent, with only its base URL and no token
        body = {"messages": USER, "max_tokens": 4, "seed": 0}
        agent = httpx.Client(base_url=url + mine["base_url"], timeout=60)
        assert agent.post("/chat/completions", json=body).status_code == 200
        assert agent.get("/models").status_code == 200
        save_file(weights_of(engine), tmp_path / "w.safetensors")
        before = weights_of(engine)
        for wrong in ({}, {"authorization": "Bearer not-the-token"}, {"authorization": TOKEN}):
            for method, path, json in [
                ("GET", f"/sessions/{mine['id']}", None),
                ("GET", f"/sessions/{theirs['id']}", None),
                ("POST", f"/sessions/{mine['id']}/samples", {"reward": 1.0}),
                ("DELETE", f"/sessions/{theirs['id']}", None),
                ("POST", "/weights", {"path": str(tmp_path / "w.safetensors")}),
                ("POST", "/sessions", None),
            ]:
                response = http.request(method, path, json=json, headers=wrong)
                assert response.status_code == 401, (method, path, response.text)
                assert response.headers["www-authenticate"] == "Bearer"
                assert "admin token" in response.json()["error"]["message"]
        agent.close()
        # nothing the refused calls named changed
        records = http.get(f"/sessions/{mine['id']}", headers=admin).json()["records"]
        assert len(records) == 1 and http.get(f"/sessions/{theirs['id']}", headers=admin).is_success
        assert engine.weight_version == 0 and same(weights_of(engine), before)
        assert http.get("/health").json()["sessions"] == 2


def test_the_weights_directory_confines_publication_and_refusals_say_nothing(
    tmp_path: Path,
) -> None:
    allowed, outside = tmp_path / "weights", tmp_path / "private"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "not-weights.safetensors").write_bytes(b"\x00" * 5000)
    admin = {"authorization": f"Bearer {TOKEN}"}
    with guarded(allowed) as (engine, url), httpx.Client(base_url=url, timeout=60) as http:
        new = {n: p + 0.01 for n, p in weights_of(engine).items()}
        save_file(new, outside / "model.safetensors")
        (allowed / "link.safetensors").symlink_to(outside / "model.safetensors")
        before = weights_of(engine)
        refusals = {
            "outside": outside / "model.safetensors",
            "dot-dot": allowed / ".." / "private" / "model.safetensors",
            "link out": allowed / "link.safetensors",
            "missing": allowed / "missing.safetensors",
            "not safetensors": allowed / "not-weights.safetensors",
            "outside dir": outside,
        }
        for why, path in refusals.items():
            response = http.post("/weights", json={"path": str(path)}, headers=admin)
            assert response.status_code == 400, why
            message = response.json()["error"]["message"]
            assert message == (
                f"path: no loadable safetensors weights at {str(path)!r} inside the server's "
                "weights directory"
            ), why
        assert engine.weight_version == 0 and same(weights_of(engine), before)
        (allowed / "link.safetensors").unlink()
        save_file(new, allowed / "model.safetensors")
        (allowed / "not-weights.safetensors").unlink()
        response = http.post("/weights", json={"path": str(allowed), "version": 3}, headers=admin)
        assert response.json() == {"weight_version": 3}
        assert same(weights_of(engine), new)


def test_the_cli_token_comes_from_a_file_the_environment_or_is_made(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.delenv(ADMIN_TOKEN_ENV, raising=False)
    (tmp_path / "token").write_text(TOKEN + "\n")
    assert admin_token_from(str(tmp_path / "token")) == (TOKEN, False)
    monkeypatch.setenv(ADMIN_TOKEN_ENV, "from-the-environment-0123")
    assert admin_token_from(None) == ("from-the-environment-0123", False)
    monkeypatch.delenv(ADMIN_TOKEN_ENV)
    made, generated = admin_token_from(None)
    assert generated and len(made) >= 32 and made != admin_token_from(None)[0]
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(InputError, match="--admin-token-file: .* is empty"):
        admin_token_from(str(tmp_path / "empty"))
    with pytest.raises(InputError, match="admin_token: use at least 16 characters"):
        ControlPolicy(admin_token="short")


def test_the_session_server_cli_always_runs_with_a_token(monkeypatch, tmp_path, capsys) -> None:
    from furlong import cli
    from furlong.rollout.sessions import serve as session_serve

    seen: list = []
    monkeypatch.setattr(session_serve, "serve", lambda *args, **kw: seen.append(args))
    monkeypatch.delenv(ADMIN_TOKEN_ENV, raising=False)
    assert cli.main(["session-server", "--pause-mode", "abort", "--port", "0"]) == 0
    policy = seen[-1][4]
    line = f"furlong session-server: admin token for control routes: {policy.admin_token}"
    assert capsys.readouterr().err.strip() == line and policy.weights_dir is None
    (tmp_path / "token").write_text(TOKEN)
    args = ["--admin-token-file", str(tmp_path / "token"), "--weights-dir", str(tmp_path)]
    assert cli.main(["session-server", "--pause-mode", "abort", "--port", "0", *args]) == 0
    policy = seen[-1][4]
    assert policy.admin_token == TOKEN and policy.weights_dir == tmp_path.resolve()
    assert capsys.readouterr().err == ""
