"""StateDir start-up: an acknowledged checkpoint whose overwrite a crash cut short is back (and
listed), and the temp dirs of interrupted writes under runs/ and tokenizers/ are purged."""

from __future__ import annotations

from pathlib import Path

from furlong.server.state import StateDir

OLD = {"model.safetensors": b"acknowledged " * 300, "training_state.json": b'{"step": 3}'}
NEW = {"model.safetensors": b"never acknowledged " * 400}


def write(root: Path, files: dict[str, bytes]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for rel, data in files.items():
        (root / rel).write_bytes(data)


def contents(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in root.iterdir()}


def hidden(root: Path) -> list[Path]:
    return list(root.rglob(".*"))


def test_start_up_restores_a_checkpoint_lost_mid_overwrite(tmp_path):
    state = StateDir(tmp_path)
    run = "sess:train:0"
    state.write_run(run, {"base_model": "tiny-qwen3"})
    weights = state.run_dir(run) / "weights"
    # What a kill between publish_dir's two fallback renames leaves: final gone, the
    # acknowledged copy parked, the complete new copy still at its temp name.
    write(weights / ".ckpt.old-0123abcd", OLD)
    write(weights / ".ckpt.tmp-89abcdef", NEW)
    # Interrupted writes and a finished overwrite's old copy, elsewhere in the state dir.
    write(state.run_dir(run) / "sampler_weights" / ".snap.tmp-00c0ffee", NEW)
    write(tmp_path / "tokenizers" / "tiny-qwen3", {"tokenizer.json": b"{}"})
    write(tmp_path / "tokenizers" / ".tiny-qwen3.old-deadbeef", {"tokenizer.json": b"old"})
    write(tmp_path / "tokenizers" / ".tiny-qwen3.tmp-feedface", {"tokenizer.json": b"new"})
    assert [c["checkpoint_id"] for c in state.checkpoints(run)] == []

    state = StateDir(tmp_path)
    assert state.recovered == [weights / "ckpt"]
    assert contents(weights / "ckpt") == OLD
    assert contents(tmp_path / "tokenizers" / "tiny-qwen3") == {"tokenizer.json": b"{}"}
    assert hidden(tmp_path) == []
    listed = state.checkpoints(run)
    assert [c["tinker_path"] for c in listed] == [f"tinker://{run}/weights/ckpt"]
    assert listed[0]["size_bytes"] == sum(len(b) for b in OLD.values())
    assert [r for r, _ in state.runs()] == [run]


def test_listings_skip_writes_in_progress(tmp_path):
    state = StateDir(tmp_path)
    run = "sess:train:1"
    state.write_run(run, {"base_model": "tiny-qwen3"})
    write(state.run_dir(run) / "weights" / "a", OLD)
    write(state.run_dir(run) / "weights" / ".b.tmp-0123abcd", NEW)  # after start-up
    write(tmp_path / "runs" / ".sess:train:2.tmp-0123abcd", {"run.json": b"{}"})
    assert [c["checkpoint_id"] for c in state.checkpoints(run)] == ["weights/a"]
    assert [r for r, _ in state.runs()] == [run]
