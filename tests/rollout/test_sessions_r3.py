"""Incremental routing replay (R3) in the session server: the mode flag, the offsets each turn
sends (they move back on rollback), the stored records, and assembly with its errors."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from furlong.errors import InputError
from furlong.rollout.codec import opt_in
from furlong.rollout.sample import Sample
from furlong.rollout.sessions import (
    AssemblyError,
    SessionServerConfig,
    TurnRecord,
    assemble_routed_experts,
    use_addition_r3,
)
from furlong.rollout.sessions.chat import Message
from furlong.rollout.sessions.r3 import request_offset
from furlong.rollout.sessions.wire import sample_from_json

from .session_helpers import checkpoint_len, info, open_session, serve, turn

pytestmark = pytest.mark.usefixtures("one_thread")
MOE = "tiny-qwen3-moe"
USER = [{"role": "user", "content": "What is 2 + 3?"}]


def routed_sample(client, sid: str, **body: int) -> Sample:
    """The session's sample over ``/samples``, opted in to the routed-expert rows."""
    response = client.post(f"/sessions/{sid}/samples?fields=routed_experts", json=body)
    return sample_from_json(response.json()["samples"][0], opt_in("routed_experts"))


def record(start: int | None, end: int, rows: int | None, name: str = "r") -> TurnRecord:
    payload = None if rows is None else torch.full((rows, 2, 2), end, dtype=torch.int32)
    return TurnRecord(
        name, [], [], [], None, Message("assistant", ""), "stop", 0, start, end, payload
    )


# ---------------------------------------------------------------- the flag and the offset


def test_mode_mapping() -> None:
    assert use_addition_r3("abort") and use_addition_r3("in_place")
    assert not use_addition_r3("retract")
    with pytest.raises(InputError, match="mode: 'later'"):
        use_addition_r3("later")


def test_offset_is_checkpoint_minus_one_and_needs_the_common_prefix() -> None:
    assert request_offset(0, 0) == 0
    assert request_offset(1, 1) == 0
    assert request_offset(40, 40) == 39
    with pytest.raises(InputError, match="shares 30 tokens"):
        request_offset(40, 30)


# ---------------------------------------------------------------- config validation


def test_config_rejects_partial_rollout_and_needs_a_pause_mode() -> None:
    with pytest.raises(InputError, match="partial_rollout: not supported"):
        SessionServerConfig(pause_mode="abort", partial_rollout=True)
    with pytest.raises(TypeError):
        SessionServerConfig()  # type: ignore[call-arg]  # the pause mode is required
    with pytest.raises(InputError, match="mode: 'sometimes'"):
        SessionServerConfig(pause_mode="sometimes")  # type: ignore[arg-type]
    with pytest.raises(InputError, match="max_tokens"):
        SessionServerConfig(pause_mode="abort", max_tokens=0)
    SessionServerConfig(pause_mode="abort")  # abort is allowed


@pytest.mark.parametrize("mode", ["abort", "in_place", "retract"])
def test_flag_is_derived_at_start_and_retract_with_replay_warns(mode: str, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="furlong.sessions"):
        with serve(MOE, pause_mode=mode) as (server, _, _):
            assert server.use_addition_r3 == (mode != "retract") and server.replay
        with serve("tiny-qwen3", pause_mode=mode) as (dense, _, _):
            assert not dense.replay  # no routers: nothing to replay, nothing to warn about
    warned = [r for r in caplog.records if "full routed-expert rows" in r.getMessage()]
    assert len(warned) == (1 if mode == "retract" else 0)


# ---------------------------------------------------------------- assembly


def test_assembly_concatenates_and_cuts() -> None:
    records = [record(0, 5, 5, "a"), record(5, 5, None, "empty"), record(5, 9, 4, "b")]
    rows = assemble_routed_experts(records, 10, incremental=True)
    assert rows.shape == (9, 2, 2) and rows.dtype == torch.int32
    assert rows[:5].eq(5).all() and rows[5:].eq(9).all()
    cut = assemble_routed_experts(records, 7, incremental=True)  # a trimmed tail is cut
    assert torch.equal(cut, rows[:6])
    # the coverage is reached before the last record: the rest is not needed
    assert assemble_routed_experts(records, 6, incremental=True).shape[0] == 5


