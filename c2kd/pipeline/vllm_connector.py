"""vLLM's own hidden-state extraction, read back in memory: the compiled-graph path of the vLLM backend.

vLLM's `extract_hidden_states` method (a speculative-decoding "drafter" that drafts nothing)
collects the outputs of chosen decoder layers — EAGLE-3's auxiliary states, which models with
that interface return from their compiled forward — and writes them into a KV cache of their
own, one "head" per layer. Its reference connector saves them to files on a later engine step;
in an offline `generate` no later step comes for the last requests, and its copy uses CUDA
streams. This connector reads them in the same step instead, from the worker's KV cache, into
memory that c2kd collects with `collective_rpc` (`pop_states`). No hooks, no eager mode.

Scheduler side: for every scheduled request, its prompt length and blocks (of the hidden-state
cache group); once a request's prompt is complete in a step, that step's metadata names it.
Worker side (`wait_for_save`, which vLLM calls after the drafter ran): gather its rows.

Imported only inside vLLM (`kv_connector_module_path`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
)

CONNECTOR = "StatesConnector"


@dataclass
class _Prompt:
    """Scheduler side: a request whose prompt is not yet all in the cache."""

    length: int
    blocks: list[int]
    computed: int  # prompt tokens in the cache before this step


@dataclass
class Ready(KVConnectorMetadata):
    """Requests whose whole prompt is in the hidden-state cache after this step: id -> (length, blocks)."""

    requests: dict[str, tuple[int, list[int]]] = field(default_factory=dict)


class StatesConnector(ExampleHiddenStatesConnector):
    """ExampleHiddenStatesConnector's cache layout, read in the step that fills it, kept in memory."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._open: dict[str, _Prompt] = {}  # scheduler side
        self.states: dict[str, torch.Tensor] = {}  # worker: id -> [prompt length, layers, d]

    # ---------------------------------------------------------------- scheduler side

    def build_connector_meta(self, scheduler_output) -> Ready:
        group, ready = self._cache_kv_group_id, Ready()
        for new in scheduler_output.scheduled_new_reqs:
            length = len(new.prompt_token_ids) if new.prompt_token_ids is not None else len(new.prompt_embeds)
            self._open[new.req_id] = _Prompt(length, list(new.block_ids[group]), new.num_computed_tokens)
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            prompt, blocks = self._open.get(rid), cached.new_block_ids[i]
            if prompt is None:
                continue
            if blocks is not None:  # a resumed (preempted) request starts over in new blocks
                prompt.blocks = [*([] if rid in cached.resumed_req_ids else prompt.blocks), *blocks[group]]
            prompt.computed = cached.num_computed_tokens[i]
        for rid, scheduled in scheduler_output.num_scheduled_tokens.items():
            prompt = self._open.get(rid)
            if prompt is not None and prompt.computed + scheduled >= prompt.length:
                ready.requests[rid] = (prompt.length, prompt.blocks)
                del self._open[rid]
        return ready

    def request_finished(self, request, block_ids):
        self._open.pop(request.request_id, None)
        return False, None  # read in the step that completed the prompt: nothing to hold

    def get_finished(self, finished_req_ids):
        return None, None

    # ---------------------------------------------------------------- worker side

    def wait_for_save(self) -> None:
        if not self._is_tp_rank_zero or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, Ready):
            return
        size = self._block_size
        for rid, (length, blocks) in meta.requests.items():
            slots = (torch.tensor(blocks)[:, None] * size + torch.arange(size)).flatten()[:length]
            slots = slots.to(self._kv_cache.device)
            # [blocks, layers, block size, d]: copied now, the blocks are reused once the request ends
            self.states[rid] = self._kv_cache[slots // size, :, slots % size].to("cpu", torch.float32, copy=True)


def pop_states(worker) -> dict:
    """In the worker: {vLLM request id: [prompt length, layers, d]} gathered since the last call."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    connector = get_kv_transfer_group()
    states, connector.states = connector.states, {}
    return {"states": states}
