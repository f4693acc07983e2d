"""Twenty sessions at once over real HTTP: their turns share the engine's batch, yet each
trajectory is exactly what the same session produces alone, and holds only its own turns."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from furlong.rollout.sessions.wire import sample_from_json

from .session_helpers import info, open_session, serve, turn

pytestmark = pytest.mark.usefixtures("one_thread")
SESSIONS = 20


def conversation(client: httpx.Client, i: int) -> tuple[str, list[int], list[float]]:
    """Two turns (a question, then a tool result) of session ``i``; its tokens and mask."""
    sid = open_session(client)
    messages = [{"role": "user", "content": f"Session {i}: what is {i} + {i}?"}]
    messages.append(turn(client, sid, messages, seed=i, max_tokens=6))
    messages.append({"role": "tool", "content": str(2 * i)})
    turn(client, sid, messages, seed=100 + i, max_tokens=6)
    sample = sample_from_json(client.post(f"/sessions/{sid}/samples").json()["samples"][0])
    assert len(info(client, sid)["records"]) == 2
    return sid, sample.tokens.tolist(), sample.loss_mask.tolist()


def test_twenty_concurrent_sessions_stay_isolated() -> None:
    with serve() as (server, spy, client):
        alone = [conversation(client, i) for i in range(SESSIONS)]
        steps_alone = spy.engine.steps
        with ThreadPoolExecutor(SESSIONS) as pool:
            together = list(pool.map(lambda i: conversation(client, i), range(SESSIONS)))
        # they did share batches: far fewer engine steps than one session at a time
        assert spy.engine.steps - steps_alone < steps_alone
        tokenizer = server.tokenizer
        for i, ((_, tokens, mask), (sid, tokens_c, mask_c)) in enumerate(
            zip(alone, together, strict=True)
        ):
            assert tokens_c == tokens and mask_c == mask, f"session {i} differs"
            text = tokenizer.decode(tokens_c)
            assert f"Session {i}:" in text
            assert all(f"Session {j}:" not in text for j in range(SESSIONS) if j != i)
            assert len(server.get(sid).records) == 2
        assert len(server.sessions) == 2 * SESSIONS
