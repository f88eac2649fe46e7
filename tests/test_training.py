"""The trainer on a toy MLP with dropout (CPU, seconds): learning, exact resume, best-state
selection, the log, gradient accumulation and 2-rank DDP.

This file is also a script (`python tests/test_training.py run OUT [--sleep-after K] [--exit-after K] [--dropout P]`) so
that subprocess tests (SIGKILL, torchrun) train exactly the same toy run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from c2kd.errors import C2KDError
import numpy as np

from c2kd.training import ExampleBatches, TrainConfig, epoch_batches, epoch_order, latest_checkpoint, read_log, train

HERE = Path(__file__).resolve()
N_TRAIN, N_VAL, DIM, CLASSES = 48, 32, 8, 4


def toy_data(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, DIM, generator=g)
    w = torch.randn(DIM, CLASSES, generator=torch.Generator().manual_seed(99))  # same rule for every split
    y = (x @ w).argmax(dim=1)
    return [{"x": x[i], "y": y[i], "idx": torch.tensor(i)} for i in range(n)]


def toy_model(dropout: float = 0.2) -> nn.Module:
    torch.manual_seed(1234)
    return nn.Sequential(nn.Linear(DIM, 32), nn.GELU(), nn.Dropout(dropout), nn.Linear(32, CLASSES))


def collate(examples: list[dict]) -> dict:
    return {k: torch.stack([e[k] for e in examples]) for k in ("x", "y", "idx")}


def loss_fn(model: nn.Module, batch: dict) -> dict:
    logits = model(batch["x"])
    ce = nn.functional.cross_entropy(logits, batch["y"])
    return {"loss": ce, "logit_sq": logits.pow(2).mean()}


VAL = toy_data(N_VAL, seed=2)


def accuracy(model: nn.Module) -> dict:
    batch = collate(VAL)
    pred = model(batch["x"]).argmax(dim=1)
    return {"accuracy": (pred == batch["y"]).float().mean().item(), "neg_loss": -loss_fn(model, batch)["loss"].item()}


def config(out: Path, **kw) -> TrainConfig:
    base = dict(out_dir=out, lr=3e-3, weight_decay=0.01, warmup_ratio=0.1, epochs=4, batch_size=8, grad_accum=2,
                checkpoint_every=4, eval_every=3, log_every=1, seed=7, progress=False)
    base.update(kw)
    return TrainConfig(**base)


def source(data: list, cfg: TrainConfig, collate_fn=collate) -> ExampleBatches:
    return ExampleBatches(data, collate_fn, cfg.batch_size, cfg.seed)


def batches(data: list, collate_fn=collate) -> ExampleBatches:
    """The batch source of `config()`'s batch size and seed."""
    return source(data, config(Path(".")), collate_fn)


def run(out: Path, *, dropout: float = 0.2, loss=loss_fn, **kw):
    model = toy_model(dropout)
    cfg = config(out, **kw)
    result = train(model, loss, source(toy_data(N_TRAIN, seed=1), cfg), accuracy, "neg_loss", cfg)
    return model, result


