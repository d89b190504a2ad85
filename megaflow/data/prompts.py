"""Where a run's prompts come from: a pool (the ShapeEval grammar's training prompts, the lines of a text
file, the objects of a ``.jsonl`` file, the rows of a ``.parquet`` file or of a Hugging Face ``datasets``
directory (``Dataset.save_to_disk``): a ``"prompt"`` plus fields / columns handed to the rewards as metadata) and
the endless, seeded stream over it that the loop draws from."""
from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

SHAPES = "shapes"
SHAPES_POOL = 512  # training prompts drawn from the ShapeEval grammar
MAX_PROMPT_CHARS = 2000  # a longer prompt is a mistake (text encoders read 77 to 512 tokens)
MAX_TABLE_BYTES = 256 << 20  # uncompressed bytes a .parquet prompt table may hold (its metadata says, unread)
MAX_TABLE_ROWS = 10_000_000  # rows of a prompt table
_PROMPT_BYTES = 4 * MAX_PROMPT_CHARS + 64  # what one prompt can take in a parquet column: UTF-8, length, slack


def json_object(text: str, where: str, want: str) -> dict:
    """``text`` parsed as one JSON object; ValueError ``"<where>: not JSON (...)"`` or ``"<where>: <want>, got
    <type>"`` (the one reading of a JSON-lines row, for prompt files and image manifests)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e.msg})") from None
    except RecursionError:
        raise ValueError(f"{where}: not JSON this reader takes (nested too deeply)") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: {want}, got {type(obj).__name__}")
    return obj


@dataclass(frozen=True)
class PromptRecord:
    """A prompt with metadata for the rewards (a ``.jsonl`` line's fields or a table row's columns other than
    ``"prompt"``)."""

    text: str
    metadata: dict = field(default_factory=dict)


def prompt_and_metadata(item: str | PromptRecord) -> tuple[str, dict]:
    """(prompt text, metadata) of a pool item: a plain string has no metadata."""
    if isinstance(item, PromptRecord):
        return item.text, dict(item.metadata)
    return item, {}


def prompt_record(prompt, metadata: dict, where: str) -> PromptRecord:
    """One row of a prompt file (``.jsonl`` line, parquet or dataset row) checked: ``prompt`` a non-empty string
    of at most ``MAX_PROMPT_CHARS`` characters; ValueError ``"<where>: why"`` (``where`` names the config key,
    the file and the row)."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"{where}: needs a non-empty string 'prompt'")
    if len(prompt.strip()) > MAX_PROMPT_CHARS:
        raise ValueError(f"{where}: a prompt of {len(prompt.strip())} characters, longer than the "
                         f"{MAX_PROMPT_CHARS} a prompt may have")
    return PromptRecord(prompt.strip(), metadata)


def read_jsonl_prompts(path: str | Path, key: str = "data.prompts") -> list[PromptRecord]:
    """The records of a ``.jsonl`` prompt file: one JSON object a line with a ``"prompt"`` (``prompt_record``;
    blank lines skipped); ValueError naming the config ``key``, the file and line of the first bad one."""
    path, records = Path(path), []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        obj = json_object(line, f"{key}: {path} line {n}", "expected a JSON object")
        records.append(prompt_record(obj.pop("prompt", None), obj, f"{key}: {path} line {n}"))
    return records


def _table_records(table, path: Path, key: str, first_row: int = 0) -> list[PromptRecord]:
    """The rows of a pyarrow table: its string column ``"prompt"`` (``prompt_record``), the other columns each
    row's metadata (plain Python values); ValueError without that column or without rows (rows count from 0,
    this table's first being ``first_row``). An over-long prompt is found on the arrow column, before any row
    becomes Python objects."""
    if "prompt" not in table.column_names:
        raise ValueError(f"{key}: {path} has no 'prompt' column (columns: {', '.join(table.column_names) or 'none'})")
    if table.num_rows == 0 and first_row == 0:
        raise ValueError(f"{key}: {path} has no prompts (an empty table)")
    _check_prompt_lengths(table.column("prompt"), path, key, first_row)
    records = []
    for i, row in enumerate(table.to_pylist(), first_row):
        records.append(prompt_record(row.pop("prompt"), row, f"{key}: {path} row {i} (counting from 0)"))
    return records


