"""Every refusal is one line: bad input to any command ends with exit code 1 (or 2 for a usage
mistake), exactly one line on stderr naming the file, field or value, and nothing left behind
that looks whole. Then: a corrected command runs after a failed first attempt, and a finished
command run again reports that it is complete (exit 0).

The table runs the real entry point (`c2kd.cli.main`) in this process.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import save_random_teacher

from c2kd.cli import main
from c2kd.pipeline.cache_teacher import CacheTeacherSettings, cache_teacher
from c2kd.data.examples import load_examples
from c2kd.data.prepare import prepare
from c2kd.sasrec.train import SASRecTrainConfig, train_sasrec


@pytest.fixture(scope="module")
def env(tiny_examples_dir, tiny_source, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("cli_errors")
    examples = load_examples(tiny_examples_dir)
    train_sasrec(examples, root / "sasrec", SASRecTrainConfig(epochs=2, patience=2))
    teacher = save_random_teacher(examples, root, seed=1)
    cache_teacher(teacher, examples, root / "cache", CacheTeacherSettings(splits=("train",), examples_per_shard=64,
                                                                          progress=False))
    other = root / "other-data"
    prepare(tiny_source[0], other, seed=5, items=tiny_source[1])
    (root / "a-file").write_text("not a folder")
    (root / "fake.gguf").write_bytes(b"this is not a gguf file")
    (root / "not-a-model").mkdir()
    (root / "not-a-model" / "notes.txt").write_text("x")
    (root / "an-existing-dir").mkdir()
    titles_nul = root / "nul"
    titles_nul.mkdir()
    (titles_nul / "i.csv").write_text("user,item,timestamp\n" + "".join(f"u{u},{i},{u * 10 + i}\n" for u in range(6)
                                                                       for i in range(8)))
    (titles_nul / "t.csv").write_text("item,title\n1,Good Film\n2,Bad\x00Film\n")
    return {"data": str(tiny_examples_dir), "sasrec": str(root / "sasrec"), "teacher": str(teacher),
            "cache": str(root / "cache"), "other": str(other), "root": root, "nul": titles_nul,
            "titles": [t for t in examples.titles() if t]}


def run(argv: list[str], capsys) -> tuple[int, list[str]]:
    code = main([str(a) for a in argv])
    return code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def broken_cache(env: dict, name: str, damage) -> str:
    """A copy of the cache with one thing damaged."""
    copy = env["root"] / f"broken-{name}"
    if not copy.exists():
        shutil.copytree(env["cache"], copy)
        damage(copy)
    return str(copy)


def _not_utf8(copy: Path) -> None:
    (copy / "manifest.json").write_bytes(b"\xff\xfe" + (copy / "manifest.json").read_bytes())


def _edited_manifest(copy: Path, edit) -> None:
    """The manifest edited and its digest recomputed, as someone covering their tracks would."""
    from c2kd.cache_schema.schema import manifest_digest

    manifest = json.loads((copy / "manifest.json").read_text())
    edit(manifest)
    manifest["digest"] = manifest_digest(manifest)
    (copy / "manifest.json").write_text(json.dumps(manifest, indent=1))


def _edit_totals(copy: Path) -> None:
    _edited_manifest(copy, lambda m: m["totals"].__setitem__("examples", m["totals"]["examples"] + 1))


def _edit_complete(copy: Path) -> None:
    _edited_manifest(copy, lambda m: m.__setitem__("complete", False))


def _flip_manifest_digit(copy: Path) -> None:
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["shards"][0]["example_ids_sha256"] = "0" + manifest["shards"][0]["example_ids_sha256"][1:]
    (copy / "manifest.json").write_text(json.dumps(manifest, indent=1))


@dataclass
class Case:
    name: str
    argv: object  # callable env -> list[str]
    code: int
    says: str  # a fragment the one line must hold (the file, field or value)
    out: str | None = None  # a path (relative to env root) that must not exist afterwards


TT = ["train-teacher", "--no-progress", "--max-steps", "1", "--model", "micro"]
DISTILL = ["distill", "--no-progress", "--max-steps", "1", "--student", "micro"]

CASES = [
    # --- the cases found (issue) ---
    Case("prepare into a path under a file", lambda e: ["prepare", "movielens-100k", "--out", f"{e['root']}/a-file/sub"],
         1, "is a file"),
    Case("a .gguf that is not one", lambda e: [*TT[:-2], "--data", e["data"], "--sasrec", e["sasrec"], "--out",
                                               f"{e['root']}/o1", "--model", f"{e['root']}/fake.gguf"], 1, "not a GGUF", "o1.partial"),
    Case("negative LoRA rank", lambda e: [*TT, "--data", e["data"], "--sasrec", e["sasrec"], "--out", f"{e['root']}/o2",
                                          "--lora-r", "-4"], 1, "--lora-r", "o2.partial"),
    Case("top-k above the vocabulary", lambda e: ["cache-teacher", "--teacher", e["teacher"], "--data", e["data"], "--out",
                                                  f"{e['root']}/c1", "--logits", "topk:999999"], 1, "topk:999999", "c1"),
    Case("cache into an existing file", lambda e: ["cache-teacher", "--teacher", e["teacher"], "--data", e["data"],
                                                   "--out", f"{e['root']}/a-file"], 1, "not a folder"),
    Case("a CUDA device on a CPU machine", lambda e: ["cache-teacher", "--teacher", e["teacher"], "--data", e["data"],
                                                      "--out", f"{e['root']}/c2", "--device", "cuda"], 1, "CUDA", "c2"),
    Case("evaluate --out an existing folder", lambda e: ["evaluate", "--model", e["sasrec"], "--data", e["data"],
                                                         "--out", f"{e['root']}/an-existing-dir"], 1, "an-existing-dir"),
    Case("a manifest that is not UTF-8 (verify)", lambda e: ["cache", "verify", broken_cache(e, "utf8", _not_utf8)],
         1, "not UTF-8"),
    Case("a manifest that is not UTF-8 (distill)", lambda e: [*DISTILL, "--data", e["data"], "--out", f"{e['root']}/d1",
                                                              "--cache", broken_cache(e, "utf8", _not_utf8)], 1, "not UTF-8", "d1.partial"),
    Case("a cache without its index", lambda e: [*DISTILL, "--data", e["data"], "--out", f"{e['root']}/d2", "--cache",
                                                 broken_cache(e, "index", lambda c: (c / "index.parquet").unlink())],
         1, "index.parquet", "d2.partial"),
    Case("a cache without its teacher head", lambda e: [*DISTILL, "--data", e["data"], "--out", f"{e['root']}/d3", "--cache",
                                                        broken_cache(e, "head", lambda c: (c / "assets" / "teacher_head.safetensors").unlink())],
         1, "teacher_head.safetensors", "d3.partial"),
    Case("a cache without its tokenizer", lambda e: [*DISTILL, "--data", e["data"], "--out", f"{e['root']}/d4", "--cache",
                                                     broken_cache(e, "tok", lambda c: shutil.rmtree(c / "assets" / "tokenizer"))],
         1, "tokenizer", "d4.partial"),
    Case("--layers ,", lambda e: ["cache-teacher", "--teacher", e["teacher"], "--data", e["data"], "--out",
                                  f"{e['root']}/c3", "--layers", ","], 1, "--layers", "c3"),
    Case("--layers 2,2", lambda e: ["cache-teacher", "--teacher", e["teacher"], "--data", e["data"], "--out",
                                    f"{e['root']}/c4", "--layers", "2,2"], 1, "--layers 2,2", "c4"),
    Case("--max-tokens-per-batch 0", lambda e: ["cache-teacher", "--teacher", e["teacher"], "--data", e["data"], "--out",
                                                f"{e['root']}/c5", "--max-tokens-per-batch", "0"], 1, "--max-tokens-per-batch", "c5"),
    Case("--w-feat -1", lambda e: [*DISTILL, "--data", e["data"], "--cache", e["cache"], "--out", f"{e['root']}/d5",
                                   "--w-feat", "-1"], 1, "--w-feat", "d5.partial"),
    Case("--max-train-per-user 0", lambda e: ["prepare", "movielens-100k", "--out", f"{e['root']}/p1",
                                              "--max-train-per-user", "0"], 1, "--max-train-per-user", "p1"),
    Case("a title with a NUL character", lambda e: ["prepare", f"{e['nul']}/i.csv", "--items", f"{e['nul']}/t.csv",
                                                    "--out", f"{e['root']}/p2"], 1, "control character", "p2"),
    Case("an edited manifest digit", lambda e: ["cache", "verify", broken_cache(e, "digit", _flip_manifest_digit)],
         1, "modified after the cache was sealed"),
    # --- and more, across the commands ---
    Case("a source that does not exist", lambda e: ["prepare", f"{e['root']}/nope.csv", "--out", f"{e['root']}/p3"],
         1, "nope.csv", "p3"),
    Case("a negative seed", lambda e: ["prepare", "movielens-100k", "--out", f"{e['root']}/p4", "--seed", "-1"], 2, "--seed", "p4"),
    Case("an unknown option", lambda e: ["prepare", "movielens-100k", "--bogus", "1"], 2, "--bogus"),
    Case("a missing required option", lambda e: ["train-sasrec", "--data", e["data"]], 2, "--out"),
    Case("zero SASRec epochs", lambda e: ["train-sasrec", "--data", e["data"], "--out", f"{e['root']}/s1", "--epochs", "0"],
         1, "epochs", "s1"),
    Case("SASRec on a folder that is not prepared data", lambda e: ["train-sasrec", "--data", f"{e['root']}/not-a-model",
                                                                    "--out", f"{e['root']}/s2"], 1, "not-a-model", "s2"),
    Case("an unknown prompt format", lambda e: [*TT, "--data", e["data"], "--sasrec", e["sasrec"], "--out",
                                                f"{e['root']}/o3", "--format", "text"], 1, "'text'", "o3.partial"),
    Case("--shrink first:0", lambda e: [*TT[:-2], "--model", "smollm2-135m", "--data", e["data"], "--sasrec", e["sasrec"],
                                        "--out", f"{e['root']}/o4", "--shrink", "first:0"], 1, "--shrink 'first:0'", "o4.partial"),
    Case("--shrink on a preset", lambda e: [*TT, "--data", e["data"], "--sasrec", e["sasrec"], "--out", f"{e['root']}/o5",
                                            "--shrink", "first:1"], 1, "preset", "o5.partial"),
    Case("an unknown item head", lambda e: [*TT, "--data", e["data"], "--sasrec", e["sasrec"], "--out", f"{e['root']}/o6",
                                            "--item-head", "fancy"], 1, "--item-head 'fancy'", "o6.partial"),
    Case("the hybrid head in llara", lambda e: [*TT, "--data", e["data"], "--sasrec", e["sasrec"], "--out",
                                                f"{e['root']}/o7", "--item-head", "hybrid", "--format", "llara"],
         1, "ids prompt format", "o7.partial"),
    Case("--eval-every 0", lambda e: [*TT, "--data", e["data"], "--sasrec", e["sasrec"], "--out", f"{e['root']}/o8",
                                      "--eval-every", "0"], 1, "--eval-every", "o8.partial"),
    Case("--batch-size 0", lambda e: [*TT, "--data", e["data"], "--sasrec", e["sasrec"], "--out", f"{e['root']}/o9",
                                      "--batch-size", "0"], 1, "batch_size", "o9.partial"),
    Case("--lr 0", lambda e: [*TT, "--data", e["data"], "--sasrec", e["sasrec"], "--out", f"{e['root']}/o10", "--lr", "0"],
         1, "lr > 0", "o10.partial"),
    Case("--max-val 0", lambda e: [*TT, "--data", e["data"], "--sasrec", e["sasrec"], "--out", f"{e['root']}/o11",
                                   "--max-val", "0"], 1, "--max-val", "o11.partial"),
    Case("a SASRec run of other data", lambda e: [*TT, "--data", e["other"], "--sasrec", e["sasrec"], "--out",
                                                  f"{e['root']}/o12"], 1, "fingerprint", "o12.partial"),
    Case("an unknown model", lambda e: [*TT[:-2], "--model", "gpt-17", "--data", e["data"], "--sasrec", e["sasrec"],
                                        "--out", f"{e['root']}/o13"], 1, "gpt-17", "o13.partial"),
    Case("--positions some", lambda e: ["cache-teacher", "--teacher", e["teacher"], "--data", e["data"], "--out",
                                        f"{e['root']}/c6", "--positions", "some"], 1, "--positions 'some'", "c6"),
    Case("--dtype float64", lambda e: ["cache-teacher", "--teacher", e["teacher"], "--data", e["data"], "--out",
                                       f"{e['root']}/c7", "--dtype", "float64"], 1, "--dtype 'float64'", "c7"),
    Case("--compression lz4", lambda e: ["cache-teacher", "--teacher", e["teacher"], "--data", e["data"], "--out",
                                         f"{e['root']}/c8", "--compression", "lz4"], 1, "lz4", "c8"),
    Case("--vllm-states without vLLM", lambda e: ["cache-teacher", "--teacher", e["teacher"], "--data", e["data"],
                                                  "--out", f"{e['root']}/c13", "--vllm-states", "hooks"],
         1, "--vllm-states 'hooks'", "c13"),
    Case("--splits dev", lambda e: ["cache-teacher", "--teacher", e["teacher"], "--data", e["data"], "--out",
                                    f"{e['root']}/c9", "--splits", "dev"], 1, "--splits 'dev'", "c9"),
    Case("a teacher folder that is not a model", lambda e: ["cache-teacher", "--teacher", f"{e['root']}/not-a-model",
                                                            "--data", e["data"], "--out", f"{e['root']}/c10"],
         1, "not a saved recommender", "c10"),
    Case("a layer the teacher lacks", lambda e: ["cache-teacher", "--teacher", e["teacher"], "--data", e["data"], "--out",
                                                 f"{e['root']}/c11", "--layers", "99"], 1, "layers 1..6", "c11"),
    Case("--device tpu", lambda e: ["cache-teacher", "--teacher", e["teacher"], "--data", e["data"], "--out",
                                    f"{e['root']}/c12", "--device", "tpu"], 1, "--device 'tpu'", "c12"),
    Case("verify a folder that is not a cache", lambda e: ["cache", "verify", f"{e['root']}/not-a-model"], 1, "manifest.json"),
    Case("info on a missing path", lambda e: ["cache", "info", f"{e['root']}/nowhere"], 1, "nowhere"),
    Case("an unknown method", lambda e: [*DISTILL, "--data", e["data"], "--cache", e["cache"], "--out", f"{e['root']}/d6",
                                         "--method", "dpo"], 1, "--method 'dpo'", "d6.partial"),
    Case("a router without a layer", lambda e: [*DISTILL, "--data", e["data"], "--cache", e["cache"], "--out",
                                                f"{e['root']}/d7", "--router", "fixed:x"], 1, "fixed:x", "d7.partial"),
    Case("a router layer not cached", lambda e: [*DISTILL, "--data", e["data"], "--cache", e["cache"], "--out",
                                                 f"{e['root']}/d8", "--router", "fixed:1"], 1, "layer 1 is not cached", "d8.partial"),
    Case("--tau 0", lambda e: [*DISTILL, "--data", e["data"], "--cache", e["cache"], "--out", f"{e['root']}/d9",
                               "--tau", "0"], 1, "--tau", "d9.partial"),
    Case("a cache that does not exist", lambda e: [*DISTILL, "--data", e["data"], "--cache", f"{e['root']}/nowhere",
                                                   "--out", f"{e['root']}/d10"], 1, "nowhere", "d10.partial"),
    Case("distill on other data", lambda e: [*DISTILL, "--data", e["other"], "--cache", e["cache"], "--out",
                                             f"{e['root']}/d11"], 1, "data fingerprint", "d11.partial"),
    Case("--select-metric AUC", lambda e: [*DISTILL, "--data", e["data"], "--cache", e["cache"], "--out",
                                           f"{e['root']}/d12", "--select-metric", "AUC"], 1, "AUC", "d12.partial"),
    Case("--w-logit -0.5", lambda e: [*DISTILL, "--data", e["data"], "--cache", e["cache"], "--out", f"{e['root']}/d13",
                                      "--w-logit", "-0.5"], 1, "--w-logit", "d13.partial"),
    Case("--kd-over tokens", lambda e: [*DISTILL, "--data", e["data"], "--cache", e["cache"], "--out", f"{e['root']}/d14",
                                        "--kd-over", "tokens"], 1, "--kd-over", "d14.partial"),
    Case("--w-own-logit with logit KD", lambda e: [*DISTILL, "--data", e["data"], "--cache", e["cache"], "--out",
                                                   f"{e['root']}/d15", "--method", "logit-kd", "--w-own-logit", "0.5"],
         1, "--w-own-logit", "d15.partial"),
    Case("--w-own-logit without the cross-head", lambda e: [*DISTILL, "--data", e["data"], "--cache", e["cache"], "--out",
                                                            f"{e['root']}/d16", "--no-cross-head", "--w-own-logit", "0.5"],
         1, "--w-own-logit", "d16.partial"),
    Case("--router-layers not cached", lambda e: [*DISTILL, "--data", e["data"], "--cache", e["cache"], "--out",
                                                  f"{e['root']}/d17", "--router-layers", "1,2"], 1, "layers [1] are not cached",
         "d17.partial"),
    Case("--router-layers not numbers", lambda e: [*DISTILL, "--data", e["data"], "--cache", e["cache"], "--out",
                                                   f"{e['root']}/d18", "--router-layers", "late"], 1, "--router-layers 'late'",
         "d18.partial"),
    Case("evaluate an unknown split", lambda e: ["evaluate", "--model", e["sasrec"], "--data", e["data"], "--split", "dev"],
         1, "dev"),
    Case("evaluate a folder that is not a model", lambda e: ["evaluate", "--model", f"{e['root']}/not-a-model", "--data",
                                                             e["data"]], 1, "not-a-model"),
    # --- the last edges: nothing written where nothing can be, one line instead of a traceback ---
    Case("cache-teacher --out under /proc", lambda e: ["cache-teacher", "--teacher", e["teacher"], "--data", e["data"],
                                                       "--out", "/proc/c2kd-cache"], 1, "nothing can be written in /proc"),
    Case("train-sasrec --out under /proc", lambda e: ["train-sasrec", "--data", e["data"], "--out", "/proc/c2kd-sasrec"],
         1, "nothing can be written in /proc"),
    Case("evaluate --out under /proc", lambda e: ["evaluate", "--model", e["sasrec"], "--data", e["data"], "--out",
                                                  "/proc/c2kd-metrics.json"], 1, "nothing can be written in /proc"),
    Case("cache push to /proc", lambda e: ["cache", "push", e["cache"], "/proc/c2kd-push"], 1,
         "nothing can be written in /proc"),
    Case("cache verify given a file", lambda e: ["cache", "verify", f"{e['root']}/a-file"], 1, "a file, not a cache folder"),
    Case("recommend a user beyond 64 bits", lambda e: ["recommend", "--model", e["teacher"], "--data", e["data"], "--user",
                                                       "99999999999999999999"], 2, "--user"),
    Case("train-sasrec a seed beyond 64 bits", lambda e: ["train-sasrec", "--data", e["data"], "--out", f"{e['root']}/s3",
                                                          "--seed", "99999999999999999999999"], 2, "--seed", "s3"),
    Case("train-sasrec --threads 0", lambda e: ["train-sasrec", "--data", e["data"], "--out", f"{e['root']}/s4",
                                                "--threads", "0"], 2, "--threads", "s4"),
    Case("export with other data", lambda e: ["export", "--model", e["teacher"], "--data", e["other"], "--out",
                                              f"{e['root']}/x1"], 1, "other data", "x1"),
    Case("distill --w-logit nan", lambda e: [*DISTILL, "--data", e["data"], "--cache", e["cache"], "--out", f"{e['root']}/d19",
                                             "--w-logit", "nan"], 2, "'nan' is not a finite number", "d19"),
    Case("train-teacher --device tpu", lambda e: [*TT, "--data", e["data"], "--sasrec", e["sasrec"], "--out",
                                                  f"{e['root']}/o14", "--device", "tpu"], 1, "--device 'tpu'", "o14.partial"),
    Case("distill --device cuda:9", lambda e: [*DISTILL, "--data", e["data"], "--cache", e["cache"], "--out",
                                               f"{e['root']}/d20", "--device", "cuda:9"], 1, "--device cuda:9", "d20.partial"),
    Case("recommend --candidates ''", lambda e: ["recommend", "--model", e["teacher"], "--data", e["data"], "--history",
                                                 e["titles"][1], "--candidates", ""], 1, "--candidates"),
    Case("recommend a candidate already watched", lambda e: ["recommend", "--model", e["teacher"], "--data", e["data"],
                                                             "--history", e["titles"][1], "--candidates",
                                                             f"{e['titles'][1]}; {e['titles'][2]}"], 1, "already in --history"),
    Case("--read-cache a file", lambda e: [*DISTILL, "--data", e["data"], "--cache", "memory://c2kd-nowhere", "--out",
                                           f"{e['root']}/d21", "--read-cache", f"{e['root']}/a-file"], 1, "a file, not a folder",
         "d21.partial"),
    Case("--read-cache for a local cache", lambda e: [*DISTILL, "--data", e["data"], "--cache", e["cache"], "--out",
                                                      f"{e['root']}/d22", "--read-cache", f"{e['root']}/rc"], 1,
         "is a local folder", "rc"),
    Case("cache-teacher --layers ''", lambda e: ["cache-teacher", "--teacher", e["teacher"], "--data", e["data"], "--out",
                                                 f"{e['root']}/c14", "--layers", ""], 1, "at least one layer", "c14"),
    Case("--lora-alpha without --lora-r", lambda e: [*TT, "--data", e["data"], "--sasrec", e["sasrec"], "--out",
                                                     f"{e['root']}/o15", "--lora-alpha", "4"], 1, "--lora-r", "o15.partial"),
    Case("distill --out ''", lambda e: [*DISTILL, "--data", e["data"], "--cache", e["cache"], "--out", ""], 1,
         "give the path of a new folder"),
    Case("verify after a totals.examples edit", lambda e: ["cache", "verify", broken_cache(e, "totals", _edit_totals)],
         1, "totals.examples is"),
    Case("a complete: false edit", lambda e: ["cache", "verify", broken_cache(e, "complete", _edit_complete)], 1,
         "modified after the cache was sealed"),
    Case("demo --family unknown", lambda e: ["demo", "--family", "llama-7b", "--out", f"{e['root']}/demo-x"], 1,
         "--family 'llama-7b': expected one of smollm2-135m, gemma3-270m", "demo-x"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_every_refusal_is_one_clear_line(case: Case, env, capsys):
    code, lines = run(case.argv(env), capsys)
    assert code == case.code, (code, lines)
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: ") and case.says in lines[0], lines[0]
    if case.out is not None:
        assert not (env["root"] / case.out).exists(), f"{case.out} was left behind"


def test_case_count():
    assert len(CASES) >= 19 + 25 + 20


def test_a_corrected_command_runs_after_a_failed_one(env, capsys):
    out = env["root"] / "corrected"
    base = [*DISTILL, "--data", env["data"], "--cache", env["cache"], "--out", str(out)]
    for wrong in (["--student", "mikro"], ["--select-metric", "AUC"], ["--max-train", "0"]):
        assert run([*base, *wrong], capsys)[0] == 1
    assert not Path(str(out) + ".partial").exists()
    code, lines = run(base, capsys)
    assert code == 0, lines
    assert (out / "distill.json").is_file()


def test_a_finished_command_run_again_reports_it_is_complete(env, capsys):
    out = env["root"] / "finished"
    args = [*DISTILL, "--data", env["data"], "--cache", env["cache"], "--out", str(out)]
    assert run(args, capsys)[0] == 0
    stamp = (out / "distill.json").stat().st_mtime_ns
    code = main([str(a) for a in args])
    printed = capsys.readouterr().out
    assert code == 0 and "already complete" in printed
    assert (out / "distill.json").stat().st_mtime_ns == stamp  # nothing trained or written again
    cache_args = ["cache-teacher", "--teacher", env["teacher"], "--data", env["data"], "--out", env["cache"],
                  "--splits", "train", "--examples-per-shard", "64", "--no-progress"]
    code = main(cache_args)
    assert code == 0 and "already a complete cache" in capsys.readouterr().out


def _float_options() -> list[tuple[list[str], str]]:
    """(command path, flag) of every float option of every command."""
    import inspect
    import typing

    from c2kd.cli import app

    found = []
    groups = [([], app)] + [([g.name], g.typer_instance) for g in app.registered_groups]
    for prefix, group in groups:
        for command in group.registered_commands:
            hints = typing.get_type_hints(command.callback, include_extras=True)
            for name, parameter in inspect.signature(command.callback).parameters.items():
                hint = hints[name]
                info = parameter.default if not typing.get_origin(hint) is typing.Annotated else hint.__metadata__[0]
                base = typing.get_args(hint)[0] if typing.get_origin(hint) is typing.Annotated else hint
                if float in (base, *typing.get_args(base)):
                    # in Annotated form typer reads a first argument like "--lr" as the option's name
                    flags = [d for d in (info.default, *info.param_decls) if isinstance(d, str) and d.startswith("--")]
                    found.append(([*prefix, command.name or command.callback.__name__], flags[0]))
    return found


FLOAT_OPTIONS = _float_options()


def test_every_float_option_is_checked_for_nan():
    assert len(FLOAT_OPTIONS) >= 18  # the introspection sees the options (distill alone has 10)
    assert (["distill"], "--w-logit") in FLOAT_OPTIONS and (["train-sasrec"], "--lr") in FLOAT_OPTIONS


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_no_float_option_takes_a_non_finite_number(value, capsys):
    for command, flag in FLOAT_OPTIONS:
        code, lines = run([*command, flag, value], capsys)
        assert code == 2 and len(lines) == 1, (command, flag, lines)
        assert flag in lines[0] and "not a finite number" in lines[0], lines[0]


def test_a_refused_run_leaves_nothing_that_blocks_the_corrected_one(env, capsys):
    out = env["root"] / "teacher-corrected"
    base = [*TT[:-4], "--model", "micro", "--data", env["data"], "--sasrec", env["sasrec"], "--out", str(out)]
    code, lines = run([*base, "--max-steps", "1", "--device", "tpu"], capsys)
    assert code == 1 and "--device 'tpu'" in lines[0]
    assert not out.exists() and not Path(f"{out}.partial").exists()
    code, lines = run([*base, "--max-steps", "2", "--lr", "0.002"], capsys)
    assert code == 0, lines
    # the finished run, asked again with another setting: the refusal names the option, not its group
    code, lines = run([*base, "--max-steps", "2", "--lr", "0.003"], capsys)
    assert code == 1 and "--lr was 0.002, now 0.003" in lines[0], lines


def test_checkpoint_every_zero_is_documented(capsys):
    import os

    os.environ["COLUMNS"] = "400"
    try:
        assert main(["distill", "--help"]) == 0
    finally:
        del os.environ["COLUMNS"]
    assert "0: only the final one" in capsys.readouterr().out