def same_weights(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


class Crash(RuntimeError):
    pass


def crash_on_call(n: int):
    calls = {"n": 0}

    def loss(model, batch):
        calls["n"] += 1
        if calls["n"] == n:
            raise Crash("simulated crash")
        return loss_fn(model, batch)

    return loss


# ------------------------------------------------------------------------------------------ tests


def test_epoch_batches_are_a_seeded_permutation():
    a = epoch_batches(10, 4, seed=3, epoch=0)
    assert [len(b) for b in a] == [4, 4, 2]
    assert sorted(int(i) for b in a for i in b) == list(range(10))
    assert all((x == y).all() for x, y in zip(a, epoch_batches(10, 4, seed=3, epoch=0)))
    assert not (epoch_batches(10, 10, seed=3, epoch=1)[0] == a[0].tolist() + a[1].tolist() + a[2].tolist()).all()
    # a last piece smaller than the world size would leave a rank without data: dropped
    assert [len(b) for b in epoch_batches(9, 4, seed=3, epoch=0, world_size=2)] == [4, 4]


def test_the_block_shuffle_reads_few_groups_per_batch_and_is_the_plain_shuffle_on_small_data():
    groups = np.repeat(np.arange(40), 25)[np.random.default_rng(1).permutation(1000)]  # 40 shards of 25, stored mixed
    order = epoch_order(1000, seed=2, epoch=0, groups=groups, block=100)
    assert sorted(order.tolist()) == list(range(1000))
    assert np.array_equal(order, epoch_order(1000, seed=2, epoch=0, groups=groups, block=100))
    assert not np.array_equal(order, epoch_order(1000, seed=2, epoch=1, groups=groups, block=100))
    # blocks of whole groups: each run of 100 examples holds exactly 4 groups, none seen in another block
    blocks = [set(groups[order[i : i + 100]].tolist()) for i in range(0, 1000, 100)]
    assert all(len(b) == 4 for b in blocks) and len(set().union(*blocks)) == 40
    full = epoch_order(1000, seed=2, epoch=0)
    assert max(len(set(groups[full[i : i + 100]].tolist())) for i in range(0, 1000, 100)) > 30  # a full shuffle: most
    # data no larger than a block (or block 0): exactly the plain permutation, the order in-memory runs see
    for block in (0, 1000, 5000):
        assert np.array_equal(epoch_order(1000, seed=2, epoch=0, groups=groups, block=block), full)
    # the batches and the drop rule are the same as without groups; the order does not depend on the world size
    one = epoch_batches(1000, 32, 2, 0, 1, groups, 100)
    two = epoch_batches(1000, 32, 2, 0, 2, groups, 100)
    assert np.array_equal(np.concatenate(one), order) and np.array_equal(np.concatenate(two), order)


def test_loss_decreases_and_model_learns(tmp_path):
    model, result = run(tmp_path, epochs=12, lr=2e-2, eval_every="epoch", checkpoint_every=100)
    train_lines = read_log(tmp_path, "train")
    first, last = train_lines[0]["loss"], sum(r["loss"] for r in train_lines[-3:]) / 3
    assert last < 0.7 * first, (first, last)
    assert result.best_metrics["accuracy"] > 0.5  # chance is 0.25
    assert result.final_step == 12 * 3  # 48 examples / 8 = 6 micro-batches, 2 per step


def test_each_epoch_sees_every_example_once_in_a_new_order(tmp_path):
    seen: list[list[int]] = []

    def loss(model, batch):
        seen.append(batch["idx"].tolist())
        return loss_fn(model, batch)

    run(tmp_path, loss=loss, epochs=3)
    epochs = [sum(seen[e * 6 : (e + 1) * 6], []) for e in range(3)]  # 6 micro-batches per epoch
    assert len(seen) == 18 and all(sorted(e) == list(range(N_TRAIN)) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2]


class BlockSource:
    """A custom batch source: contiguous blocks of 8, the block order rotated by the epoch."""

    def __init__(self, data: list):
        self.data, self.num_examples = data, len(data)
        self.calls: list[tuple[int, int]] = []

    def __len__(self) -> int:
        return N_TRAIN // 8

    def order(self, epoch: int) -> list[list[int]]:
        blocks = [list(range(i, i + 8)) for i in range(0, N_TRAIN, 8)]
        return blocks[epoch % 6 :] + blocks[: epoch % 6]

    def batches(self, epoch: int, start: int = 0):
        self.calls.append((epoch, start))
        for idx in self.order(epoch)[start:]:
            yield collate([self.data[i] for i in idx])


def test_a_batch_source_is_followed_and_resumed_by_position(tmp_path):
    seen: list[list[int]] = []

    def loss(model, batch):
        seen.append(batch["idx"].tolist())
        return loss_fn(model, batch)

    def go(out, loss):
        model, data = toy_model(), BlockSource(toy_data(N_TRAIN, 1))
        train(model, loss, data, accuracy, "neg_loss", config(out))
        return model, data

    ref, data = go(tmp_path / "a", loss)
    assert seen[:6] == data.order(0) and seen[6:12] == data.order(1)
    assert data.calls == [(e, 0) for e in range(4)]  # asked once per epoch, from its start
    with pytest.raises(Crash):
        go(tmp_path / "b", crash_on_call(11))  # micro-batch 11 = step 6 (epoch 1, position 4); checkpoint at step 4
    resumed, data = go(tmp_path / "b", loss_fn)
    assert data.calls[0] == (1, 2)  # resumed in epoch 1 at micro-batch 2 (steps are 2 micro-batches)
    assert same_weights(ref, resumed)


def test_resume_after_crash_is_bitwise_identical(tmp_path):
    ref, ref_result = run(tmp_path / "a")
    assert ref_result.final_step == 12  # 4 epochs x 3 steps; the third step of an epoch has one micro-batch
    with pytest.raises(Crash):
        run(tmp_path / "b", loss=crash_on_call(19))  # micro-batch 19 = step 10; last checkpoint: step 8
    assert latest_checkpoint(tmp_path / "b").name == "step-000008"
    resumed, result = run(tmp_path / "b")
    assert result.resumed_from == 8 and result.final_step == 12
    assert same_weights(ref, resumed)
    assert (result.best_step, result.best_metric) == (ref_result.best_step, ref_result.best_metric)
    # the log of the resumed run reads like the uninterrupted one (no repeated or missing steps)
    strip = lambda recs: [{k: v for k, v in r.items() if not k.endswith("_per_s")} for r in recs]  # noqa: E731
    assert strip(read_log(tmp_path / "b")) == strip(read_log(tmp_path / "a"))


def accumulate_loss(model: nn.Module, batch: dict) -> dict:
    """The toy loss plus a gather with many repeated indices: its backward accumulates many
    gradients into the same rows, where the summation order must not depend on the threads."""
    rows = batch["idx"].repeat(64) % 4
    gathered = model[0].weight[rows]
    return {"loss": loss_fn(model, batch)["loss"] + 1e-3 * gathered.pow(2).sum()}


def test_training_is_bitwise_reproducible_with_threads(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        first, _ = run(tmp_path / "a", loss=accumulate_loss)
        second, _ = run(tmp_path / "b", loss=accumulate_loss)
    finally:
        torch.set_num_threads(threads)
    assert torch.are_deterministic_algorithms_enabled()
    assert same_weights(first, second)


def test_finished_run_is_not_trained_again(tmp_path):
    first, r1 = run(tmp_path)
    again, r2 = run(tmp_path)
    assert r2.resumed_from == r1.final_step == r2.final_step
    assert same_weights(first, again)  # best weights loaded again


def test_resume_refuses_other_settings(tmp_path):
    with pytest.raises(Crash):
        run(tmp_path, loss=crash_on_call(12))
    with pytest.raises(C2KDError, match="different run"):
        run(tmp_path, lr=1e-2)
    with pytest.raises(C2KDError, match="frozen weights differ"):
        model = toy_model()
        with torch.no_grad():
            model[0].bias.add_(1.0)
        train(model, loss_fn, batches(toy_data(N_TRAIN, 1), collate), accuracy, "neg_loss", config(tmp_path),
              trainable_parameters=list(model[3].parameters()) + [model[0].weight])
    assert latest_checkpoint(tmp_path).name == "step-000004"


def test_sigkill_then_resume_is_bitwise_identical(tmp_path):
    ref, _ = run(tmp_path / "a")
    out = tmp_path / "b"
    # The child sleeps once checkpoint step 8 exists, so the kill lands mid-run, after a checkpoint.
    child = subprocess.Popen([sys.executable, str(HERE), "run", str(out), "--sleep-after", "8"])
    try:
        deadline = time.time() + 120
        while not (out / "checkpoints" / "step-000008").is_dir():
            assert child.poll() is None, "child ended before its checkpoint"
            assert time.time() < deadline
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
    assert (out / "best" / "best.json").is_file() and not (out / "log.jsonl").read_text() == ""
    resumed, result = run(out)
    assert result.resumed_from == 8
    assert same_weights(ref, resumed)


def test_best_state_is_chosen_on_validation(tmp_path):
    scripted = iter([0.2, 0.9, 0.5, 0.1])  # evaluations at steps 3, 6, 9, 12
    snapshots = {}
    calls = []

    def evaluate(model):
        calls.append(1)
        snapshots[len(calls) * 3] = {k: v.clone() for k, v in model.state_dict().items()}
        return {"score": next(scripted)}

    model = toy_model()
    result = train(model, loss_fn, batches(toy_data(N_TRAIN, 1), collate), evaluate, "score", config(tmp_path))
    assert (result.best_step, result.best_metric) == (6, 0.9)
    assert json.loads((tmp_path / "best" / "best.json").read_text())["step"] == 6
    assert all(torch.equal(v, snapshots[6][k]) for k, v in model.state_dict().items())  # best weights loaded back
    assert not all(torch.equal(v, snapshots[12][k]) for k, v in model.state_dict().items())
    assert [(r["step"], r["best"]) for r in read_log(tmp_path, "eval")] == [(3, True), (6, True), (9, False), (12, False)]


def test_log_lines_and_epoch_hook(tmp_path):
    seen = []

    def hook(epoch, stats):
        seen.append((epoch, stats))
        return {"hook_value": epoch * 10}

    model = toy_model()
    train(model, loss_fn, batches(toy_data(N_TRAIN, 1), collate), accuracy, "accuracy", config(tmp_path, log_every=2),
          on_epoch_end=hook)
    lines = read_log(tmp_path, "train")
    assert [r["step"] for r in lines] == [2, 4, 6, 8, 10, 12]
    for r in lines:
        assert {"step", "epoch", "lr", "loss", "logit_sq", "grad_norm", "examples_per_s"} <= set(r)
        assert r["loss"] > 0 and r["logit_sq"] > 0 and r["examples_per_s"] > 0
    assert lines[0]["epoch"] == 0 and lines[-1]["epoch"] == 3
    assert max(r["lr"] for r in lines) <= 3e-3 and lines[-1]["lr"] < lines[1]["lr"]  # cosine decay
    epochs = read_log(tmp_path, "epoch")
    assert [r["epoch"] for r in epochs] == [0, 1, 2, 3] and [r["hook_value"] for r in epochs] == [0, 10, 20, 30]
    assert [e for e, _ in seen] == [0, 1, 2, 3] and seen[0][1]["step"] == 3 and "loss" in seen[0][1]
    evals = read_log(tmp_path, "eval")
    assert [r["step"] for r in evals] == [3, 6, 9, 12] and all("accuracy" in r for r in evals)


def test_tokens_per_second_is_logged_for_masked_batches(tmp_path):
    def collate_masked(examples):
        batch = collate(examples)
        batch["attention_mask"] = torch.ones(len(examples), 5, dtype=torch.long)
        return batch

    train(toy_model(), loss_fn, batches(toy_data(16, 1), collate_masked), None, None,
          config(tmp_path, epochs=1, grad_accum=1, log_every=1))
    lines = read_log(tmp_path, "train")
    assert len(lines) == 2 and all(r["tokens_per_s"] > 0 for r in lines)


def test_gradient_accumulation_matches_a_bigger_batch(tmp_path):
    # Without dropout (it draws different masks for one batch of 2b than for two of b).
    # accum 2 x batch 4 averages two equal-sized means = the mean over the batch of 8: same gradients
    # up to float32 summation order, so the weights agree to ~1e-6 after 6 AdamW steps.
    a, _ = run(tmp_path / "a", dropout=0.0, batch_size=4, grad_accum=2, epochs=1)
    b, _ = run(tmp_path / "b", dropout=0.0, batch_size=8, grad_accum=1, epochs=1)
    for x, y in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-5)
    c, _ = run(tmp_path / "c", dropout=0.0, batch_size=8, grad_accum=1, epochs=1, lr=1e-2)
    assert not torch.allclose(next(a.parameters()), next(c.parameters()), atol=1e-4)  # the check can fail


def test_bad_settings_are_refused(tmp_path):
    for bad in (dict(batch_size=0), dict(grad_accum=0), dict(lr=0.0), dict(warmup_ratio=1.0), dict(eval_every="often")):
        with pytest.raises(C2KDError):
            config(tmp_path, **bad)
    with pytest.raises(C2KDError, match="select_metric"):
        train(toy_model(), loss_fn, batches(toy_data(8, 1), collate), accuracy, None, config(tmp_path))
    with pytest.raises(C2KDError, match="no training examples"):
        train(toy_model(), loss_fn, batches([], collate), accuracy, "accuracy", config(tmp_path))


def test_bf16_autocast_on_cpu_trains(tmp_path):
    model, result = run(tmp_path, bf16=True, epochs=2)
    assert result.final_step == 6 and all(p.dtype == torch.float32 for p in model.parameters())
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in read_log(tmp_path, "train"))


