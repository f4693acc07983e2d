"""``task.reward = "my_reward:score"``: partial credit, which no built-in verifier gives."""

from furlong.rl.tasks import Problem


def score(response: str, problem: Problem) -> float:
    """1 for the answer alone, 0.5 when it is somewhere in a longer reply, else 0 (any case)."""
    said, answer = response.strip().lower(), problem.answer.strip().lower()
    if said == answer:
        return 1.0
    return 0.5 if answer in said else 0.0
