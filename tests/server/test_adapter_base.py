"""A LoRA sampler snapshot names its base as served (the name clients create models with), on
disk as in the exports built from it, so peft finds the base from the directory alone."""

from __future__ import annotations

from pathlib import Path

import pytest
from peft import PeftConfig

from furlong.server.models import LoraSpec
from tests.server.test_models import BASE, make_pool

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_snapshot_names_the_served_base(tmp_path: Path) -> None:
    pool = make_pool(tmp_path)
    model = pool.create("a", BASE, LoraSpec(rank=4))
    model.save_sampler_weights(tmp_path / "snap")
    assert PeftConfig.from_pretrained(str(tmp_path / "snap")).base_model_name_or_path == BASE
