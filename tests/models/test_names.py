"""`check_model`: every kind of model name, decided at once and offline, in one line that names
the field and, for a near miss, the closest furlong model."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from furlong.errors import InputError
from furlong.models import names
from furlong.models.names import check_model
from furlong.models.presets import PRESETS

FIELD = "model.name"


def _refusal(spec: str, field: str = FIELD) -> str:
    with pytest.raises(InputError) as info:
        check_model(spec, field)
    message = str(info.value)
    assert message.startswith(f"{field}: ") and "\n" not in message
    return message


@pytest.fixture(autouse=True)
def _fresh_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test probes its own hub: an OS may hand a closed test port out again."""
    monkeypatch.setattr(names, "_probes", {})


@pytest.fixture
def online(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A hub that answers: HF_ENDPOINT at a listening loopback socket, no offline flag."""
    with socket.create_server(("127.0.0.1", 0)) as hub:
        _hub_at(monkeypatch, f"http://127.0.0.1:{hub.getsockname()[1]}")
        yield


@pytest.fixture
def unreachable(monkeypatch: pytest.MonkeyPatch) -> str:
    """A hub that does not answer: HF_ENDPOINT at a loopback port nobody listens on."""
    with socket.create_server(("127.0.0.1", 0)) as closed:
        port = closed.getsockname()[1]
    _hub_at(monkeypatch, f"http://127.0.0.1:{port}")
    return f"127.0.0.1:{port}"


def _hub_at(monkeypatch: pytest.MonkeyPatch, endpoint: str) -> None:
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setenv("no_proxy", "*")  # straight to the endpoint, whatever proxy is set


@pytest.mark.parametrize("name", [*PRESETS, "smollm2-135m"])
def test_presets_and_pretrained_names_pass(name: str) -> None:
    check_model(name, FIELD)


def test_a_directory_needs_config_json(tmp_path: Path) -> None:
    assert "no config.json" in _refusal(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    check_model(str(tmp_path), FIELD)
    assert "is a file" in _refusal(str(tmp_path / "config.json"))


def test_a_missing_path_and_an_empty_name() -> None:
    assert "no such directory './no-such-dir'" in _refusal("./no-such-dir")
    assert "no such directory 'runs/a/policy'" in _refusal("runs/a/policy")
    assert "empty name" in _refusal("  ")


def test_a_typo_suggests_the_preset_even_when_the_hub_answers(online: None) -> None:
    message = _refusal("tiny-qwen4")
    assert "did you mean 'tiny-qwen3'?" in message
    for name in PRESETS:
        assert name in message


def test_an_uncached_hub_id_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    message = _refusal("Qwen/Qwen3-8B-Base", "--base-model[0]")
    assert "hub is unreachable (HF_HUB_OFFLINE is set)" in message
    assert "hf download Qwen/Qwen3-8B-Base" in message
    assert "did you mean" not in message  # no furlong model is close


def test_an_unreachable_hub_fails_after_one_probe(unreachable: str) -> None:
    message = _refusal("org/tiny-qwen3x")
    assert f"no connection to {unreachable}" in message
    assert "did you mean 'tiny-qwen3'?" in message
    message = _refusal("no-such-model-xyz")  # bare, close to nothing: listed, not guessed
    assert "hub is unreachable" in message and "tiny-qwen3" in message
    assert "did you mean" not in message


def test_a_hub_id_passes_when_the_hub_answers(online: None) -> None:
    check_model("org/some-model", FIELD)
    check_model("gpt2", FIELD)  # a legacy id without namespace, nothing like a preset


def test_one_start_probes_the_hub_once(online: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """CLI, serve(), RLConfig.validate and load_model each check the name: one probe serves all."""
    probes: list[tuple[str, int]] = []
    real = names._probe
    monkeypatch.setattr(names, "_probe", lambda h, p: probes.append((h, p)) or real(h, p))
    for _ in range(3):
        check_model("org/some-model", FIELD)
    assert len(probes) == 1
    monkeypatch.setattr(names, "PROBE_REUSE_S", 0.0)  # a stale answer is asked again
    check_model("org/some-model", FIELD)
    assert len(probes) == 2


def test_a_cached_hub_id_passes_offline_and_nothing_heavy_is_imported(tmp_path: Path) -> None:
    """A hand-made HF cache under HF_HOME: refs/main names the snapshot holding config.json.
    In a fresh process, so huggingface_hub reads HF_HOME, and torch is provably not loaded."""
    repo = tmp_path / "hub" / "models--org--cached"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "snapshots" / "abc123" / "config.json").write_text("{}")
    script = (
        "import sys\n"
        "from furlong.errors import InputError\n"
        "from furlong.models.names import check_model\n"
        "check_model('org/cached', 'model.name')\n"
        "try:\n"
        "    check_model('org/other', 'model.name')\n"
        "except InputError as e:\n"
        "    print(e)\n"
        "print(sorted({'torch', 'transformers'} & set(sys.modules)))\n"
    )
    env = dict(os.environ, HF_HOME=str(tmp_path), HF_HUB_OFFLINE="1")
    env.pop("HF_HUB_CACHE", None)
    env.pop("HUGGINGFACE_HUB_CACHE", None)
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    refusal, heavy = done.stdout.splitlines()
    assert refusal.startswith("model.name: 'org/other' is not a model name furlong knows")
    assert heavy == "[]"


def test_behind_a_proxy_the_proxy_is_probed(
    monkeypatch: pytest.MonkeyPatch, unreachable: str
) -> None:
    """A download goes through HTTPS_PROXY, so that is the connection that must answer."""
    for var in ("no_proxy", "NO_PROXY", "HTTPS_PROXY", "HF_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("https_proxy", f"http://{unreachable}")
    assert f"no connection to {unreachable}" in _refusal("org/model")