def _check_prompt_lengths(column, path: Path, key: str, first_row: int) -> None:
    """ValueError naming the first row whose prompt (whitespace trimmed) is over ``MAX_PROMPT_CHARS`` characters;
    lengths are computed by arrow (a dictionary column's on its dictionary), no prompt is copied into Python."""
    import pyarrow as pa
    import pyarrow.compute as pc
    row = first_row
    for chunk in column.chunks:
        kind = chunk.type.value_type if pa.types.is_dictionary(chunk.type) else chunk.type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            return  # not text: prompt_record says so, row by row
        values = chunk.dictionary if pa.types.is_dictionary(chunk.type) else chunk
        lengths = pc.utf8_length(pc.utf8_trim_whitespace(values))
        if pa.types.is_dictionary(chunk.type):
            lengths = pc.take(lengths, chunk.indices)
        over = pc.greater(lengths, MAX_PROMPT_CHARS)
        if pc.any(over).as_py():
            i = pc.index(over, True).as_py()
            raise ValueError(f"{key}: {path} row {row + i} (counting from 0): a prompt of {lengths[i].as_py()} "
                             f"characters, longer than the {MAX_PROMPT_CHARS} a prompt may have")
        row += len(chunk)


def _check_parquet_sizes(meta, path: Path, key: str) -> None:
    """ValueError, from a parquet file's metadata alone (nothing decompressed), when it holds more than
    ``MAX_TABLE_ROWS`` rows or ``MAX_TABLE_BYTES`` uncompressed bytes, or when a row group's ``prompt`` column holds
    more bytes than its rows' prompts could take (so one of them is over ``MAX_PROMPT_CHARS``): a 49 KB file can
    hold a 1.5 GB string."""
    if meta.num_rows > MAX_TABLE_ROWS:
        raise ValueError(f"{key}: {path} has {meta.num_rows} rows, more than the {MAX_TABLE_ROWS} a prompt table "
                         "may have")
    total = 0
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        for c in range(group.num_columns):
            column = group.column(c)
            size = column.total_uncompressed_size
            total += size
            if column.path_in_schema == "prompt" and size > group.num_rows * _PROMPT_BYTES + 4096:
                raise ValueError(f"{key}: {path} row group {g}: its 'prompt' column holds {size} bytes for "
                                 f"{group.num_rows} row{'s' if group.num_rows != 1 else ''}, so a prompt is longer "
                                 f"than the {MAX_PROMPT_CHARS} characters a prompt may have (refused from the "
                                 "file's metadata, before reading)")
    if total > MAX_TABLE_BYTES:
        raise ValueError(f"{key}: {path} holds {total / 2**20:.0f} MiB uncompressed, more than the "
                         f"{MAX_TABLE_BYTES >> 20} MiB a prompt table may (refused from the file's metadata, before "
                         "reading)")


def _needs(module: str, path: Path, key: str):
    """``import module`` or ValueError saying how to install it (pyarrow and datasets are optional)."""
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError:
        pip = module.split(".")[0]
        raise ValueError(f"{key}: reading {path} needs {pip}: pip install {pip}") from None


def read_parquet_prompts(path: str | Path, key: str = "data.prompts") -> list[PromptRecord]:
    """The rows of a ``.parquet`` prompt table (``_table_records``), read one row group at a time after its
    metadata passed ``_check_parquet_sizes`` (the prompt column read as a dictionary: repeated prompts are not
    copied before their lengths are checked); ValueError naming the config ``key`` and the file when it is
    unreadable, too large, has no ``"prompt"`` column, no rows or a bad prompt."""
    path = Path(path)
    pq = _needs("pyarrow.parquet", path, key)
    import pyarrow as pa
    try:
        file = pq.ParquetFile(path)
        _check_parquet_sizes(file.metadata, path, key)
        if "prompt" not in file.schema_arrow.names or file.metadata.num_rows == 0:
            return _table_records(file.schema_arrow.empty_table(), path, key)  # raises: no column, no rows
        file = pq.ParquetFile(path, read_dictionary=["prompt"])
        records: list[PromptRecord] = []
        for g in range(file.metadata.num_row_groups):
            records += _table_records(file.read_row_group(g), path, key, first_row=len(records))
        return records
    except (pa.ArrowException, OSError) as e:
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(f"{key}: {path} is not a readable parquet file ({why})") from None


