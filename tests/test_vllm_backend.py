"""`cache-teacher --backend vllm` writes the cache the transformers backend writes.

vLLM lives in its own virtual environment (scripts/setup_vllm.sh builds it once, outside the
checkout, and points its c2kd at this checkout); the vLLM cache is written there by the CLI, the
transformers cache here, and the two are compared array by array.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import save_random_teacher

from c2kd.cache_schema import TeacherCache, verify_cache
from c2kd.pipeline.cache_teacher import CacheTeacherSettings, cache_teacher
from c2kd.data.examples import load_examples
from c2kd.recmodel.model import RecLM
from c2kd.recmodel.tokenizer import build_word_tokenizer
from c2kd.student.distill import DistillRecipe, distill

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def vllm_python() -> str:
    out = subprocess.run(["bash", str(ROOT / "scripts" / "setup_vllm.sh")], capture_output=True, text=True,
                         timeout=3000, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def examples(tiny_examples_dir):
    return load_examples(tiny_examples_dir)


def _vllm_cache(python: str, teacher: Path, data: Path, out: Path, *args: str) -> str:
    """Writes the cache with the vLLM backend; returns how its layers came back (extract or hooks)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([python, "-m", "c2kd.cli", "cache-teacher", "--backend", "vllm", "--teacher", str(teacher),
                           "--data", str(data), "--out", str(out), "--no-progress", "--writer", "thread", *args],
                          capture_output=True, text=True, timeout=1800, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout.split("vLLM states: ")[1].split(";")[0]


def _compare(a: TeacherCache, b: TeacherCache) -> dict[str, float]:
    """Largest |difference| per array; token-level arrays must be equal."""
    ids = a.index["example_id"].to_list()
    x, y = a.get(ids), b.get(ids)
    for name in ("input_ids", "labels", "slot_items", "answer_positions", "answer_mask", "attention_mask"):
        assert torch.equal(getattr(x, name), getattr(y, name)), name
    rows = x.hidden_mask
    diffs = {f"layer {l}": (x.hidden[l][rows].float() - y.hidden[l][rows].float()).abs().max().item() for l in a.layers}
    answers = x.answer_mask
    diffs["final_hidden"] = (x.final_hidden[answers].float() - y.final_hidden[answers].float()).abs().max().item()
    if x.topk_values is not None:
        diffs["topk_values"] = (x.topk_values[answers].float() - y.topk_values[answers].float()).abs().max().item()
        diffs["topk_indices_equal"] = float(torch.equal(x.topk_indices, y.topk_indices))
    return diffs


@pytest.mark.parametrize("states", ["auto", "hooks"])
def test_ids_teacher_gives_the_same_cache(vllm_python, examples, tmp_path, states):
    teacher = save_random_teacher(examples, tmp_path, seed=6)  # tiny-teacher: head size 32, which vLLM's CPU attention takes
    settings = dict(splits=("train", "test"), dtype="float32", logits="topk:8", progress=False)
    cache_teacher(teacher, examples, tmp_path / "hf", CacheTeacherSettings(**settings))
    used = _vllm_cache(vllm_python, teacher, examples.root, tmp_path / "vllm", "--splits", "train,test", "--dtype",
                       "float32", "--logits", "topk:8", "--vllm-states", states)
    assert used == ("extract" if states == "auto" else states)  # a Llama with token ids: vLLM's own extraction
    a, b = TeacherCache.open(tmp_path / "hf"), TeacherCache.open(tmp_path / "vllm")
    diffs = _compare(a, b)
    assert diffs.pop("topk_indices_equal") == 1.0
    assert max(diffs.values()) < 1e-4, diffs
    assert a.index.equals(b.index) and b.spec.backend == "vllm"
    same = {k: v for k, v in a.spec.to_dict().items() if k != "backend"}
    assert same == {k: v for k, v in b.spec.to_dict().items() if k != "backend"}
    assert verify_cache(tmp_path / "vllm").ok
    record = distill(tmp_path / "vllm", examples.root, tmp_path / "student",
                     DistillRecipe(student="micro", max_val=4), {"max_steps": 2, "batch_size": 8, "progress": False})
    assert record["final_step"] == 2


def test_llara_teacher_through_prompt_embeddings(vllm_python, examples, tmp_path):
    torch.manual_seed(0)
    tokenizer = build_word_tokenizer(examples.titles()[1:], examples.num_items)
    emb = torch.randn(examples.num_items + 1, 64)
    RecLM.from_preset("tiny-teacher", tokenizer, emb, "llara", seed=2, data_fingerprint=examples.fingerprint) \
        .save(tmp_path / "teacher")
    settings = dict(splits=("test",), dtype="bfloat16", positions="answer", progress=False)
    cache_teacher(tmp_path / "teacher", examples, tmp_path / "hf", CacheTeacherSettings(**settings))
    used = _vllm_cache(vllm_python, tmp_path / "teacher", examples.root, tmp_path / "vllm", "--splits", "test",
                       "--positions", "answer")
    assert used == "hooks"  # vLLM's extraction takes token ids only
    diffs = _compare(TeacherCache.open(tmp_path / "hf"), TeacherCache.open(tmp_path / "vllm"))
    assert max(diffs.values()) <= 0.02, diffs  # bfloat16: a value within one rounding step (2^-8 relative)


def test_a_missing_vllm_is_one_clear_line(tmp_path, examples, capsys):
    from c2kd.cli import main

    teacher = save_random_teacher(examples, tmp_path, seed=1)
    capsys.readouterr()
    code = main(["cache-teacher", "--backend", "vllm", "--teacher", str(teacher), "--data", str(examples.root),
                 "--out", str(tmp_path / "c")])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 1 and len(err) == 1 and "vLLM" in err[0] and not (tmp_path / "c").exists()


def test_the_states_mechanism_follows_the_architecture_and_the_prompts(vllm_python, tmp_path):
    """vLLM's own extraction for an EAGLE-3 architecture with token ids; hooks for prompt embeddings or Gemma 3."""
    for arch in ("LlamaForCausalLM", "Gemma3ForCausalLM"):
        (tmp_path / arch).mkdir()
        (tmp_path / arch / "config.json").write_text(f'{{"architectures": ["{arch}"]}}')
    code = ("import sys; from pathlib import Path; from c2kd.pipeline.vllm_backend import states_mechanism as m\n"
            "print([m(Path(sys.argv[1]) / a, e) for a in ('LlamaForCausalLM', 'Gemma3ForCausalLM') for e in (False, True)])")
    proc = subprocess.run([vllm_python, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "['extract', 'hooks', 'hooks', 'hooks']"


def _same_top_k(x, y) -> bool:
    """The same top-k tokens per answer, ranked alike but for near-ties: a token may change rank only
    between logits within one bfloat16 step of each other (equal logits come out in either order)."""
    mask = x.answer_mask
    for v, p, q in zip(x.topk_values[mask].float().tolist(), x.topk_indices[mask].tolist(), y.topk_indices[mask].tolist()):
        rank_y = {t: k for k, t in enumerate(q)}
        if set(p) != set(q) or any(abs(v[k] - v[rank_y[t]]) > 2.0**-7 * abs(v[k]) + 1e-6 for k, t in enumerate(p)):
            return False
    return True


def test_gemma3_teacher_with_the_engine_sized_to_the_machine(vllm_python, examples, tmp_path):
    """An untrained Gemma-3-270M recommender: with vLLM's memory sized from the machine (the fixed 0.2
    share stopped it on a 24 GiB machine), the vLLM cache equals the transformers one. LLaRA prompts
    only: Gemma 3 goes through the hooks either way, and each format costs minutes of loading."""
    fmt = "llara"
    emb = torch.randn(examples.num_items + 1, 64, generator=torch.Generator().manual_seed(0))
    emb[0] = 0
    RecLM.from_pretrained("gemma3-270m", emb, fmt, data_fingerprint=examples.fingerprint, seed=3) \
        .save(tmp_path / "teacher")
    args = ["--splits", "validation,test", "--max-examples", "12", "--logits", "topk:20"]
    cache_teacher(tmp_path / "teacher", examples, tmp_path / "hf", CacheTeacherSettings(
        splits=("validation", "test"), max_examples=12, logits="topk:20", progress=False))
    assert _vllm_cache(vllm_python, tmp_path / "teacher", examples.root, tmp_path / "vllm", *args) == "hooks"
    a, b = TeacherCache.open(tmp_path / "hf"), TeacherCache.open(tmp_path / "vllm")
    ids = a.index["example_id"].to_list()
    assert len(ids) == 24 and b.index["example_id"].to_list() == ids
    x, y = a.get(ids), b.get(ids)
    assert _same_top_k(x, y)
    rows = x.hidden_mask
    for p, q in [(x.hidden[l][rows], y.hidden[l][rows]) for l in a.layers] + [(x.final_hidden[x.answer_mask],
                                                                             y.final_hidden[y.answer_mask])]:
        p, q = p.float(), q.float()
        one_step = 2.0**-7 * torch.maximum(p.abs(), q.abs()) + 1e-6  # bfloat16's spacing at these values
        assert ((p - q).abs() <= one_step).float().mean() >= 0.999
