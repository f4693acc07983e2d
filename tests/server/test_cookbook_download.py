"""tinker-cookbook 0.5.8's `weights.download`, unchanged, against `furlong serve` on 127.0.0.1,
for the three kinds of path it takes: an HF export (`external_weights/`), a training
checkpoint (`weights/`: the cookbook exports it age-encrypted to a key of its own, downloads,
decrypts and deletes the export) and a sampler snapshot (`sampler_weights/`: a tar archive).

The oracle is the server itself: the downloaded adapter, applied with peft to the same base
(`load_model("tiny-qwen3")`, what the server serves as `BASE`), must give the log-probs the
server's `forward` gives for the trained model. The cookbook is installed without its
dependencies (`make install`; it caps transformers below what furlong needs): its `weights`
module needs only `tinker` and `pyrage`, which furlong's server extra brings.
"""

from __future__ import annotations

import concurrent.futures
import io
import json
import os
import shutil
import subprocess
import tarfile
import urllib.error
import urllib.request
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import quote

import httpx
import pyrage
import pytest
import tinker
from tinker import types

from furlong.server import checkpoint_archive
from furlong.server.models import SNAPSHOT_META
from tests.server.test_sdk import BASE, client, rl_data, serve
from tests.server.test_sdk_checkpoints import assert_serves_like

weights = pytest.importorskip("tinker_cookbook.weights")
from tinker_cookbook.exceptions import WeightsDownloadError  # noqa: E402

os.environ.setdefault("TINKER_TELEMETRY", "0")
# cookbook 0.5.8 calls what SDK 0.38 deprecates: pyproject.toml's filterwarnings ignores those
# two FutureWarnings from tinker_cookbook.weights._download alone
pytestmark = pytest.mark.usefixtures("one_thread")
KEY = "tml-cook"
ADAPTER_FILES = ["adapter_config.json", "adapter_model.safetensors"]


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("srv")


@pytest.fixture(scope="module")
def server(state_dir, one_thread):
    with serve(state_dir) as url:
        yield url


@pytest.fixture
def tenant(server, monkeypatch) -> None:
    """`download()` builds its own ServiceClient from the environment: point it at this
    server, as `KEY`."""
    monkeypatch.setenv("TINKER_BASE_URL", server)
    monkeypatch.setenv("TINKER_API_KEY", KEY)


@pytest.fixture(scope="module")
def training(server) -> tinker.TrainingClient:
    """A LoRA model one step away from its base (peft starts B at 0, so a wrong or missing
    adapter would show)."""
    model = client(server, KEY).create_lora_training_client(BASE, rank=4).result()
    model.forward_backward(rl_data(2)[0], "cross_entropy").result()
    model.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    return model


def listing(out: Path) -> list[str]:
    return sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))


# ---------------------------------------------------------------- the three path kinds


def test_an_hf_export_downloads(training, tenant, tmp_path) -> None:
    path = training.save_weights_external("final").result().path
    out = tmp_path / "adapter"
    assert weights.download(tinker_path=path, output_dir=str(out)) == str(out)
    assert listing(out) == ADAPTER_FILES
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == BASE
    assert_serves_like(training, out)


def test_a_training_checkpoint_downloads_through_an_encrypted_export(
    server, training, tenant, tmp_path, state_dir
) -> None:
    path = training.save_state("step1").result().path
    out = tmp_path / "adapter"
    weights.download(tinker_path=path, output_dir=str(out))
    assert listing(out) == ADAPTER_FILES  # decrypted, the .age suffix gone, no staging left
    assert_serves_like(training, out)

    # the cookbook loaded the checkpoint into a run of its own; its export is deleted
    rest = tinker.RestClient(base_url=server, api_key=KEY)
    runs = rest.list_training_runs().result()
    (run,) = [
        r
        for r in runs.training_runs
        if (r.user_metadata or {}).get("created_by") == "tinker_cookbook.weights.download"
    ]
    assert rest.list_checkpoints(run.training_run_id).result().checkpoints == []
    exports = state_dir / "state" / "runs" / run.training_run_id / "external_weights"
    assert [p.name for p in exports.iterdir()] == []  # neither the files nor their expiry


