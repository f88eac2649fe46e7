"""The data protocol, the sources, the folder and its errors (`c2kd prepare`)."""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from typer.testing import CliRunner

from c2kd.cli import app
from c2kd.errors import C2KDError, DataError
from c2kd.data import prepare as prepare_module
from c2kd.data.examples import SPLITS, content_fingerprint, load_examples, target_indices
from c2kd.data.prepare import prepare
from c2kd.data.sources import clean_title, read_source

FILES = ["items.parquet", "train.parquet", "validation.parquet", "test.parquet", "manifest.json"]


# --------------------------------------------------------------------------- an independent oracle


def _order(raw_ids) -> list[str]:
    raw_ids = set(raw_ids)
    if all(r.lstrip("-").isdigit() for r in raw_ids):
        return sorted(raw_ids, key=lambda r: (int(r), r))
    return sorted(raw_ids)


def oracle(source, items=None, max_train_per_user=None) -> dict:
    """The protocol re-derived with plain Python loops from the raw events."""
    events = read_source(source, items).events
    item_id = {raw: i + 1 for i, raw in enumerate(_order(events["item"].to_list()))}
    per_user: dict[str, list[tuple]] = {}
    for user, item, stamp in events.iter_rows():
        per_user.setdefault(user, []).append((stamp, item_id[item]))
    sequences = {}
    for user, pairs in per_user.items():
        seen, seq = set(), []
        for _, item in sorted(pairs):
            if item not in seen:
                seen.add(item)
                seq.append(item)
        if len(seq) >= 5:
            sequences[user] = seq
    users = _order(sequences)
    expected = {"test": [], "validation": [], "train": []}
    for u, raw in enumerate(users):
        s = sequences[raw]
        n = len(s)
        expected["test"].append((u, s[max(0, n - 11) : n - 1], s[n - 1]))
        expected["validation"].append((u, s[max(0, n - 12) : n - 2], s[n - 2]))
        train_t = list(range(3, n - 2))
        if max_train_per_user is not None:
            train_t = train_t[len(train_t) - max_train_per_user :] if max_train_per_user else []
        expected["train"] += [(u, s[max(0, t - 10) : t], s[t]) for t in train_t]
    return {
        "expected": expected,
        "sequences": [sequences[r] for r in users],
        "num_items": len(item_id),
        "dropped": len(per_user) - len(users),
    }


def check_protocol(folder: Path, truth: dict) -> None:
    data = load_examples(folder, verify=True)
    assert data.num_items == truth["num_items"]
    assert data.manifest["stats"]["dropped_users"] == truth["dropped"]
    next_id = 0
    for split in ("test", "validation", "train"):
        frame = data.split(split)
        rows = list(zip(frame["user"].to_list(), frame["history"].to_list(), frame["target"].to_list(), strict=True))
        # Split boundaries, history windows, time order with ties broken by item: all in one.
        assert rows == truth["expected"][split], split
        assert frame["example_id"].to_list() == list(range(next_id, next_id + frame.height))
        next_id += frame.height
        for user, history, target, candidates in zip(
            frame["user"], frame["history"], frame["target"], frame["candidates"], strict=True
        ):
            history, candidates = history.to_list(), candidates.to_list()
            assert 3 <= len(history) <= 10
            assert target not in history
            assert len(candidates) == 20 and len(set(candidates)) == 20
            assert candidates.count(target) == 1
            assert all(1 <= c <= data.num_items for c in candidates)
            interacted = set(truth["sequences"][user])
            assert not (set(candidates) - {target}) & interacted, "a negative the user interacted with"
        idx = target_indices(frame)
        assert (
            np.asarray(frame["candidates"].to_list())[np.arange(frame.height), idx] == frame["target"].to_numpy()
        ).all()


# --------------------------------------------------------------------------- protocol


def test_movielens_100k_statistics_and_titles(ml100k_dir):
    data = load_examples(ml100k_dir, verify=True)
    stats = data.manifest["stats"]
    assert (stats["users"], stats["items"], stats["interactions"], stats["dropped_users"]) == (943, 1682, 100_000, 0)
    assert stats["test"] == stats["validation"] == 943
    assert stats["train"] == 943 * 5  # every ML-100k user has >= 20 ratings, so the cap of 5 binds
    titles = data.titles()
    assert titles[12] == "The Usual Suspects"
    assert titles[1] == "Toy Story"
    assert titles[267] == "item 267"  # MovieLens's placeholder for its one untitled movie
    assert data.items["raw_id"].to_list()[:3] == ["1", "2", "3"]