def test_frozen_parameters_are_not_trained_nor_saved(tmp_path):
    model = toy_model()
    first = {k: v.clone() for k, v in model[0].state_dict().items()}
    train(model, loss_fn, batches(toy_data(N_TRAIN, 1), collate), accuracy, "accuracy", config(tmp_path, epochs=1),
          trainable_parameters=list(model[3].parameters()))
    assert all(torch.equal(v, first[k]) for k, v in model[0].state_dict().items())
    saved = torch.load(latest_checkpoint(tmp_path) / "model.pt", weights_only=True)
    assert sorted(saved) == ["3.bias", "3.weight"]


def test_ddp_two_ranks_with_torchrun(tmp_path):
    # Without dropout the 2-rank run (each rank half of every batch, gradients averaged) must follow
    # the single-process run; both ranks must hold identical weights.
    single, _ = run(tmp_path / "single", dropout=0.0, epochs=2)
    out = tmp_path / "ddp"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(HERE), "run", str(out), "--dropout", "0.0", "--epochs", "2", "--save-rank-weights"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    w0 = torch.load(out / "rank0.pt", weights_only=True)
    w1 = torch.load(out / "rank1.pt", weights_only=True)
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    for k, v in single.state_dict().items():
        torch.testing.assert_close(w0[k], v, rtol=0, atol=1e-5)
    lines = read_log(out, "train")
    assert [r["step"] for r in lines] == list(range(1, 7))  # written once, by rank 0
    trainer_state = torch.load(latest_checkpoint(out) / "trainer.pt", weights_only=True)
    assert len(trainer_state["ranks"]) == 2