@pytest.mark.parametrize(
    "records,n_tokens,message",
    [
        ([record(0, 5, 5), record(4, 9, 5)], 10, r"records\[1\] \(request r\): start_len 4 != 5"),
        ([record(0, 5, 5), record(None, 9, 4)], 10, r"records\[1\].*no start_len"),
        ([record(0, 5, 5), record(5, 9, None)], 10, r"records\[1\].*no payload for a span of 4"),
        ([record(0, 5, 5), record(5, 5, 1)], 10, r"records\[1\].*a payload for a span of 0"),
        ([record(0, 5, 5), record(5, 9, 3)], 10, r"records\[1\].*payload shape \(3, 2, 2\)"),
        ([record(0, 5, 5), record(5, 3, None)], 10, r"records\[1\].*end 3 < start_len 5"),
        ([record(0, 5, 5), record(5, 8, 3)], 10, r"records: rows cover 8 positions, .* needs 9"),
        ([], 10, r"records: rows cover 0 positions"),
    ],
    ids=["start", "missing-offset", "no-payload", "extra-payload", "size", "end", "short", "none"],
)
def test_assembly_errors_name_the_record(records, n_tokens, message) -> None:
    with pytest.raises(AssemblyError, match=message):
        assemble_routed_experts(records, n_tokens, incremental=True)


def test_full_assembly_uses_the_last_records_rows() -> None:
    records = [record(None, 5, 5), record(None, 9, 9)]
    assert assemble_routed_experts(records, 8, incremental=False).shape[0] == 7
    with pytest.raises(AssemblyError, match=r"records\[1\].*start_len 3 under full R3"):
        assemble_routed_experts([record(None, 5, 5), record(3, 9, 6)], 10, incremental=False)
    with pytest.raises(AssemblyError, match=r"records\[0\].*expected 9 full rows"):
        assemble_routed_experts([record(None, 9, 8)], 10, incremental=False)
    with pytest.raises(AssemblyError, match=r"covers? 9 positions.*needs 11"):
        assemble_routed_experts([record(None, 9, 9)], 12, incremental=False)


# ---------------------------------------------------------------- offsets over HTTP


@torch.no_grad()
def full_rows(engine, tokens: list[int]) -> torch.Tensor:
    """Oracle: every row of one full-sequence pass (prefill of tokens[:-1], one token more)."""
    from furlong.rollout.sampling import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0, return_routed_experts=True)
    (result,) = engine.generate([tokens[:-1]], params)
    return result.routed_experts


def test_offsets_across_turns_rollback_and_retry() -> None:
    with serve(MOE, pause_mode="abort") as (server, spy, client):
        sid = open_session(client)
        first = turn(client, sid, USER, seed=1)
        history = [*USER, first]
        turn(client, sid, [*history, {"role": "tool", "content": "5"}], seed=2)
        records = info(client, sid)["records"]
        ckpt1, ckpt2 = checkpoint_len(records[0]), checkpoint_len(records[1])
        assert [p.routed_experts_start for p in spy.params] == [0, ckpt1 - 1]
        assert all(p.return_routed_experts for p in spy.params)
        assert [r["start_len"] for r in records] == [0, ckpt1 - 1]
        assert [r["end"] for r in records] == [ckpt1 - 1, ckpt2 - 1]
        assert [r["routed_rows"] for r in records] == [ckpt1 - 1, ckpt2 - ckpt1]

        # a third turn, then a retry of the second with a different tool result: the
        # checkpoint rolls back to turn 1 and the offset moves back with it
        after = [*history, {"role": "tool", "content": "5"}]
        second = turn(client, sid, after, seed=2)  # the same turn again: rolls back to turn 1
        assert spy.params[-1].routed_experts_start == ckpt1 - 1
        ckpt2 = checkpoint_len(info(client, sid)["records"][1])
        third = [*after, second, {"role": "user", "content": "And 4 + 4?"}]
        turn(client, sid, third, seed=3)
        assert spy.params[-1].routed_experts_start == ckpt2 - 1
        assert len(info(client, sid)["records"]) == 3
        turn(client, sid, [*history, {"role": "tool", "content": "six"}], seed=4)
        assert spy.params[-1].routed_experts_start == ckpt1 - 1  # backwards
        records = info(client, sid)["records"]
        assert len(records) == 2 and [r["start_len"] for r in records] == [0, ckpt1 - 1]
        assert (
            records[1]["prompt_ids"][:ckpt1] == records[0]["prompt_ids"] + records[0]["output_ids"]
        )

        # the assembled rows: len(tokens) - 1, each patch the matching slice of a full pass
        sample = routed_sample(client, sid)
        n = sample.tokens.numel()
        assert sample.routed_experts.shape[0] == n - 1 == checkpoint_len(records[1]) - 1
        oracle = full_rows(spy.engine, sample.tokens.tolist())
        assert torch.equal(sample.routed_experts, oracle)
        for r in server.get(sid).records:
            assert torch.equal(r.routed_experts, oracle[r.start_len : r.end])