def test_a_sampler_snapshot_downloads_as_an_archive(
    training, tenant, tmp_path, state_dir, monkeypatch
) -> None:
    path = training.save_weights_for_sampler("snap").result().path
    out = tmp_path / "adapter"
    # SDK 0.38 has no archive method (it was deprecated in favour of external weights): the
    # cookbook fails before it asks the server
    assert not hasattr(tinker.RestClient, "get_checkpoint_archive_url_from_tinker_path")
    with pytest.raises(WeightsDownloadError, match="Failed to get download URL"):
        weights.download(tinker_path=path, output_dir=str(out))

    # with the method SDKs up to 0.37 have, the cookbook downloads and extracts the archive
    monkeypatch.setattr(
        tinker.RestClient,
        "get_checkpoint_archive_url_from_tinker_path",
        archive_url_like_sdk_0_34,
        raising=False,
    )
    weights.download(tinker_path=path, output_dir=str(out))
    assert listing(out) == ADAPTER_FILES  # top level, furlong's own metadata left out
    snapshot = state_dir / "state" / "runs" / training.model_id / "sampler_weights" / "snap"
    assert (snapshot / SNAPSHOT_META).is_file()
    got = out / "adapter_model.safetensors"
    assert got.read_bytes() == (snapshot / "adapter_model.safetensors").read_bytes()
    # the config is the snapshot's, naming the served base (as an HF export does)
    config = json.loads((out / "adapter_config.json").read_text())
    on_disk = json.loads((snapshot / "adapter_config.json").read_text())
    assert config == on_disk | {"base_model_name_or_path": BASE}
    assert_serves_like(training, out)


def archive_url_like_sdk_0_34(
    self: tinker.RestClient, tinker_path: str
) -> concurrent.futures.Future[SimpleNamespace]:
    """`RestClient.get_checkpoint_archive_url_from_tinker_path` as SDK 0.34 sends it (0.38
    dropped it): GET `.../archive` without following the redirect; the URL is its `Location`,
    valid until its `Expires`. Key and server from the environment, as `download()` has."""
    parsed = tinker.ParsedCheckpointTinkerPath.from_tinker_path(tinker_path)
    response = httpx.get(
        f"{os.environ['TINKER_BASE_URL']}/api/v1/training_runs/{parsed.training_run_id}"
        f"/checkpoints/{parsed.checkpoint_id}/archive",
        headers={"X-API-Key": os.environ["TINKER_API_KEY"], "Accept": "application/json"},
        follow_redirects=False,
    )
    if response.status_code != 302:
        raise RuntimeError(f"HTTP {response.status_code}: {response.text}")
    expires = parsedate_to_datetime(response.headers["Expires"])
    future: concurrent.futures.Future[SimpleNamespace] = concurrent.futures.Future()
    future.set_result(SimpleNamespace(url=response.headers["Location"], expires=expires))
    return future


# ---------------------------------------------------------------- archives: the wire, and owners


def status_of(url: str, headers: dict[str, str] | None = None) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {})):
            return 200
    except urllib.error.HTTPError as exc:
        return exc.code


def test_archive_urls_are_owner_scoped(server, training) -> None:
    path = training.save_weights_for_sampler("mine").result().path
    run = quote(training.model_id)
    route = f"{server}/api/v1/training_runs/{run}/checkpoints/sampler_weights/mine"
    answer = httpx.get(f"{route}/archive", headers={"X-API-Key": KEY})
    assert answer.status_code == 302
    url = answer.headers["location"]
    assert answer.json() == {"url": url, "expires": answer.json()["expires"]}
    expires = parsedate_to_datetime(answer.headers["expires"])
    assert expires > datetime.now(UTC)
    assert url.startswith(f"{route}/archive.tar?token=")
    assert status_of(url) == 200  # no headers, like the cookbook's urlretrieve

    bare, token = url.partition("?token=")[::2]
    forged = token[:-1] + ("1" if token.endswith("0") else "0")
    assert status_of(f"{bare}?token={forged}") == 401
    assert status_of(f"{route}/files/adapter_config.json?token={token}") == 401  # another file
    assert status_of(bare) == 401  # neither a token nor a key
    assert status_of(bare, {"X-API-Key": KEY}) == 200  # the owner's key instead
    assert status_of(bare, {"X-API-Key": "tml-other"}) == 404
    assert httpx.get(f"{route}/archive", headers={"X-API-Key": "tml-other"}).status_code == 404

    weights_route = route.replace("sampler_weights/mine", "weights/mine")
    refused = httpx.get(f"{weights_route}/archive", headers={"X-API-Key": KEY})
    assert refused.status_code == 400 and "save_weights_external" in refused.json()["detail"]
    # a deleted snapshot serves nothing, even with URLs signed before
    tinker.RestClient(base_url=server, api_key=KEY).delete_checkpoint_from_tinker_path(
        path
    ).result()
    assert status_of(url) == 404


