"""Reading interaction sources into one raw form: (user, item, timestamp) events + item titles.

Supported sources (see `read_source`):

- ``movielens-100k``: the MovieLens-100k atomic files shipped in the ``recbole`` wheel
  (``ml-100k.inter`` + ``ml-100k.item``), found offline without importing recbole.
- a GroupLens folder holding ``u.data`` (+ ``u.item``), or the GroupLens ``ml-100k.zip``
  (members are read from the archive; nothing is extracted).
- a RecBole atomic folder (one ``*.inter`` file, optionally one ``*.item`` file).
- a generic interactions table, CSV or Parquet, with columns ``user``, ``item``, ``timestamp``
  (other columns are ignored), plus an optional items table with columns ``item``, ``title``.

Every problem is raised as `DataError` naming the file, the row (1-based data row; for text
files also the line) and the field. Ratings are ignored: every event counts as an interaction.
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl

from c2kd.errors import DataError

MOVIELENS_100K = "movielens-100k"

# MovieLens marks its one untitled movie (id 267) with a placeholder, misspelt in RecBole's copy;
# a title that is just this placeholder means "no title", whatever the source.
_PLACEHOLDER_TITLES = {"unknown", "unkonwn"}

# A trailing year, e.g. "(1995)" or "(1994/I)", and GroupLens's video marker after it: "(1995) (V)".
# RecBole's copy moved the "V" into its year column, so both copies clean to the same title.
_YEAR = re.compile(r"\s*\(\d{4}(?:/[IVX]+)?\)(?:\s*\(V\))?$")
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_TRAILING_ARTICLE = re.compile(r"^(?P<rest>.+?),\s*(?P<article>The|A|An)$")


def clean_title(raw: str) -> str:
    """Title as shown to the models: whitespace collapsed, trailing "(1995)" (and a "(V)" after
    it) dropped, trailing ", The" / ", A" / ", An" moved to the front (LLaRA's MovieLens convention).

    >>> clean_title("Usual Suspects, The (1995)")
    'The Usual Suspects'
    """
    title = " ".join(raw.split())
    title = _YEAR.sub("", title)
    match = _TRAILING_ARTICLE.match(title)
    if match:
        title = f"{match['article']} {match['rest']}"
    return title


@dataclass(frozen=True)
class Interactions:
    """A source read into raw form, before the protocol is applied.

    `events` has columns user:str, item:str (raw ids) and timestamp (Int64 or Float64, only
    its order matters), in file order. `titles` has columns item:str, title:str (cleaned) for
    the items that have a title. `name` is the interactions file, for messages about the data
    as a whole; `description` goes into the manifest.
    """

    events: pl.DataFrame
    titles: pl.DataFrame
    name: str
    description: dict = field(default_factory=dict)


@dataclass(frozen=True)
class _Table:
    """Where rows of a table came from, so that messages can point at them."""

    name: str
    header_lines: int | None  # lines before data row 1; None for Parquet (no lines)

    def at(self, row: int, column: str) -> str:
        """Location of 0-based data row `row`, field `column`."""
        where = f"{self.name}: row {row + 1}"
        if self.header_lines is not None:
            where += f" (line {row + 1 + self.header_lines})"
        return f"{where}, field {column!r}"


# --------------------------------------------------------------------------- entry point


def read_source(source: str | Path, items: str | Path | None = None) -> Interactions:
    """Read `source` (``movielens-100k`` or a path; see the module docstring)."""
    if str(source) == MOVIELENS_100K:
        _no_items_file(items, MOVIELENS_100K)
        return read_movielens_100k()
    path = Path(source)
    if not path.exists():
        raise DataError(
            f"{path}: no such file or folder "
            f"(expected {MOVIELENS_100K!r}, a GroupLens folder or zip, or a CSV/Parquet file)"
        )
    if path.is_dir():
        _no_items_file(items, str(path))
        if (path / "u.data").is_file():
            return read_grouplens_folder(path)
        inter = sorted(path.glob("*.inter"))
        if len(inter) == 1:
            item = sorted(path.glob("*.item"))
            return read_atomic(inter[0], item[0] if len(item) == 1 else None)
        raise DataError(f"{path}: folder has neither u.data (GroupLens) nor exactly one *.inter file (RecBole atomic)")
    if path.suffix.lower() == ".zip":
        _no_items_file(items, str(path))
        return read_grouplens_zip(path)
    return read_interactions_file(path, items)


def _no_items_file(items: str | Path | None, source: str) -> None:
    if items is not None:
        raise DataError(
            f"--items applies to a generic CSV/Parquet interactions file, not to {source} (it has its own titles)"
        )


# --------------------------------------------------------------------------- MovieLens sources


def movielens_100k_dir() -> Path:
    """The ml-100k folder inside the installed recbole wheel (found without importing recbole)."""
    spec = importlib.util.find_spec("recbole")
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            "movielens-100k: the recbole package is not installed; install it with "
            "`pip install recbole==1.2.1 --no-deps`, or pass a GroupLens ml-100k folder/zip"
        )
    folder = Path(next(iter(spec.submodule_search_locations))) / "dataset_example" / "ml-100k"
    if not (folder / "ml-100k.inter").is_file():
        raise DataError(f"{folder}: ml-100k.inter not found in the installed recbole package")
    return folder


def read_movielens_100k() -> Interactions:
    """MovieLens-100k from recbole's atomic files."""
    folder = movielens_100k_dir()
    data = read_atomic(folder / "ml-100k.inter", folder / "ml-100k.item")
    return Interactions(data.events, data.titles, data.name, {**data.description, "kind": MOVIELENS_100K})


def read_atomic(inter_path: Path, item_path: Path | None) -> Interactions:
    """RecBole atomic files: tab separated, typed headers such as ``user_id:token``."""
    table = _Table(str(inter_path), header_lines=1)
    frame = _strip_header_types(_read_text_table(inter_path.read_bytes(), table, separator="\t"))
    _require_columns(frame, table, ["user_id", "item_id", "timestamp"])
    events = _events(frame, table, user="user_id", item="item_id", timestamp="timestamp", integer_ids=False)
    files = [inter_path]
    titles = _empty_titles()
    if item_path is not None:
        item_table = _Table(str(item_path), header_lines=1)
        items = _strip_header_types(_read_text_table(item_path.read_bytes(), item_table, separator="\t"))
        title_column = next((c for c in items.columns if "title" in c), None)
        _require_columns(items, item_table, ["item_id"] + ([] if title_column else ["title"]))
        titles = _titles(items, item_table, events, item="item_id", title=title_column, integer_ids=False)
        files.append(item_path)
    return Interactions(events, titles, str(inter_path), {"kind": "recbole-atomic", "files": _describe_files(files)})


def read_grouplens_folder(folder: Path) -> Interactions:
    """A GroupLens MovieLens folder: ``u.data`` and, if present, ``u.item``."""
    item = folder / "u.item"
    return _read_grouplens(
        folder / "u.data",
        (folder / "u.data").read_bytes(),
        (item, item.read_bytes()) if item.is_file() else None,
        {
            "kind": "grouplens-folder",
            "files": _describe_files([folder / "u.data"] + ([item] if item.is_file() else [])),
        },
    )


def read_grouplens_zip(zip_path: Path) -> Interactions:
    """The GroupLens ``ml-100k.zip``: ``u.data``/``u.item`` read straight from the archive."""
    try:
        with zipfile.ZipFile(zip_path) as archive:
            members = {Path(name).name: name for name in archive.namelist() if not name.endswith("/")}
            if "u.data" not in members:
                raise DataError(f"{zip_path}: archive has no u.data member (expected the GroupLens ml-100k.zip)")
            data = archive.read(members["u.data"])
            item = (members["u.item"], archive.read(members["u.item"])) if "u.item" in members else None
    except zipfile.BadZipFile as error:
        raise DataError(f"{zip_path}: not a readable zip archive ({error})") from None
    description = {"kind": "grouplens-zip", "files": _describe_files([zip_path])}
    return _read_grouplens(
        f"{zip_path}:{members['u.data']}",
        data,
        (f"{zip_path}:{item[0]}", item[1]) if item else None,
        description,
    )


def _read_grouplens(
    data_name: str | Path, data: bytes, item: tuple[str | Path, bytes] | None, description: dict
) -> Interactions:
    # u.data: user \t item \t rating \t timestamp, no header, integer ids.
    table = _Table(str(data_name), header_lines=0)
    frame = _read_text_table(data, table, separator="\t", has_header=False)
    if frame.width < 4:
        raise DataError(
            f"{table.name}: {frame.width} tab-separated fields per line, expected 4 (user, item, rating, timestamp)"
        )
    frame = frame.select(
        pl.col(frame.columns[0]).alias("user"),
        pl.col(frame.columns[1]).alias("item"),
        pl.col(frame.columns[3]).alias("timestamp"),
    )
    events = _events(frame, table, user="user", item="item", timestamp="timestamp", integer_ids=True)
    titles = _empty_titles()
    if item is not None:
        # u.item: id | title (year) | release date | ... , Latin-1, no header, no quoting.
        item_table = _Table(str(item[0]), header_lines=0)
        text = item[1].decode("latin-1").encode("utf-8")
        items = _read_text_table(text, item_table, separator="|", has_header=False)
        if items.width < 2:
            raise DataError(
                f"{item_table.name}: {items.width} '|'-separated field(s) per line, expected movie id | title | ..."
            )
        items = items.select(pl.col(items.columns[0]).alias("item"), pl.col(items.columns[1]).alias("title"))
        titles = _titles(items, item_table, events, item="item", title="title", integer_ids=True)
    return Interactions(events, titles, table.name, description)


# --------------------------------------------------------------------------- generic tables


def read_interactions_file(path: Path, items: str | Path | None = None) -> Interactions:
    """A CSV or Parquet file with columns user, item, timestamp; titles from `items` (item, title)."""
    frame, table = _read_any_table(path)
    _require_columns(frame, table, ["user", "item", "timestamp"])
    events = _events(frame, table, user="user", item="item", timestamp="timestamp", integer_ids=False)
    files = [path]
    titles = _empty_titles()
    if items is not None:
        items_path = Path(items)
        if not items_path.is_file():
            raise DataError(f"{items_path}: items file not found")
        item_frame, item_table = _read_any_table(items_path)
        _require_columns(item_frame, item_table, ["item", "title"])
        titles = _titles(item_frame, item_table, events, item="item", title="title", integer_ids=False)
        files.append(items_path)
    return Interactions(events, titles, str(path), {"kind": "interactions-file", "files": _describe_files(files)})


def _read_any_table(path: Path) -> tuple[pl.DataFrame, _Table]:
    if path.suffix.lower() == ".parquet":
        table = _Table(str(path), header_lines=None)
        try:
            return pl.read_parquet(path), table
        except (pl.exceptions.PolarsError, OSError) as error:
            raise DataError(f"{path}: cannot be read as Parquet ({_first_line(error)})") from None
    if path.suffix.lower() not in {".csv", ".tsv", ".txt"}:
        raise DataError(f"{path}: unsupported file type {path.suffix!r}; expected .csv, .tsv or .parquet")
    table = _Table(str(path), header_lines=1)
    separator = "\t" if path.suffix.lower() == ".tsv" else ","
    return _read_text_table(path.read_bytes(), table, separator=separator, quote_char='"', utf8=True), table


# --------------------------------------------------------------------------- parsing helpers


def _read_text_table(
    data: bytes,
    table: _Table,
    *,
    separator: str,
    has_header: bool = True,
    quote_char: str | None = None,
    utf8: bool = False,
) -> pl.DataFrame:
    """Every column as text, so that parsing (and its error messages) stays ours."""
    if utf8:
        _check_utf8(data, table.name)
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    if not data.strip():
        raise DataError(f"{table.name}: file is empty")
    try:
        return pl.read_csv(
            data,
            separator=separator,
            has_header=has_header,
            quote_char=quote_char,
            infer_schema=False,
            raise_if_empty=False,
        )
    except pl.exceptions.PolarsError as error:
        kind = "tab" if separator == "\t" else repr(separator)
        problem = _ragged_line(data, separator) or f"cannot be read as a {kind}-separated table"
        raise DataError(f"{table.name}: {problem} ({_first_line(error)})") from None


def _ragged_line(data: bytes, separator: str) -> str | None:
    """Point at the first line whose field count differs from the first line's (quote-free lines only)."""
    lines = data.decode("utf-8", errors="replace").splitlines()
    expected = lines[0].count(separator) + 1
    for number, line in enumerate(lines[1:], start=2):
        if line and '"' not in line and line.count(separator) + 1 != expected:
            return f"line {number}: {line.count(separator) + 1} fields, expected {expected} like line 1"
    return None


def _check_utf8(data: bytes, name: str) -> None:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise DataError(
            f"{name}: line {line}, byte offset {error.start}: byte 0x{data[error.start]:02x} is not valid UTF-8; "
            "save the file as UTF-8"
        ) from None


def _strip_header_types(frame: pl.DataFrame) -> pl.DataFrame:
    """``user_id:token`` → ``user_id`` (RecBole's typed headers)."""
    return frame.rename({c: c.split(":", 1)[0] for c in frame.columns})


def _require_columns(frame: pl.DataFrame, table: _Table, required: list[str]) -> None:
    missing = [c for c in required if c not in frame.columns]
    if missing:
        raise DataError(
            f"{table.name}: missing column{'s' if len(missing) > 1 else ''} {', '.join(repr(c) for c in missing)}; "
            f"found {', '.join(repr(c) for c in frame.columns) or 'none'}"
        )


def _first_bad(mask: pl.Series) -> int | None:
    hits = mask.arg_true()
    return int(hits[0]) if len(hits) else None


def _ids(column: pl.Series, table: _Table, field_name: str, integer: bool) -> pl.Series:
    """Raw ids as stripped text; with `integer`, every id must be a whole number."""
    if column.dtype.is_float():
        whole = column.is_not_null() & (column == column.floor())
        bad = _first_bad(column.is_not_null() & ~whole)
        if bad is not None:
            raise DataError(f"{table.at(bad, field_name)}: id {column[bad]!r} is not a whole number")
        column = column.cast(pl.Int64)
    text = column.cast(pl.String).str.strip_chars()
    bad = _first_bad(text.is_null() | (text == ""))
    if bad is not None:
        raise DataError(f"{table.at(bad, field_name)}: empty id")
    if integer:
        number = text.cast(pl.Int64, strict=False)
        bad = _first_bad(number.is_null())
        if bad is not None:
            raise DataError(f"{table.at(bad, field_name)}: {text[bad]!r} is not an integer id")
        text = number.cast(pl.String)  # "007" and "7" are the same item
    return text.alias(field_name)


def _timestamps(column: pl.Series, table: _Table, field_name: str) -> pl.Series:
    """A sortable timestamp: integers (e.g. Unix seconds), decimals, or ISO 8601 date-times."""
    bad = _first_bad(column.is_null())
    if bad is not None:
        raise DataError(f"{table.at(bad, field_name)}: empty timestamp")
    if column.dtype.is_integer():
        return column.cast(pl.Int64)
    if column.dtype.is_float():
        bad = _first_bad(~column.is_finite())
        if bad is not None:
            raise DataError(f"{table.at(bad, field_name)}: timestamp {column[bad]} is not finite")
        return column.cast(pl.Int64) if (column == column.floor()).all() else column.cast(pl.Float64)
    if column.dtype in (pl.Date, pl.Datetime) or isinstance(column.dtype, pl.Datetime):
        return column.dt.epoch("us")
    if column.dtype != pl.String:
        raise DataError(f"{table.name}: field {field_name!r} has type {column.dtype}, expected numbers or date-times")
    text = column.str.strip_chars()
    as_int = text.cast(pl.Int64, strict=False)
    if as_int.is_not_null().all():
        return as_int
    as_float = text.cast(pl.Float64, strict=False)
    if as_float.is_not_null()[0]:  # numeric column: every value must be a number
        bad = _first_bad(as_float.is_null() | ~as_float.is_finite())
        if bad is not None:
            raise DataError(
                f"{table.at(bad, field_name)}: {text[bad]!r} is not a timestamp (expected a number like the rows above)"
            )
        return as_float
    try:
        as_time = text.str.to_datetime(strict=False)
    except pl.exceptions.ComputeError:  # polars infers the format from the first value: that one is no date-time
        as_time = pl.Series([None] * len(text), dtype=pl.Datetime)
    bad = _first_bad(as_time.is_null())
    if bad is not None:
        raise DataError(
            f"{table.at(bad, field_name)}: {text[bad]!r} is not a timestamp "
            "(expected integer/decimal seconds or an ISO 8601 date-time in one format throughout)"
        )
    return as_time.dt.epoch("us")


def _events(
    frame: pl.DataFrame, table: _Table, *, user: str, item: str, timestamp: str, integer_ids: bool
) -> pl.DataFrame:
    if frame.height == 0:
        raise DataError(f"{table.name}: no interactions (the table has a header but no rows)")
    return pl.DataFrame(
        [
            _ids(frame[user], table, user, integer_ids).alias("user"),
            _ids(frame[item], table, item, integer_ids).alias("item"),
            _timestamps(frame[timestamp], table, timestamp).alias("timestamp"),
        ]
    )


def _empty_titles() -> pl.DataFrame:
    return pl.DataFrame(schema={"item": pl.String, "title": pl.String})


def _titles(
    frame: pl.DataFrame,
    table: _Table,
    events: pl.DataFrame,
    *,
    item: str,
    title: str | None,
    integer_ids: bool,
) -> pl.DataFrame:
    """Cleaned titles; every listed item must occur in the interactions, and only once; no control
    characters (a NUL or an escape in a title would reach the prompts)."""
    ids = _ids(frame[item], table, item, integer_ids)
    bad = _first_bad(~ids.is_in(events["item"].unique().implode()))
    if bad is not None:
        raise DataError(f"{table.at(bad, item)}: item {ids[bad]!r} does not occur in the interactions")
    bad = _first_bad(~ids.is_first_distinct())
    if bad is not None:
        first = _first_bad(ids == ids[bad])
        raise DataError(f"{table.at(bad, item)}: item {ids[bad]!r} is listed twice (first at row {first + 1})")
    raw_titles = frame[title].cast(pl.String) if title else pl.Series([None] * frame.height, dtype=pl.String)
    bad = _first_bad(raw_titles.fill_null("").str.contains(_CONTROL.pattern))
    if bad is not None:
        raise DataError(f"{table.at(bad, title)}: title {raw_titles[bad]!r} contains a control character")
    cleaned = [
        clean_title(t) if t is not None and t.strip().lower() not in _PLACEHOLDER_TITLES else ""
        for t in raw_titles.to_list()
    ]
    return pl.DataFrame({"item": ids, "title": cleaned}).filter(pl.col("title") != "")


def _describe_files(paths: list[Path]) -> list[dict]:
    return [{"path": str(Path(p).resolve()), "sha256": hashlib.sha256(Path(p).read_bytes()).hexdigest()} for p in paths]


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
