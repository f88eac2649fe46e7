"""`cache-teacher --dtype float8`: e4m3 hidden states with one float32 scale per row, decoded on read.

The final state that exact logits come from stays bfloat16, so a float8 cache's exact logits are
the bfloat16 cache's; its hidden states are within float8's rounding of them, in about half the
bytes; a reader without c2kd decodes them by the rule in SCHEMA.md; a c2kd that knows only schema
version 2 refuses the cache instead of reading its bytes as numbers.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from conftest import save_random_teacher
from typer.testing import CliRunner

from c2kd.cache_schema import TeacherCache, verify_cache
from c2kd.cache_schema import schema as S
from c2kd.cache_schema.dtypes import dequantize_e4m3, e4m3_table, quantize_e4m3
from c2kd.cli import app
from c2kd.data.examples import load_examples
from c2kd.errors import C2KDError, CacheError
from c2kd.pipeline.cache_teacher import CacheTeacherSettings, cache_teacher


@pytest.fixture(scope="module")
def examples(tiny_examples_dir):
    return load_examples(tiny_examples_dir)


@pytest.fixture(scope="module")
def caches(examples, tmp_path_factory) -> dict[str, Path]:
    """The same tiny teacher and examples cached in bfloat16 and in float8."""
    root = tmp_path_factory.mktemp("float8")
    teacher = save_random_teacher(examples, root, seed=8)
    out = {}
    for dtype in ("bfloat16", "float8"):
        out[dtype] = root / dtype
        cache_teacher(teacher, examples, out[dtype], CacheTeacherSettings(
            splits=("train", "test"), dtype=dtype, logits="topk:4", examples_per_shard=32, progress=False))
    return out


def test_e4m3_rule_and_rounding():
    table = e4m3_table()
    finite = np.array([b for b in range(256) if b & 0x7F != 0x7F], dtype=np.uint8)
    torch_values = torch.from_numpy(finite).view(torch.float8_e4m3fn).float().numpy()
    assert np.array_equal(table[finite], torch_values) and np.isnan(table[[0x7F, 0xFF]]).all()
    assert np.nanmax(table) == 448.0
    x = torch.randn(64, 96) * torch.logspace(-3, 2, 96)  # features of very different sizes, like an LLM's
    x[3] = 0  # an all-zero row decodes to zeros (scale 1)
    q, scale = quantize_e4m3(x)
    assert q.dtype == np.uint8 and scale.dtype == np.float32 and scale.shape == (64,) and scale[3] == 1
    back = dequantize_e4m3(q, scale, torch.float32)
    assert torch.equal(back[3], torch.zeros(96))
    assert torch.allclose(back.abs().amax(1), x.abs().amax(1), rtol=1e-6)  # each row's largest is exact
    step = torch.maximum(x.abs(), torch.from_numpy(scale)[:, None] * 2.0**-6) * 2.0**-4  # half a step of 3 mantissa bits
    assert ((back - x).abs() <= step * (1 + 1e-6)).all()
    assert torch.equal(torch.from_numpy(table[q] * scale[:, None]), back)  # the rule alone decodes it


def test_float8_cache_is_half_the_bytes_and_decodes_close_to_bfloat16(caches):
    bf16, f8 = TeacherCache.open(caches["bfloat16"]), TeacherCache.open(caches["float8"])
    ids = bf16.index["example_id"].to_list()
    x, y = bf16.get(ids), f8.get(ids)
    rows = x.hidden_mask
    for layer in bf16.layers:
        a, b = x.hidden[layer][rows].float(), y.hidden[layer][rows].float()
        assert y.hidden[layer].dtype == torch.bfloat16
        cosine = torch.nn.functional.cosine_similarity(a, b, dim=-1)
        assert cosine.min() > 0.995 and cosine.mean() > 0.999, (layer, cosine.min(), cosine.mean())
        assert torch.equal(y.hidden[layer][~rows], torch.zeros_like(y.hidden[layer][~rows]))  # padding stays 0
    # exact logits come from final_hidden, which float8 caches keep in bfloat16: the same bits
    assert torch.equal(x.final_hidden, y.final_hidden) and torch.equal(x.topk_indices, y.topk_indices)
    assert torch.equal(x.topk_values, y.topk_values)

    def hidden_bytes(root: Path) -> int:
        return sum(p.stat().st_size for p in root.glob("shards/*/hidden/**/*") if p.is_file())

    assert hidden_bytes(caches["float8"]) <= 0.6 * hidden_bytes(caches["bfloat16"])
    total = {d: json.loads((caches[d] / "manifest.json").read_text())["totals"]["shard_bytes"] for d in caches}
    assert total["float8"] < 0.7 * total["bfloat16"], total


def test_float8_cache_is_version_3_and_verifies(caches):
    manifest = json.loads((caches["float8"] / "manifest.json").read_text())
    assert manifest["schema_version"] == 3 and manifest["spec"]["dtype"] == "float8"
    assert manifest["dtype"]["hidden"] == "float8_e4m3fn" and manifest["dtype"]["others"] == "bfloat16"
    assert manifest["arrays"]["hidden/layer_2"]["scale"] == "hidden/layer_2.scale"
    assert manifest["arrays"]["final_hidden"]["dtype"] == "bfloat16"
    # the caches version 2 describes keep it: an older c2kd still reads them, their identities are unchanged
    assert json.loads((caches["bfloat16"] / "manifest.json").read_text())["schema_version"] == 2
    report = verify_cache(caches["float8"])
    assert report.ok, report.problems


def test_a_reader_without_c2kd_decodes_the_rule_in_the_schema(caches):
    """zarr + numpy + the e4m3 rule of SCHEMA.md give what TeacherCache gives."""
    cache = TeacherCache.open(caches["float8"])
    shard = cache.index.filter(cache.index["shard"] == 0)
    store = caches["float8"] / "shards" / "shard-00000"
    group = zarr.open_group(str(store), mode="r")
    assert group.attrs["schema_version"] == 3
    data, scales = group["hidden/layer_3"], group["hidden/layer_3.scale"]
    assert data.dtype == np.uint8 and data.attrs["c2kd_logical_dtype"] == "float8_e4m3fn"
    assert data.attrs["c2kd_scale"] == "hidden/layer_3.scale" and scales.dtype == np.float32
    first, length = int(shard["token_offset"][1]), int(shard["token_length"][1])
    decoded = e4m3_table()[data[first : first + length]] * scales[first : first + length][:, None]
    got = cache.get([int(shard["example_id"][1])]).hidden[3][0, :length]
    assert torch.equal(torch.from_numpy(decoded).to(torch.bfloat16), got)


def test_an_old_reader_refuses_a_float8_cache(caches, monkeypatch):
    monkeypatch.setattr(S, "KNOWN_SCHEMA_VERSIONS", (2,))
    TeacherCache.open(caches["bfloat16"])  # version 2 caches: read as ever
    with pytest.raises(CacheError, match="cache schema version 3; this c2kd reads version"):
        TeacherCache.open(caches["float8"])


def test_a_float8_cache_trains_a_student(caches, examples, tmp_path):
    from c2kd.student.distill import DistillRecipe, distill

    record = distill(caches["float8"], examples.root, tmp_path / "student", DistillRecipe(student="micro", max_val=4),
                     {"max_steps": 2, "batch_size": 8, "progress": False})
    assert record["final_step"] == 2


def test_float8_with_full_logits_is_one_line_and_writes_nothing(examples, tmp_path):
    with pytest.raises(C2KDError, match="--dtype float8 with --logits full"):
        CacheTeacherSettings(dtype="float8", logits="full")
    with pytest.raises(CacheError, match="--dtype float8 with --logits full"):
        S.CacheSpec(layers=(1,), hidden_size=4, vocab_size=8, dtype="float8", logits="full")
    result = CliRunner().invoke(app, ["cache-teacher", "--teacher", str(tmp_path), "--data", str(examples.root),
                                      "--out", str(tmp_path / "c"), "--dtype", "float8", "--logits", "full"])
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 1 and len(lines) == 1 and "--logits full" in lines[0], result.output
    assert not (tmp_path / "c").exists()
    with pytest.raises(C2KDError, match="--dtype 'float4'"):
        CacheTeacherSettings(dtype="float4")