def _dataset_dir(path: Path, key: str) -> None:
    """ValueError unless ``path`` is one ``save_to_disk`` split with rows: a ``DatasetDict`` directory (naming
    its splits), a directory that is no dataset, and a dataset of no shards (which ``load_from_disk`` fails
    on) are refused."""
    if (path / "dataset_dict.json").is_file():
        try:
            splits = json.loads((path / "dataset_dict.json").read_text())["splits"]
        except (ValueError, KeyError, TypeError):
            splits = sorted(p.name for p in path.iterdir() if (p / "state.json").is_file())
        raise ValueError(f"{key}: {path} is a DatasetDict (splits: {', '.join(map(str, splits))}); point {key} "
                         f"at one split's directory, e.g. {path / str(splits[0] if splits else 'train')}")
    if not ((path / "dataset_info.json").is_file() and (path / "state.json").is_file()):
        raise ValueError(f"{key}: {path} is not a file, nor a Hugging Face datasets directory "
                         "(Dataset.save_to_disk: dataset_info.json and state.json)")
    try:
        shards = json.loads((path / "state.json").read_text()).get("_data_files")
    except (ValueError, AttributeError):
        shards = None  # load_from_disk says what is wrong
    if shards == []:
        raise ValueError(f"{key}: {path} has no prompts (an empty table)")


def read_dataset_prompts(path: str | Path, key: str = "data.prompts") -> list[PromptRecord]:
    """The rows of a Hugging Face ``datasets`` directory written by ``Dataset.save_to_disk`` (``_dataset_dir``,
    ``_table_records``); ValueError naming the config ``key`` and the directory for what either refuses."""
    path = Path(path)
    _dataset_dir(path, key)
    datasets = _needs("datasets", path, key)
    try:
        dataset = datasets.load_from_disk(str(path))
    except Exception as e:  # noqa: BLE001 - a damaged directory: one line, whatever datasets raised
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(f"{key}: {path} is not a readable datasets directory ({why})") from None
    return _table_records(dataset.with_format("arrow")[:], path, key)


def prompt_pool(source: str, *, seed: int, categories: Sequence[str] = (),
                key: str = "data.prompts") -> list[str] | list[PromptRecord]:
    """The prompts of ``source`` (``data.prompts``): ``"shapes"`` = ShapeEval training prompts of ``categories``
    (all when empty) drawn with ``seed``; a ``.jsonl`` / ``.parquet`` file or a ``datasets`` directory = its
    records (``read_jsonl_prompts`` / ``read_parquet_prompts`` / ``read_dataset_prompts``); else a text file with
    one prompt per line. ValueError naming the config ``key`` and a missing, empty or malformed source."""
    if source == SHAPES:
        from megaflow.data.shapes import CATEGORIES, sample_prompts
        return sample_prompts("train", SHAPES_POOL, seed=seed, categories=tuple(categories) or CATEGORIES)
    path = Path(source)
    if path.is_dir():
        pool = read_dataset_prompts(path, key)
    elif not path.is_file():
        raise ValueError(f"{key}: no such prompt file {path}")
    elif path.suffix == ".parquet":
        pool = read_parquet_prompts(path, key)
    elif path.suffix == ".jsonl":
        pool = read_jsonl_prompts(path, key)
    else:
        pool = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if not pool:
        raise ValueError(f"{key}: {path} has no prompts")
    return pool


def is_table_source(path: str | Path) -> bool:
    """A prompt source read as a table, not as text: a ``.parquet`` file or a directory (``datasets``)."""
    return Path(path).suffix == ".parquet" or Path(path).is_dir()


class PromptStream:
    """Endless, seeded prompt stream (reshuffled each pass) that counts what it handed out, so a resumed run
    continues at the same prompt: ``PromptStream(pool, seed, consumed=k)`` starts where one that handed
    out k prompts stopped."""

    def __init__(self, pool: list[str] | list[PromptRecord], seed: int, consumed: int = 0):
        self._pool, self._rng, self.consumed = pool, random.Random(seed), 0
        self._order: Iterator[str | PromptRecord] = iter(())
        for _ in range(consumed):
            next(self)

    def __iter__(self):
        return self

    def __next__(self) -> str | PromptRecord:
        try:
            prompt = next(self._order)
        except StopIteration:
            self._order = iter(self._rng.sample(self._pool, len(self._pool)))
            prompt = next(self._order)
        self.consumed += 1
        return prompt
