import pytest

from furlong.rl import tasks
from tests.train.helpers import short_text


@pytest.fixture
def short_reward(monkeypatch: pytest.MonkeyPatch) -> None:
    """``task.reward=short_text`` names the shared reward stub for this test only."""
    monkeypatch.setitem(tasks.REWARDS, "short_text", short_text)