def test_movielens_100k_protocol(ml100k_dir):
    check_protocol(ml100k_dir, oracle("movielens-100k", max_train_per_user=5))


def test_tiny_protocol(tiny_examples_dir, tiny_source):
    interactions, items = tiny_source
    truth = oracle(interactions, items)
    check_protocol(tiny_examples_dir, truth)
    stats = load_examples(tiny_examples_dir).manifest["stats"]
    assert stats["dropped_users"] == 2 and stats["users"] == 30
    assert stats["duplicates_removed"] == 1
    assert stats["interactions"] == sum(len(s) for s in truth["sequences"])
    # Train windows: all of t = 3..n-3 without a cap.
    assert stats["train"] == sum(len(s) - 5 for s in truth["sequences"])


def test_timestamp_ties_are_broken_by_item(tmp_path):
    # u1's five items share one timestamp: the order must be the item order, not the file order.
    rows = "user,item,timestamp\n" + "".join(f"u1,{i},7\n" for i in (50, 20, 40, 10, 30))
    rows += "".join(f"u{2 + k // 5},{60 + k},{k}\n" for k in range(25))  # more items for the negatives
    (tmp_path / "i.csv").write_text(rows)
    prepare(tmp_path / "i.csv", tmp_path / "out")
    data = load_examples(tmp_path / "out")
    raw = data.items["raw_id"].to_list()
    test = data.split("test").filter(pl.col("user") == 0)
    assert [raw[i - 1] for i in test["history"][0]] == ["10", "20", "30", "40"]
    assert raw[test["target"][0] - 1] == "50"


def test_train_cap_keeps_latest_windows_and_leaves_test_alone(tmp_path, tiny_source, tiny_examples_dir):
    interactions, items = tiny_source
    prepare(interactions, tmp_path / "capped", items=items, max_train_per_user=2)
    check_protocol(tmp_path / "capped", oracle(interactions, items, max_train_per_user=2))
    capped, full = load_examples(tmp_path / "capped"), load_examples(tiny_examples_dir)
    assert capped.split("train").group_by("user").len()["len"].max() == 2
    # Test and validation candidates come from their own generators: the cap does not move them.
    for split in ("test", "validation"):
        assert capped.split(split).equals(full.split(split))


def test_ids_are_ordered_numerically_or_as_text(tmp_path):
    def source(path, user_a, user_b, odd_item):
        rows = [(user_a, i, t) for t, i in enumerate(["9", "10", "100", "2", "30"])]
        rows += [(user_b, i, t) for t, i in enumerate(["30", "2", "100", "10", odd_item])]
        rows += [(f"{user_a}{k // 5}", str(200 + k), k) for k in range(25)]  # fillers: enough negatives
        write(path, "user,item,timestamp\n" + "".join(f"{u},{i},{t}\n" for u, i, t in rows))
        prepare(path, tmp_path / path.stem)
        return load_examples(tmp_path / path.stem)

    numeric = source(tmp_path / "num.csv", "9", "10", "9")  # users 9, 10, 90..94 in number order
    assert numeric.items["raw_id"].to_list()[:5] == ["2", "9", "10", "30", "100"]
    assert numeric.split("test")["target"].to_list()[:2] == [4, 2]  # user "9" ends on "30", user "10" on "9"
    text = source(tmp_path / "txt.csv", "b", "a", "x")  # one non-numeric item id: text order
    assert text.items["raw_id"].to_list()[:3] == ["10", "100", "2"]
    assert text.items["raw_id"][-1] == "x"
    assert text.split("test")["target"][0] == text.num_items  # user "a" ends on "x"