def test_an_archive_is_a_plain_tar_of_the_snapshot(tmp_path) -> None:
    """A full fine-tune's snapshot shape: sizes around the 512-byte block, a subdirectory, a
    link that must stay out, and furlong's metadata, which stays out too."""
    snap = tmp_path / "snap"
    (snap / "sub").mkdir(parents=True)
    files = {"config.json": b"{}", "empty": b"", "block": bytes(512), "odd": os.urandom(513)}
    files["sub/model.safetensors"] = os.urandom(3 << 20)  # several read chunks
    for name, data in files.items():
        (snap / name).write_bytes(data)
    (snap / SNAPSHOT_META).write_text(json.dumps({"kind": "full", "base_model": BASE}))
    (snap / "link").symlink_to(snap / "odd")
    archive = checkpoint_archive.open_archive(snap)
    data = b"".join(archive.chunks())
    assert len(data) == archive.length and len(data) % 512 == 0
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        assert sorted(tar.getnames()) == sorted(files)
        assert all(m.isreg() for m in tar.getmembers())
        assert {n: tar.extractfile(n).read() for n in files} == files
    if shutil.which("tar"):  # GNU/BSD tar reads it too
        (tmp_path / "a.tar").write_bytes(data)
        listed = subprocess.run(["tar", "-tf", tmp_path / "a.tar"], capture_output=True, check=True)
        assert sorted(listed.stdout.decode().split()) == sorted(files)


# ---------------------------------------------------------------- age encryption


def test_exports_are_encrypted_to_every_recipient(server, training) -> None:
    plain = training.save_weights_external("plain").result().path
    identities = [pyrage.x25519.Identity.generate() for _ in range(2)]
    recipients = [str(i.to_public()) for i in identities]
    encrypted = training.save_weights_external("sealed", age_encryption_recipients=recipients)
    rest = tinker.RestClient(base_url=server, api_key=KEY)
    want = {n: fetch(u) for n, u in rest.get_external_weights_urls(plain).result().urls.items()}
    urls = rest.get_external_weights_urls(encrypted.result().path).result().urls
    assert sorted(urls) == [f"{n}.age" for n in ADAPTER_FILES]
    for name, url in urls.items():
        sealed = fetch(url)
        assert want[name.removesuffix(".age")] not in sealed
        for identity in identities:  # each recipient alone can decrypt
            assert pyrage.decrypt(sealed, [identity]) == want[name.removesuffix(".age")]
        with pytest.raises(pyrage.DecryptError):
            pyrage.decrypt(sealed, [pyrage.x25519.Identity.generate()])


@pytest.mark.skipif(shutil.which("ssh-keygen") is None, reason="needs ssh-keygen")
def test_an_ssh_key_is_a_recipient(server, training, tmp_path) -> None:
    key = tmp_path / "id"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key], check=True)
    public = key.with_suffix(".pub").read_text()  # with its comment and newline
    path = training.save_weights_external("ssh", age_encryption_recipients=[public]).result().path
    rest = tinker.RestClient(base_url=server, api_key=KEY)
    url = rest.get_external_weights_urls(path).result().urls["adapter_config.json.age"]
    config = pyrage.decrypt(fetch(url), [pyrage.ssh.Identity.from_buffer(key.read_bytes())])
    assert json.loads(config)["base_model_name_or_path"] == BASE


def test_bad_recipients_are_refused_by_index(server) -> None:
    model = client(server, KEY).create_lora_training_client(BASE, rank=4).result()
    good = str(pyrage.x25519.Identity.generate().to_public())

    def post(recipients: list[str], seq_id: int) -> httpx.Response:
        body = {
            "model_id": model.model_id,
            "seq_id": seq_id,
            "path": "x",
            "age_encryption_recipients": recipients,
        }
        return httpx.post(
            f"{server}/api/v1/save_weights_external", json=body, headers={"X-API-Key": KEY}
        )

    bad = post([good, good, "age1xyz"], seq_id=1)
    assert bad.status_code == 400
    assert bad.json()["detail"].startswith(
        "age_encryption_recipients[2]: 'age1xyz' is not a valid age X25519 public key"
    )
    neither = post([good, "ssh-ed25519 AAAA"], seq_id=2)
    assert neither.status_code == 400
    assert neither.json()["detail"].startswith("age_encryption_recipients[1]: 'ssh-ed25519 AAAA'")
    many = post([good] * 11, seq_id=3)
    assert many.status_code == 400
    assert many.json()["detail"] == "age_encryption_recipients: at most 10 recipients, got 11"
    # nothing was exported
    rest = tinker.RestClient(base_url=server, api_key=KEY)
    assert rest.list_checkpoints(model.model_id).result().checkpoints == []


def fetch(url: str) -> bytes:
    with urllib.request.urlopen(url) as response:
        return response.read()
