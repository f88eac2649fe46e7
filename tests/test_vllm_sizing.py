"""The vLLM engine's memory is sized from the machine, not a fixed share (vllm_backend.engine_memory).

No vLLM needed: the sizing is arithmetic on what the machine reports. The engine on a real
(CPU) machine with a Gemma 3 teacher is in test_vllm_backend.py.
"""

from __future__ import annotations

import pytest

from c2kd.errors import C2KDError
from c2kd.pipeline.cache_teacher import CacheTeacherSettings
from c2kd.pipeline.vllm_backend import (
    CPU_FREE_SHARE,
    DEDICATED_GPU_SHARE,
    GIB,
    MAX_SEQS,
    engine_memory,
    free_cpu_memory,
    kv_bytes_per_token,
)

GEMMA3_270M = {"num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
               "hidden_size": 640}


def test_a_dedicated_gpu_gets_vllms_usual_share_and_a_shared_one_what_is_free():
    empty_80gb = (79 * GIB, 80 * GIB)
    assert engine_memory(None, 512, 1000, empty_80gb, 0) == {"gpu_memory_utilization": DEDICATED_GPU_SHARE}
    # 16 GiB already held (this process's copy of an 8B teacher): the engine takes what is left, less a margin
    share = engine_memory(None, 512, 1000, (64 * GIB, 80 * GIB), 0)["gpu_memory_utilization"]
    assert 0.7 <= share <= 0.8 and share * 80 < 64
    assert share * 80 * GIB > 16 * GIB  # room for an 8B teacher's bfloat16 weights, which 0.2 was not
    with pytest.raises(C2KDError, match="GPU has 3.0 of 80.0 GiB free.*--vllm-memory"):
        engine_memory(None, 512, 1000, (3 * GIB, 80 * GIB), 0)


def test_the_cpu_gets_a_kv_cache_the_run_can_use_within_the_free_memory():
    per_token = kv_bytes_per_token(GEMMA3_270M, 2)
    assert per_token == 2 * 18 * 1 * 256 * 2
    plenty = engine_memory(None, 300, per_token, None, 64 * GIB)
    assert plenty == {"kv_cache_memory_bytes": MAX_SEQS * 300 * per_token}  # no more than the scheduler can fill
    tight = engine_memory(None, 300, per_token, None, GIB // 2)["kv_cache_memory_bytes"]
    assert tight == int(CPU_FREE_SHARE * GIB // 2) and tight >= 300 * per_token
    with pytest.raises(C2KDError, match="vLLM on the CPU: .* one prompt of 300 tokens"):
        engine_memory(None, 300, per_token, None, 300 * per_token)  # half of it cannot hold one prompt
    assert 0 < free_cpu_memory()


def test_an_explicit_share_wins_and_is_checked():
    assert engine_memory(0.6, 300, 1000, None, GIB) == {"gpu_memory_utilization": 0.6}
    assert engine_memory(0.3, 300, 1000, (79 * GIB, 80 * GIB), 0) == {"gpu_memory_utilization": 0.3}
    with pytest.raises(C2KDError, match="--vllm-memory 1.5"):
        engine_memory(1.5, 300, 1000, None, GIB)
    with pytest.raises(C2KDError, match="--vllm-memory 0.5: .*with --backend vllm only"):
        CacheTeacherSettings(vllm_memory=0.5)


def test_kv_bytes_read_nested_text_configs_and_default_head_sizes():
    llama = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}
    assert kv_bytes_per_token(llama, 2) == 2 * 32 * 8 * 128 * 2  # 128 KiB per token: Llama-3-8B
    assert kv_bytes_per_token({"text_config": GEMMA3_270M}, 4) == kv_bytes_per_token(GEMMA3_270M, 4)