def test_determinism_and_seed(tmp_path, tiny_source, tiny_examples_dir, ml100k_dir):
    interactions, items = tiny_source
    prepare(interactions, tmp_path / "again", items=items)
    for name in FILES:
        assert (tmp_path / "again" / name).read_bytes() == (tiny_examples_dir / name).read_bytes(), name
    prepare("movielens-100k", tmp_path / "ml", max_train_per_user=5)
    for name in FILES:
        assert (tmp_path / "ml" / name).read_bytes() == (ml100k_dir / name).read_bytes(), name

    prepare(interactions, tmp_path / "seed1", items=items, seed=1)
    a, b = load_examples(tiny_examples_dir), load_examples(tmp_path / "seed1")
    assert a.fingerprint != b.fingerprint
    for split in SPLITS:
        assert a.split(split).drop("candidates").equals(b.split(split).drop("candidates"))
        assert a.split(split)["candidates"].to_list() != b.split(split)["candidates"].to_list()


def test_fingerprint_is_content_not_bytes(tmp_path, tiny_source, tiny_examples_dir):
    data = load_examples(tiny_examples_dir)
    assert content_fingerprint(data.items, data.splits) == data.fingerprint
    # The same tables written by another Parquet writer keep the fingerprint ...
    copy = {s: pl.read_parquet(tiny_examples_dir / f"{s}.parquet") for s in SPLITS}
    assert content_fingerprint(pl.read_parquet(tiny_examples_dir / "items.parquet"), copy) == data.fingerprint
    # ... and one changed value changes it; load_examples(verify=True) notices.
    folder = tmp_path / "tampered"
    prepare(tiny_source[0], folder, items=tiny_source[1])
    changed = data.split("test").with_columns(
        pl.when(pl.col("example_id") == 3).then(pl.col("user") + 1).otherwise(pl.col("user")).alias("user")
    )
    assert content_fingerprint(data.items, {**data.splits, "test": changed}) != data.fingerprint
    changed.write_parquet(folder / "test.parquet")
    with pytest.raises(DataError, match="fingerprint"):
        load_examples(folder, verify=True)


def test_titles():
    assert clean_title("Usual Suspects, The (1995)") == "The Usual Suspects"
    assert clean_title("Fish Called Wanda, A (1988)") == "A Fish Called Wanda"
    assert clean_title("American in Paris, An") == "An American in Paris"
    assert clean_title("Paris, Texas (1984)") == "Paris, Texas"
    assert clean_title("Seven (Se7en) (1995)") == "Seven (Se7en)"
    assert clean_title("  Heat   (1995) ") == "Heat"
    assert clean_title("1900 (1976)") == "1900"


def test_generic_items_file_titles(tiny_examples_dir):
    titles = load_examples(tiny_examples_dir).titles()
    assert titles[1] == "Film number 100"  # raw id 100 is internal id 1
    assert titles[3] == "The Movie 102"  # "Movie 102, The (1902)"
    assert titles[51] == "item 150"  # no title given


def test_parquet_and_iso_timestamps_match_csv(tmp_path, tiny_source, tiny_examples_dir):
    interactions, items = tiny_source
    frame = pl.read_csv(interactions)
    frame = frame.with_columns(
        pl.from_epoch("timestamp", time_unit="s").dt.strftime("%Y-%m-%dT%H:%M:%S").alias("timestamp")
    )
    frame.write_parquet(tmp_path / "i.parquet")
    pl.read_csv(items).write_parquet(tmp_path / "items.parquet")
    prepare(tmp_path / "i.parquet", tmp_path / "out", items=tmp_path / "items.parquet")
    assert load_examples(tmp_path / "out").fingerprint == load_examples(tiny_examples_dir).fingerprint


# --------------------------------------------------------------------------- GroupLens sources

U_DATA = [(1, 12, 5, 100), (1, 3, 4, 100), (1, 7, 3, 101), (1, 1, 5, 105), (1, 2, 1, 106), (1, 9, 2, 107)]
U_DATA += [(2, i, 3, 200 + i) for i in (4, 5, 6, 8, 10, 11, 13)]
U_ITEM_TITLES = {
    1: "Toy Story (1995)",
    3: "Four Rooms (1995)",
    5: "Misérables, Les (1995)",
    12: "Usual Suspects, The (1995)",
    13: "unknown",
}


