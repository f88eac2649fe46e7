"""Shared fixtures: prepared example folders that many test files read (never write to them)."""

from __future__ import annotations

import os

# The models under test are tiny: one thread each is faster than two fighting over two cores,
# and subprocesses (torchrun tests) inherit the setting.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import polars as pl  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from c2kd.data.prepare import prepare  # noqa: E402

torch.set_num_threads(1)

TINY_USERS = 32  # two of them are too short and get dropped: 30 users remain
TINY_ITEMS = 60


def write_tiny_source(folder: Path) -> tuple[Path, Path]:
    """A small synthetic generic source: interactions.csv (user,item,timestamp) + items.csv (item,title).

    Users "u00".."u31" with 8..20 interactions each (u05 has 3, u17 has 4: dropped), items with
    raw ids 100..159, timestamps drawn from a narrow range so ties are frequent, one repeated
    (user, item) pair, and titles for all items but 150..159.
    """
    rng = np.random.default_rng(7)
    rows = []
    for u in range(TINY_USERS):
        n = {5: 3, 17: 4}.get(u, int(rng.integers(8, 21)))
        items = rng.choice(np.arange(100, 100 + TINY_ITEMS), size=n, replace=False)
        stamps = np.sort(rng.integers(1_000, 1_030, size=n))
        rows += [(f"u{u:02d}", int(i), int(t)) for i, t in zip(items, stamps, strict=True)]
    user, item, _ = rows[0]
    rows.append((user, item, 2_000))  # a repeat of an earlier interaction: only the first one counts
    folder.mkdir(parents=True, exist_ok=True)
    interactions = folder / "interactions.csv"
    pl.DataFrame(rows, schema=["user", "item", "timestamp"], orient="row").write_csv(interactions)
    items_path = folder / "items.csv"
    titles = [(i, f"Movie {i}, The (19{i % 100:02d})" if i % 3 == 0 else f"Film number {i}") for i in range(100, 150)]
    pl.DataFrame(titles, schema=["item", "title"], orient="row").write_csv(items_path)
    return interactions, items_path


@pytest.fixture(scope="session")
def tiny_source(tmp_path_factory) -> tuple[Path, Path]:
    """(interactions.csv, items.csv) of the tiny synthetic source."""
    return write_tiny_source(tmp_path_factory.mktemp("tiny_source"))


@pytest.fixture(scope="session")
def tiny_examples_dir(tmp_path_factory, tiny_source) -> Path:
    """The tiny source prepared with seed 0 and no train cap (30 users, 60 items)."""
    out = tmp_path_factory.mktemp("tiny_examples") / "examples"
    interactions, items = tiny_source
    prepare(interactions, out, seed=0, items=items)
    return out


@pytest.fixture(scope="session")
def ml100k_dir(tmp_path_factory) -> Path:
    """MovieLens-100k (from the recbole wheel) prepared with seed 0 and max_train_per_user=5."""
    out = tmp_path_factory.mktemp("ml100k") / "examples"
    prepare("movielens-100k", out, seed=0, max_train_per_user=5)
    return out


def save_random_teacher(examples, folder: Path, seed: int) -> Path:
    """A tiny-teacher with random weights (caching and fidelity need no trained one), saved like train-teacher."""
    from c2kd.recmodel.model import RecLM
    from c2kd.recmodel.tokenizer import build_word_tokenizer

    torch.manual_seed(0)
    tokenizer = build_word_tokenizer(examples.titles()[1:], examples.num_items)
    emb = torch.randn(examples.num_items + 1, 64)
    emb[0] = 0
    model = RecLM.from_preset("tiny-teacher", tokenizer, emb, "ids", seed=seed, data_fingerprint=examples.fingerprint)
    return model.save(folder / "teacher")


def run_two_nodes(commands: list[list[str]], env: dict, timeout: int = 600) -> list[tuple[int, str]]:
    """Each command (arguments after `python`) under its own `torchrun --nnodes 2 --nproc-per-node 1`
    launcher, rendezvous c10d on 127.0.0.1: two "nodes" on this machine. Returns (exit code, output)
    per launcher."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
              "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "c2kd-two-nodes"]
    procs = [subprocess.Popen([*launch, *cmd], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for cmd in commands]
    return [(p.wait(timeout=timeout), p.stdout.read()) for p in procs]
