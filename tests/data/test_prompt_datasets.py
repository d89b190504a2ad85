"""Prompt tables as ``data.prompts``: a ``.parquet`` file and a Hugging Face ``datasets`` directory
(``Dataset.save_to_disk``) give ``PromptRecord``s in row order with the other columns as metadata; a missing
``prompt`` column, an empty prompt, a corrupt file, an empty table and a ``DatasetDict`` directory are refused in
one line, by the reader and by preflight (ConfigError); the run's prompt stream hands the metadata on.

Needs: CPU, 1 process, pyarrow and datasets (~15 s: the datasets and run modules' imports)."""
from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megaflow.config import ConfigError, load_config
from megaflow.config import preflight as pf
from megaflow.data.prompts import PromptRecord, PromptStream, prompt_pool

ROWS = {"prompt": ["a red circle", "  two blue squares ", "a sign that says \"OPEN\""],
        "text": ["RED", "BLUE", "TIGER"], "n": [1, 2, 3], "tags": [["a"], [], ["b", "c"]]}
EXPECTED = [PromptRecord("a red circle", {"text": "RED", "n": 1, "tags": ["a"]}),
            PromptRecord("two blue squares", {"text": "BLUE", "n": 2, "tags": []}),
            PromptRecord("a sign that says \"OPEN\"", {"text": "TIGER", "n": 3, "tags": ["b", "c"]})]


def _parquet(tmp_path, columns=ROWS, name="prompts.parquet"):
    path = tmp_path / name
    pq.write_table(pa.table(columns), path)
    return path


def _dataset(tmp_path, columns=ROWS, name="ds"):
    import datasets

    path = tmp_path / name
    datasets.Dataset.from_dict(columns).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("make", [_parquet, _dataset])
def test_table_rows_become_records_in_order(tmp_path, make):
    pool = prompt_pool(str(make(tmp_path)), seed=0)
    assert pool == EXPECTED
    assert all(type(r.metadata["n"]) is int and type(r.metadata["tags"]) is list for r in pool)


BAD = {"no prompt column": ({"caption": ["x"]}, "has no 'prompt' column (columns: caption)"),
       "empty prompt": ({"prompt": ["a", "b", "  "]}, "row 2 (counting from 0): needs a non-empty string 'prompt'"),
       "null prompt": ({"prompt": ["a", None]}, "row 1 (counting from 0): needs a non-empty string 'prompt'"),
       "int prompt": ({"prompt": [7]}, "row 0 (counting from 0): needs a non-empty string 'prompt'"),
       "long prompt": ({"prompt": ["x" * 2001]}, "row 0 (counting from 0): a prompt of 2001 characters"),
       "empty table": ({"prompt": []}, "has no prompts (an empty table)")}


@pytest.mark.parametrize("make", [_parquet, _dataset])
@pytest.mark.parametrize("case", list(BAD))
def test_bad_tables_are_refused_in_one_line(tmp_path, make, case):
    columns, fragment = BAD[case]
    path = make(tmp_path, columns)
    with pytest.raises(ValueError) as e:
        prompt_pool(str(path), seed=0, key="data.test_prompts")
    message = str(e.value)
    assert message.startswith(f"data.test_prompts: {path}") and fragment in message and "\n" not in message


def test_corrupt_parquet_is_refused_in_one_line(tmp_path):
    path = tmp_path / "broken.parquet"
    path.write_bytes(os.urandom(4096))
    with pytest.raises(ValueError) as e:
        prompt_pool(str(path), seed=0)
    assert str(e.value).startswith(f"data.prompts: {path} is not a readable parquet file (")
    assert "\n" not in str(e.value)


def test_dataset_dict_and_plain_directories_are_refused(tmp_path):
    import datasets

    split = datasets.Dataset.from_dict({"prompt": ["a"]})
    datasets.DatasetDict({"train": split, "test": split}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match=r"is a DatasetDict \(splits: (train, test|test, train)\); point "
                                         r"data.prompts at one split's directory, e.g. .*dd/t") as e:
        prompt_pool(str(tmp_path / "dd"), seed=0)
    assert "\n" not in str(e.value)
    assert prompt_pool(str(tmp_path / "dd" / "train"), seed=0) == [PromptRecord("a", {})]
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match="plain is not a file, nor a Hugging Face datasets directory"):
        prompt_pool(str(tmp_path / "plain"), seed=0)


