"""Ray placement: a cluster started on 127.0.0.1 runs RL steps with 2 trainer ranks and 1
rollout engine as actors on one placement group; the engine actor is killed mid-call and the
run recovers (restart + re-published weights: the rollout still scores like the trainer).

The run is a subprocess (see ray_worker.py), inside a network namespace with only loopback
where the machine allows one (``unshare -rn``), so Ray cannot advertise another address."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[2]


def loopback_namespace() -> list[str]:
    """``unshare -rn`` with ``lo`` up, if this machine allows user network namespaces."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return []
    probe = subprocess.run(["unshare", "-rn", "ip", "link", "set", "lo", "up"], capture_output=True)
    return (
        ["unshare", "-rn", "sh", "-c", 'ip link set lo up && exec "$@"', "sh"]
        if not probe.returncode
        else []
    )


def run_worker(tmp_path: Path, script: str, *args: str) -> dict:
    """Run ``tests/rl/<script>`` against a fresh Ray on 127.0.0.1; the JSON it wrote."""
    out = tmp_path / "result.json"
    ray_tmp = tempfile.mkdtemp(prefix="ray-")  # short: Ray's socket paths must fit 107 bytes
    env = os.environ | {"RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(ROOT), "TMPDIR": ray_tmp}
    cmd = [*loopback_namespace(), sys.executable, str(ROOT / "tests/rl" / script), str(out), *args]
    try:
        run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_ray_rl_run_survives_a_killed_engine(tmp_path) -> None:
    result = run_worker(tmp_path, "ray_worker.py", str(tmp_path / "run"))
    assert result["node_ip"] == "127.0.0.1"
    assert len(result["killed"]) == 1
    rows = result["rows"]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[-1]["rollout_restarts:max"] >= 1  # the engine died and was brought back
    for row in rows[1:]:  # and scored with the trainer's weights every step (stale: ~1e-1)
        assert row["logprob_diff:mean"] < 1e-4
    assert Path(result["policy"], "config.json").is_file()


def test_ray_results_travel_as_codec_payloads(tmp_path) -> None:
    """An engine actor's results reach the driver as a rollout-codec payload: the default one
    is the codec's default encoding of the same draws, the params' opt-in brings kept sets
    and routes, and a driver that did not opt in refuses them by name."""
    result = run_worker(tmp_path, "ray_codec_worker.py")
    assert result["node_ip"] == "127.0.0.1"
    assert result["default_bytes_equal"] and result["plain_optional"]
    for r in result["rich"]:
        assert r["routes"][0] == r["tokens"] - 1
        assert len(r["mask_rows"]) == len(r["output_ids"])
        assert all(t in row for t, row in zip(r["output_ids"], r["mask_rows"], strict=True))
    assert "['sampling_mask', 'routed_experts'] the receiver did not opt in" in result["refused"]
