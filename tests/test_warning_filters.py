"""No warnings of our own: pyproject.toml's filterwarnings turns a warning attributed to
furlong's modules or the project's tests into an error, and leaves everyone else's a warning."""

import warnings

import pytest

WARN = compile("import warnings\nwarnings.warn('w', FutureWarning)", "<from a module>", "exec")


def warn_as(module: str) -> list[warnings.WarningMessage]:
    """What a ``warnings.warn`` from module ``module`` does under the filters pytest applies to
    this test: the warnings it records (it raises where a filter says error)."""
    with warnings.catch_warnings(record=True) as log:  # records, and keeps the filters as set
        exec(WARN, {"__name__": module})
    return log


@pytest.fixture(autouse=True)
def _ini_filters(request: pytest.FixtureRequest) -> None:
    if request.config.getoption("pythonwarnings"):
        pytest.skip("-W comes after the ini's filterwarnings and overrides them")


@pytest.mark.parametrize("module", ["furlong", "furlong.server.app", "tests.server.test_sdk"])
def test_a_warning_of_our_own_is_an_error(module: str) -> None:
    with pytest.raises(FutureWarning, match="^w$"):
        warn_as(module)


@pytest.mark.parametrize("module", ["furlong_plugin", "peft.tuners.lora", "testsuite"])
def test_anyone_elses_stays_a_warning(module: str) -> None:
    assert [str(w.message) for w in warn_as(module)] == ["w"]