def write_grouplens(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "u.data").write_text("".join(f"{u}\t{i}\t{r}\t{t}\n" for u, i, r, t in U_DATA))
    lines = [f"{i}|{U_ITEM_TITLES.get(i, f'Movie {i} (1990)')}|01-Jan-1995||http://x|0|1|0\n" for i in range(1, 46)]
    (folder / "u.item").write_bytes("".join(lines).encode("latin-1"))
    # Items 14..45 are rated by users 3 and 4 so that every listed item occurs in the data.
    with (folder / "u.data").open("a") as f:
        f.writelines(f"{3 + i % 2}\t{i}\t4\t{300 + i}\n" for i in range(14, 46))


def test_grouplens_folder_and_zip(tmp_path):
    write_grouplens(tmp_path / "ml")
    prepare(tmp_path / "ml", tmp_path / "from_folder")
    data = load_examples(tmp_path / "from_folder")
    assert data.manifest["stats"]["users"] == 4 and data.num_items == 45
    titles = data.titles()
    assert (titles[12], titles[5], titles[1], titles[13]) == (
        "The Usual Suspects",
        "Misérables, Les",
        "Toy Story",
        "item 13",
    )
    # user 1 (internal 0): (timestamp, item) order is 3, 12, 7, 1, 2, 9
    test = data.split("test").row(0, named=True)
    assert test["history"] == [3, 12, 7, 1, 2] and test["target"] == 9
    check_protocol(tmp_path / "from_folder", oracle(tmp_path / "ml"))

    archive = tmp_path / "ml-100k.zip"
    with zipfile.ZipFile(archive, "w") as z:
        for name in ("u.data", "u.item"):
            z.write(tmp_path / "ml" / name, f"ml-100k/{name}")
    before = set(Path.cwd().iterdir())
    prepare(archive, tmp_path / "from_zip")
    assert set(Path.cwd().iterdir()) == before  # nothing extracted
    assert load_examples(tmp_path / "from_zip").fingerprint == data.fingerprint


# --------------------------------------------------------------------------- bad input


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(".") or p.name == "out")


def write(path: Path, text: str | bytes) -> Path:
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return path


GOOD = "user,item,timestamp\n" + "".join(f"u{u},{i},{i}\n" for u in range(2) for i in range(1, 26))


@pytest.mark.parametrize(
    "interactions, items, expected",
    [
        ("user,item\nu1,1\n", None, r"i\.csv: missing column 'timestamp'; found 'user', 'item'"),
        ("user,item,timestamp\n", None, r"i\.csv: no interactions"),
        ("", None, r"i\.csv: file is empty"),
        (
            "user,item,timestamp\nu1,1,5\nu1,2,6\nu1,3,yesterday\n",
            None,
            r"i\.csv: row 3 \(line 4\), field 'timestamp': 'yesterday' is not a timestamp",
        ),
        (
            "user,item,timestamp\nu1,1,2024-01-01T00:00:00\nu1,2,soon\n",
            None,
            r"i\.csv: row 2 \(line 3\), field 'timestamp': 'soon'",
        ),
        ("user,item,timestamp\nu1,1,5\nu1,2,6,7\n", None, r"i\.csv: line 3: 4 fields, expected 3 like line 1"),
        ("user,item,timestamp\nu1,1,5\nu1,,6\n", None, r"i\.csv: row 2 \(line 3\), field 'item': empty id"),
        ("user,item,timestamp\nu1,1,5\nu1,2,\n", None, r"i\.csv: row 2 \(line 3\), field 'timestamp': empty timestamp"),
        (
            "user,item,timestamp\n" + "".join(f"u{u},{i},1\n" for u in range(5) for i in range(4)),
            None,
            r"i\.csv: no user has at least 5 distinct interactions",
        ),
        (
            GOOD,
            "item,title\n1,A\n2,B\n99,Ghost\n",
            r"t\.csv: row 3 \(line 4\), field 'item': item '99' does not occur in the interactions",
        ),
        (
            GOOD,
            "item,title\n1,A\n2,B\n1,C\n",
            r"t\.csv: row 3 \(line 4\), field 'item': item '1' is listed twice \(first at row 1\)",
        ),
        (GOOD, "item,name\n1,A\n", r"t\.csv: missing column 'title'"),
        (GOOD, b"item,title\n1,Caf\xe9\n", r"t\.csv: line 2, byte offset 16: byte 0xe9 is not valid UTF-8"),
        (
            "user,item,timestamp\n" + "".join(f"u1,{i},{i}\n" for i in range(10)),
            None,
            r"user 'u1' interacted with 10 of the 10 items",
        ),
    ],
)
def test_bad_generic_input(tmp_path, interactions, items, expected):
    source = write(tmp_path / "i.csv", interactions)
    items_path = write(tmp_path / "t.csv", items) if items is not None else None
    with pytest.raises(DataError, match=expected):
        prepare(source, tmp_path / "out", items=items_path)
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize(
    "u_data, expected",
    [
        ("1\t2\t3\t100\n1\tx7\t3\t101\n", r"u\.data: row 2 \(line 2\), field 'item': 'x7' is not an integer id"),
        ("1\t2\t3\t100\n1\t3\t3\tnoon\n", r"u\.data: row 2 \(line 2\), field 'timestamp': 'noon' is not a timestamp"),
        ("1\t2\t3\n", r"u\.data: 3 tab-separated fields per line, expected 4"),
    ],
)
def test_bad_grouplens_input(tmp_path, u_data, expected):
    folder = tmp_path / "ml"
    folder.mkdir()
    write(folder / "u.data", u_data)
    with pytest.raises(DataError, match=expected):
        prepare(folder, tmp_path / "out")
    assert leftovers(tmp_path) == []