def test_a_run_stopped_under_two_processes_resumes_under_one_in_the_same_global_order(tmp_path):
    # Elastic resume: the order of an epoch does not depend on the world size (each rank takes a strided
    # slice of every micro-batch) and the position is counted in micro-batches, so the one process
    # continues where the two stopped; without dropout it ends with the uninterrupted run's weights.
    single, _ = run(tmp_path / "single", dropout=0.0, epochs=2)
    out = tmp_path / "elastic"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # a rank dies once checkpoint 4 exists; torchrun then stops the other one and exits (no orphan left)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(HERE), "run", str(out), "--dropout", "0.0", "--epochs", "2", "--exit-after", "4"]
    stopped = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert stopped.returncode != 0 and (out / "checkpoints" / "step-000004").is_dir(), stopped.stderr[-2000:]
    assert len(torch.load(out / "checkpoints" / "step-000004" / "trainer.pt", weights_only=True)["ranks"]) == 2
    resumed, result = run(out, dropout=0.0, epochs=2)
    assert result.resumed_from == 4
    for k, v in single.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[k], v, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------------ script


def _main(argv: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["run"])
    parser.add_argument("out")
    parser.add_argument("--sleep-after", type=int, default=0)
    parser.add_argument("--exit-after", type=int, default=0)
    parser.add_argument("--dropout", type=float, default=0.2)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--save-rank-weights", action="store_true")
    args = parser.parse_args(argv)
    out = Path(args.out)

    def loss(model, batch):
        if args.sleep_after and (out / "checkpoints" / f"step-{args.sleep_after:06d}").is_dir():
            time.sleep(600)  # killed here
        if args.exit_after and (out / "checkpoints" / f"step-{args.exit_after:06d}").is_dir():
            os._exit(3)  # a crash
        return loss_fn(model, batch)

    model, _ = run(out, dropout=args.dropout, loss=loss, epochs=args.epochs)
    if args.save_rank_weights:
        torch.save(model.state_dict(), out / f"rank{os.environ.get('RANK', 0)}.pt")


if __name__ == "__main__":
    _main(sys.argv[1:])
