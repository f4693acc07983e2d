"""``task.name = "my_task:squares"``: problems made by code instead of read from a file."""

from furlong.rl.tasks import Problem


def squares(*, path: str, max_a: int, max_b: int) -> tuple[list[Problem], list[Problem]]:
    """``What is n squared?`` for 0 <= n <= max_a; every fifth n is held out."""
    problems = [Problem(f"What is {n} squared?", str(n * n)) for n in range(max_a + 1)]
    train = [p for n, p in enumerate(problems) if n % 5]
    return train, problems[::5]
