"""HF datasets as a task source, offline: parquet, JSONL and CSV files, ``save_to_disk``
directories and a hub name in the local cache; the verifiers it pairs with."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from furlong.errors import InputError
from furlong.rl.config import TaskConfig
from furlong.rl.task_sources import check_task_config, make_task
from furlong.rl.tasks import Problem, math_verify, numeric

needs_datasets = pytest.mark.skipif(
    importlib.util.find_spec("datasets") is None,
    reason="datasets is not installed (pip install 'furlong[tasks]')",
)

ROWS = [{"question": f"What is {a} times 3?", "answer": str(3 * a), "id": a} for a in range(40)]


def task(where: Path | str, **fields) -> TaskConfig:
    settings = {"name": f"datasets:{where}", "prompt_field": "question", "reward": "numeric"}
    return TaskConfig(**(settings | {"extract": "last_number"} | fields))


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@needs_datasets
def test_one_jsonl_file_holds_out_a_stable_tenth(tmp_path) -> None:
    made = make_task(task(write_jsonl(tmp_path / "times.jsonl", ROWS)))
    assert len(made.train) + len(made.eval) == 40 and made.eval
    assert not {p.prompt for p in made.train} & {p.prompt for p in made.eval}
    again = make_task(task(tmp_path / "times.jsonl"))
    assert [p.prompt for p in again.eval] == [p.prompt for p in made.eval]
    first = next(p for p in made.train + made.eval if p.metadata["id"] == 7)
    assert (first.prompt, first.answer) == ("What is 7 times 3?", "21")
    assert made.score("3 x 7 is 21", first).correct == 1.0
    assert made.score("3 x 7 is 24", first).correct == 0.0


@needs_datasets
def test_parquet_train_and_test_files_are_the_splits(tmp_path) -> None:
    import datasets

    data = tmp_path / "times"
    data.mkdir()
    datasets.Dataset.from_list(ROWS[:30]).to_parquet(str(data / "train.parquet"))
    # one test row repeats a train question: dropped from the held-out split
    test = [*ROWS[30:], ROWS[0]]
    datasets.Dataset.from_list(test).to_parquet(str(data / "test.parquet"))
    made = make_task(task(data))
    assert [p.metadata["id"] for p in made.train] == list(range(30))
    assert sorted(p.metadata["id"] for p in made.eval) == list(range(30, 40))
    single = make_task(task(data / "test.parquet", constant_check="off"))  # "0": 1 of 9
    assert len(single.train) + len(single.eval) == 11


@needs_datasets
def test_a_save_to_disk_directory_and_a_template(tmp_path) -> None:
    import datasets

    splits = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(ROWS[:35]),
            "validation": datasets.Dataset.from_list(ROWS[35:]),
        }
    )
    splits.save_to_disk(str(tmp_path / "saved"))
    made = make_task(task(tmp_path / "saved", template="Q{id}: {question} Answer:"))
    assert made.eval[0].prompt == "Q35: What is 35 times 3? Answer:" and len(made.eval) == 5
    with pytest.raises(InputError, match=r"task.template: \{nope\} is not a field"):
        make_task(task(tmp_path / "saved", template="{nope}"))


@needs_datasets
def test_a_name_in_the_local_hf_cache_loads_offline(tmp_path, monkeypatch) -> None:
    """A hub dataset as ``datasets`` caches it once loaded (``<org>___<name>/<config>/...``),
    read back with the network off."""
    import datasets.config

    cache = tmp_path / "datasets"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    files = {"train": write_jsonl(tmp_path / "a.jsonl", ROWS[:32])}
    files["test"] = write_jsonl(tmp_path / "b.jsonl", ROWS[32:])
    builder = datasets.load_dataset_builder(
        "json", data_files={k: str(v) for k, v in files.items()}
    )
    builder.download_and_prepare()
    prepared = Path(builder.cache_dir)
    cached = cache / "furlong___times" / "default" / "0.0.0" / prepared.name
    cached.mkdir(parents=True)
    for item in prepared.iterdir():  # the cache names its files after the dataset
        (cached / item.name.replace("json-", "times-")).write_bytes(item.read_bytes())
    made = make_task(task("furlong/times"))
    assert len(made.train) == 32 and len(made.eval) == 8


@needs_datasets
def test_missing_columns_files_and_names_are_clear(tmp_path) -> None:
    path = write_jsonl(tmp_path / "times.jsonl", ROWS)
    with pytest.raises(InputError, match=r"task.answer_field: no column 'label'.*'answer'"):
        make_task(task(path, answer_field="label"))
    with pytest.raises(InputError, match="unknown file type '.txt'"):
        (tmp_path / "x.txt").write_text("a")
        check_task_config(task(tmp_path / "x.txt"))
    with pytest.raises(InputError, match="cannot load 'no/such-dataset' offline"):
        make_task(task("no/such-dataset"))
    with pytest.raises(InputError, match="task.config: only for reasoning_gym"):
        check_task_config(task(path, config={"size": 3}))


def test_numeric_and_math_equivalence() -> None:
    half = Problem("?", "0.5")
    assert numeric("0.50", half) == 1.0 and numeric("1,000", Problem("?", "1000")) == 1.0
    assert numeric("1/2", half) == 0.0 and numeric("half", half) == 0.0
    if importlib.util.find_spec("math_verify") is None:
        pytest.skip("math-verify is not installed (pip install 'furlong[tasks]')")
    assert math_verify("\\frac{1}{2}", half) == 1.0
    assert math_verify("1/2", half) == 1.0
    assert math_verify("0.6", half) == 0.0
    assert math_verify("x = 2", Problem("?", "2")) == 1.0