def test_grouplens_titles_must_be_rated(tmp_path):
    write_grouplens(tmp_path / "ml")
    with (tmp_path / "ml" / "u.item").open("ab") as f:
        f.write(b"46|Nobody Rated Me (1990)|||x|0\n")
    with pytest.raises(DataError, match=r"u\.item: row 46 \(line 46\), field 'item': item '46' does not occur"):
        prepare(tmp_path / "ml", tmp_path / "out")


def test_output_folder_rules(tmp_path, tiny_source, monkeypatch):
    interactions, items = tiny_source
    out = tmp_path / "out"
    prepare(interactions, out, items=items)
    first = (out / "manifest.json").read_text()
    with pytest.raises(C2KDError, match="already exists; pass --overwrite"):
        prepare(interactions, out, items=items, seed=3)
    prepare(interactions, out, items=items, seed=3, overwrite=True)
    assert (
        json.loads((out / "manifest.json").read_text())["parameters"]["seed"]
        == 3
        != json.loads(first)["parameters"]["seed"]
    )
    assert leftovers(tmp_path) == ["out"]

    other = tmp_path / "precious"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(C2KDError, match="not a prepared data folder"):
        prepare(interactions, other, items=items, overwrite=True)
    assert (other / "notes.txt").read_text() == "keep me"

    (tmp_path / "empty").mkdir()
    prepare(interactions, tmp_path / "empty", items=items)  # an empty folder is fine
    assert load_examples(tmp_path / "empty").num_items == 60

    # A failure half-way leaves no folder that looks whole, and the old one stays intact.
    calls = []

    def failing_write(table, path):
        calls.append(path)
        if len(calls) == 3:
            raise OSError("disk full")
        return real_write(table, path)

    real_write = prepare_module._write_parquet
    monkeypatch.setattr(prepare_module, "_write_parquet", failing_write)
    with pytest.raises(OSError, match="disk full"):
        prepare(interactions, tmp_path / "new", items=items)
    with pytest.raises(OSError, match="disk full"):
        calls.clear()
        prepare(interactions, out, items=items, overwrite=True)
    assert not (tmp_path / "new").exists()
    assert json.loads((out / "manifest.json").read_text())["parameters"]["seed"] == 3
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_items_option_only_for_generic_files(tmp_path):
    with pytest.raises(DataError, match="--items applies to a generic"):
        prepare("movielens-100k", tmp_path / "out", items=tmp_path / "t.csv")


# --------------------------------------------------------------------------- command line