def test_a_missing_reader_says_what_to_install(tmp_path, monkeypatch):
    import sys

    table, ds = _parquet(tmp_path), _dataset(tmp_path)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # ``import pyarrow.parquet`` raises ImportError
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ValueError, match=r"^data.prompts: reading .*\.parquet needs pyarrow: pip install pyarrow$"):
        prompt_pool(str(table), seed=0)
    with pytest.raises(ValueError, match=r"^data.prompts: reading .*ds needs datasets: pip install datasets$"):
        prompt_pool(str(ds), seed=0)


def _cfg(path, *more):
    return load_config(None, [f'data.prompts="{path}"', "rollout.prompts_per_iter=2", "rollout.group_size=2", *more])


@pytest.mark.parametrize("make", [_parquet, _dataset])
def test_preflight_reads_tables(tmp_path, make):
    pf._check_data(_cfg(make(tmp_path)))  # a good table passes (and is not taken for a text file)
    bad = make(tmp_path, {"prompt": ["a", ""]}, name="bad.parquet" if make is _parquet else "bad")
    with pytest.raises(ConfigError, match=r"^data.prompts: .*bad(\.parquet)? row 1 \(counting from 0\): needs") as e:
        pf._check_data(_cfg(bad))
    assert "\n" not in str(e.value)


def test_preflight_refuses_a_corrupt_parquet_in_one_line(tmp_path):
    path = tmp_path / "broken.parquet"
    path.write_bytes(os.urandom(4096))
    with pytest.raises(ConfigError, match="is not a readable parquet file") as e:
        pf.preflight(_cfg(path), "show")
    assert str(e.value).startswith(f"data.prompts: {path}") and "\n" not in str(e.value)
    held = _parquet(tmp_path, {"text": ["x"]}, name="held.parquet")
    with pytest.raises(ConfigError, match="data.test_prompts: .*held.parquet has no 'prompt' column"):
        pf._check_data(_cfg(_parquet(tmp_path), f'data.test_prompts="{held}"'))


def test_run_prompt_stream_hands_on_parquet_metadata(tmp_path):
    from megaflow.run.build import prompt_stream
    from megaflow.run.requests import make_requests

    cfg = _cfg(_parquet(tmp_path), "rollout.prompts_per_iter=3")
    stream = prompt_stream(cfg)
    assert isinstance(stream, PromptStream)
    drawn = [next(stream) for _ in range(3)]
    assert sorted(drawn, key=lambda r: r.metadata["n"]) == EXPECTED
    requests = make_requests(cfg, prompt_stream(cfg), iteration=1)
    assert {r.prompt: r.metadata for r in requests} == {r.text: r.metadata for r in EXPECTED}


def test_a_huge_prompt_is_refused_from_the_parquet_metadata_before_reading(tmp_path, monkeypatch):
    """A few-KB zstd file holding a 64 MB string: refused from the row group's uncompressed size (no row group is
    read); repeated long prompts (a dictionary column) are refused from arrow's lengths, before Python copies."""
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["a", "x" * (64 << 20)]}), path, compression="zstd")
    assert path.stat().st_size < 100_000
    monkeypatch.setattr(pq.ParquetFile, "read_row_group", lambda *a, **k: pytest.fail("a row group was read"))
    with pytest.raises(ValueError, match=r"p.parquet row group 0: its 'prompt' column holds \d+ bytes for 2 rows, "
                                         r"so a prompt is longer than the 2000 characters"):
        prompt_pool(str(path), seed=0)
    monkeypatch.undo()
    pq.write_table(pa.table({"prompt": ["ok"] * 3 + ["y" * 3000] * 200}), path, compression="zstd")
    with pytest.raises(ValueError, match=r"p.parquet row 3 \(counting from 0\): a prompt of 3000 characters"):
        prompt_pool(str(path), seed=0)