def test_an_edited_assistant_message_rolls_back_to_the_start() -> None:
    """Only the session's own sampled tokens are spliced in; an assistant message the agent
    rewrote is text, so the prompt leaves the checkpoint inside turn 1."""
    with serve(MOE, pause_mode="in_place") as (_, spy, client):
        sid = open_session(client)
        first = turn(client, sid, USER, seed=1)
        edited = {"role": "assistant", "content": first["content"] + " (edited)"}
        turn(client, sid, [*USER, edited, {"role": "user", "content": "ok"}], seed=2)
        assert [p.routed_experts_start for p in spy.params] == [0, 0]
        (only,) = info(client, sid)["records"]
        assert only["start_len"] == 0 and only["prompt_ids"] == spy.prompts[1]


@pytest.mark.parametrize("mode", ["retract", "replay-off"])
def test_full_rows_or_none_without_an_offset(mode: str) -> None:
    config = {"routing_replay": False} if mode == "replay-off" else {}
    pause = "abort" if mode == "replay-off" else "retract"
    with serve(MOE, pause_mode=pause, **config) as (_, spy, client):
        sid = open_session(client)
        first = turn(client, sid, USER, seed=1)
        turn(client, sid, [*USER, first, {"role": "tool", "content": "5"}], seed=2)
        assert all(p.routed_experts_start == 0 for p in spy.params)  # no start_len sent
        assert all(p.return_routed_experts == (mode == "retract") for p in spy.params)
        records = info(client, sid)["records"]
        assert [r["start_len"] for r in records] == [None, None]
        if mode == "retract":  # every turn returned rows from position 0
            assert [r["routed_rows"] for r in records] == [r["end"] for r in records]
        sample = routed_sample(client, sid)
        rows = sample.routed_experts
        assert (rows is None) == (mode == "replay-off")
        if rows is not None:
            assert rows.shape[0] == sample.tokens.numel() - 1


def test_truncation_cuts_rows() -> None:
    with serve(MOE, pause_mode="abort") as (_, _, client):
        sid = open_session(client)
        first = turn(client, sid, USER, seed=1)
        turn(client, sid, [*USER, first, {"role": "tool", "content": "5"}], seed=2)
        url = f"/sessions/{sid}/samples"
        full = routed_sample(client, sid)
        n = full.tokens.numel()
        cut = routed_sample(client, sid, max_length=n - 3)
        assert cut.tokens.numel() == n - 3 and cut.response_length == full.response_length - 3
        assert torch.equal(cut.routed_experts, full.routed_experts[: n - 4])
        assert torch.equal(cut.loss_mask, full.loss_mask[:-3])
        too_short = client.post(url, json={"max_length": full.prompt_length - 1})
        assert too_short.status_code == 400 and "max_length" in too_short.json()["error"]["message"]


def _corrupt(server, sid: str, index: int, **changes) -> None:
    session = server.get(sid)
    session.records[index] = dataclasses.replace(session.records[index], **changes)


@pytest.mark.parametrize("case", ["start", "missing-offset", "no-payload", "size", "short"])
def test_assembly_errors_are_422_naming_the_record(case: str) -> None:
    def faulty(result):
        rows = result.routed_experts
        if case == "no-payload" and result.routed_experts_start > 0:
            return dataclasses.replace(result, routed_experts=None)
        if case == "size" and result.routed_experts_start > 0:
            return dataclasses.replace(result, routed_experts=rows[:-1])
        return result

    with serve(MOE, pause_mode="abort", edit=faulty) as (server, _, client):
        sid = open_session(client)
        first = turn(client, sid, USER, seed=1)
        turn(client, sid, [*USER, first, {"role": "tool", "content": "5"}], seed=2)
        last = server.get(sid).records[1]
        if case == "start":
            _corrupt(server, sid, 1, start_len=last.start_len + 1)
        elif case == "missing-offset":
            _corrupt(server, sid, 1, start_len=None)
        elif case == "short":  # consistent, but ends three rows early
            _corrupt(server, sid, 1, end=last.end - 3, routed_experts=last.routed_experts[:-3])
        before = info(client, sid)
        response = client.post(f"/sessions/{sid}/samples")
        assert response.status_code == 422, response.text
        message = response.json()["error"]["message"]
        named = "records:" if case == "short" else f"records[1] (request {last.request_id})"
        why = {
            "start": f"start_len {last.start_len + 1} != {last.start_len} rows covered",
            "missing-offset": "no start_len (missing offset)",
            "no-payload": "no payload for a span of",
            "size": "payload shape",
            "short": f"rows cover {last.end - 3} positions, the trajectory needs {last.end}",
        }[case]
        assert named in message and why in message, message
        assert info(client, sid) == before  # nothing changed, nothing partial returned