def test_cli_prints_statistics(tmp_path, tiny_source):
    interactions, items = tiny_source
    result = CliRunner().invoke(
        app,
        [
            "prepare",
            str(interactions),
            "--out",
            str(tmp_path / "out"),
            "--items",
            str(items),
            "--max-train-per-user",
            "3",
        ],
    )
    assert result.exit_code == 0, result.output
    stats = load_examples(tmp_path / "out").manifest
    assert f"fingerprint {stats['fingerprint']}" in result.output
    for label, value in [
        ("users", 30),
        ("items", 60),
        ("train examples", stats["stats"]["train"]),
        ("test examples", 30),
    ]:
        assert any(label in line and f" {value} " in line for line in result.output.splitlines()), label


def test_cli_reports_bad_input_in_one_line(tmp_path):
    source = write(tmp_path / "i.csv", "user,item\nu1,1\n")
    result = CliRunner().invoke(app, ["prepare", str(source), "--out", str(tmp_path / "out")])
    assert result.exit_code == 1
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "missing column 'timestamp'" in lines[0]
    assert "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


def _movielens_copies(folder: Path) -> dict[str, tuple]:
    """MovieLens-100k written the ways users hold it, from the recbole wheel's atomic files:
    a GroupLens folder (u.data, Latin-1 u.item with "Title (year)" and the "(1995) (V)" quirk of
    item 1412), its zip, a CSV and a Parquet table with an items file, and the RecBole folder."""
    from c2kd.data.sources import movielens_100k_dir

    recbole = movielens_100k_dir()
    inter = pl.read_csv(recbole / "ml-100k.inter", separator="\t", new_columns=["user", "item", "rating", "timestamp"])
    items = pl.read_csv(recbole / "ml-100k.item", separator="\t", quote_char=None,
                        new_columns=["item", "title", "year", "genres"], schema_overrides={"year": pl.String})
    titles = []
    for title, year in zip(items["title"].to_list(), items["year"].to_list()):
        if year == "V":  # RecBole split "... (1995) (V)" into title "... (1995)" and year "V"
            titles.append(f"{title} (V)")
        elif year is None or not year.isdigit():
            titles.append("unknown")  # GroupLens's placeholder for the untitled movie
        else:
            titles.append(f"{title} ({year})")
    gl = folder / "grouplens"
    gl.mkdir(parents=True)
    (gl / "u.data").write_text("".join(f"{u}\t{i}\t{int(r)}\t{int(t)}\n" for u, i, r, t in inter.iter_rows()))
    (gl / "u.item").write_bytes("".join(f"{i}|{t}|01-Jan-1995||http://x|0|0\n"
                                        for i, t in zip(items["item"].to_list(), titles)).encode("latin-1"))
    archive = folder / "ml-100k.zip"
    with zipfile.ZipFile(archive, "w") as z:
        for name in ("u.data", "u.item"):
            z.write(gl / name, f"ml-100k/{name}")
    events = inter.select("user", "item", pl.col("timestamp").cast(pl.Int64))
    item_titles = pl.DataFrame({"item": items["item"], "title": titles})
    events.write_csv(folder / "interactions.csv")
    item_titles.write_csv(folder / "items.csv")
    events.write_parquet(folder / "interactions.parquet")
    item_titles.write_parquet(folder / "items.parquet")
    shutil.copytree(recbole, folder / "recbole-folder")
    return {
        "movielens-100k": ("movielens-100k", None),
        "GroupLens folder": (gl, None),
        "GroupLens zip": (archive, None),
        "CSV": (folder / "interactions.csv", folder / "items.csv"),
        "Parquet": (folder / "interactions.parquet", folder / "items.parquet"),
        "RecBole folder": (folder / "recbole-folder", None),
    }


@pytest.mark.slow
def test_every_copy_of_movielens_gives_one_fingerprint(tmp_path):
    fingerprints = {}
    for name, (source, items) in _movielens_copies(tmp_path / "src").items():
        manifest = prepare(source, tmp_path / name.replace(" ", "-"), max_train_per_user=5, items=items)
        fingerprints[name] = manifest["fingerprint"]
    titles = load_examples(tmp_path / "GroupLens-folder").titles()
    assert titles[1412] == "Land Before Time III: The Time of the Great Giving" and titles[267] == "item 267"
    assert len(set(fingerprints.values())) == 1, fingerprints
