"""Opt-in JWT auth (`furlong serve --jwt-auth`) through the official SDK on 127.0.0.1: the SDK
exchanges its key at `auth/token`, sends the token on every other request, and
`RestClient.whoami()` reads the tenant from it. Default mode stays plain API keys."""

from __future__ import annotations

import os

import httpx
import pytest
import tinker
from tinker.lib._jwt_auth import jwt_claims

from furlong.server.jwt_auth import InvalidToken, JwtAuth
from furlong.server.state import owner_id
from tests.server.cli_server import cli_server
from tests.server.test_sdk import BASE, client, rl_data, serve
from tests.server.test_sdk_checkpoints import HOUR, Clock

os.environ.setdefault("TINKER_TELEMETRY", "0")
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def jwt_server(tmp_path_factory, one_thread):
    with serve(tmp_path_factory.mktemp("srv"), jwt_auth=True) as url:
        yield url


def exchange(url: str, key: str) -> httpx.Response:
    return httpx.post(f"{url}/api/v1/auth/token", json={}, headers={"X-API-Key": key})


def test_whoami_names_the_keys_tenant(jwt_server) -> None:
    who = tinker.RestClient(base_url=jwt_server, api_key="tml-alice").whoami().result()
    owner = owner_id("tml-alice")
    assert who.user_urn == f"tml:user:{owner}"
    assert who.org_urn == f"tml:organization:{owner}"
    assert who.email is None
    bob = tinker.RestClient(base_url=jwt_server, api_key="tml-bob").whoami().result()
    assert bob.user_urn != who.user_urn


def test_training_runs_on_tokens_scoped_like_keys(jwt_server, monkeypatch) -> None:
    verified: list[str] = []  # the tenants of the requests that came with a token

    def verify(self: JwtAuth, token: str, _verify=JwtAuth.verify) -> str:
        verified.append(_verify(self, token))
        return verified[-1]

    monkeypatch.setattr(JwtAuth, "verify", verify)
    service = client(jwt_server, "tml-alice")
    training = service.create_lora_training_client(BASE, rank=4).result()
    out = training.forward_backward(rl_data(2)[0], "cross_entropy").result()
    assert "loss:sum" in out.metrics
    # create_session, create_model, get_info, forward_backward, retrieve_future: all tokens
    assert len(verified) >= 5 and set(verified) == {owner_id("tml-alice")}
    path = training.save_state("s").result().path
    # a token from the exchange is the same tenant as its key, never carrying the key
    token = exchange(jwt_server, "tml-alice").json()["jwt"]
    assert "tml-alice" not in token and jwt_claims(token)["exp"] > jwt_claims(token)["iat"]
    runs = httpx.get(f"{jwt_server}/api/v1/training_runs", headers={"X-API-Key": token})
    assert training.model_id in [r["training_run_id"] for r in runs.json()["training_runs"]]
    other = exchange(jwt_server, "tml-bob").json()["jwt"]
    info = {"tinker_path": path}
    foreign = httpx.post(
        f"{jwt_server}/api/v1/weights_info", json=info, headers={"X-API-Key": other}
    )
    assert foreign.status_code == 404


def test_bad_tokens_are_401_invalid_token(jwt_server) -> None:
    token = exchange(jwt_server, "tml-alice").json()["jwt"]
    head, claims, sig = token.split(".")
    forged = f"{head}.{claims}.{'B' if sig[0] == 'A' else 'A'}{sig[1:]}"
    from_elsewhere = JwtAuth().issue(owner_id("tml-alice"))  # another server's secret
    for bad in (forged, from_elsewhere, "eyJ.nonsense"):
        r = httpx.get(f"{jwt_server}/api/v1/training_runs", headers={"X-API-Key": bad})
        assert r.status_code == 401
        assert r.headers["www-authenticate"] == 'Bearer error="invalid_token"'
    assert exchange(jwt_server, token).status_code == 401  # only keys are exchanged
    assert exchange(jwt_server, "not-a-key").status_code == 401


def test_tokens_expire() -> None:
    clock = Clock()
    auth = JwtAuth(clock)
    token = auth.issue(owner_id("tml-alice"))
    assert auth.verify(token) == owner_id("tml-alice")
    clock.now += HOUR
    with pytest.raises(InvalidToken, match="expired"):
        auth.verify(token)


def test_default_mode_is_plain_keys(tmp_path) -> None:
    with serve(tmp_path) as url:
        config = httpx.post(f"{url}/api/v1/client/config", json={}, headers={"X-API-Key": "tml-a"})
        assert config.json()["pjwt_auth_enabled"] is False
        assert exchange(url, "tml-a").status_code == 404
        with pytest.raises(RuntimeError, match="whoami requires JWT auth"):
            tinker.RestClient(base_url=url, api_key="tml-a").whoami().result()


def test_the_cli_flag(tmp_path) -> None:
    args = ["--base-model", f"{BASE}=tiny-qwen3", "--state-dir", str(tmp_path), "--jwt-auth"]
    with cli_server(args) as url:
        who = tinker.RestClient(base_url=url, api_key="tml-cli").whoami().result()
        assert who.user_urn == f"tml:user:{owner_id('tml-cli')}"
