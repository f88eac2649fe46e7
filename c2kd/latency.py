"""Per-request (batch 1) inference latency of the deployable models, measured side by side.

Latency is what a device serving one user at a time pays: one request = score the 20 stored
candidates of one example. Requests of all models are interleaved round-robin in one loop, so
a slow spell of a noisy machine hits every model alike and the ratios stay meaningful.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import polars as pl
import torch

from c2kd.recmodel.model import RecLM
from c2kd.recmodel.prompts import PromptEncoder, encode_frame
from c2kd.sasrec.model import SASRec
from c2kd.evaluate import rank_scores

Request = Callable[[int], object]


def reclm_request(model: RecLM, frame: pl.DataFrame, titles: Sequence[str]) -> Request:
    """A function scoring the candidates of row i of `frame` with `model`, one prompt at a time."""
    encoder = PromptEncoder(model.tokenizer, model.spec.format, titles)
    prompts = encode_frame(encoder, frame, with_target=False)
    candidates = torch.tensor(frame["candidates"].to_list(), dtype=torch.long)
    model.eval()

    @torch.no_grad()
    def request(i: int) -> object:
        return rank_scores(model, encoder, prompts[i : i + 1], candidates[i : i + 1]).candidates

    return request


def sasrec_request(model: SASRec, frame: pl.DataFrame) -> Request:
    """A function scoring the candidates of row i of `frame` with SASRec."""
    max_len = model.spec.max_len
    rows = []
    for history in frame["history"].to_list():
        h = history[-max_len:]
        rows.append([0] * (max_len - len(h)) + h)
    seq = torch.tensor(rows, dtype=torch.long)
    candidates = torch.tensor(frame["candidates"].to_list(), dtype=torch.long)
    model.eval()

    @torch.no_grad()
    def request(i: int) -> object:
        return model.last_scores(seq[i : i + 1]).gather(1, candidates[i : i + 1])

    return request


def interleaved_times(requests: dict[str, Request], num_requests: int, warmup: int = 5) -> dict[str, list[float]]:
    """Milliseconds of each request for each named model; requests alternate between models (so a
    change of load on a shared machine hits them all alike)."""
    for i in range(warmup):
        for request in requests.values():
            request(i)
    times: dict[str, list[float]] = {name: [] for name in requests}
    for i in range(num_requests):
        for name, request in requests.items():
            start = time.perf_counter()
            request(i)
            times[name].append(1000.0 * (time.perf_counter() - start))
    return times


def interleaved_latency(requests: dict[str, Request], num_requests: int, warmup: int = 5) -> dict[str, float]:
    """Median milliseconds per request for each named model (see `interleaved_times`)."""
    return {name: statistics.median(ts) for name, ts in interleaved_times(requests, num_requests, warmup).items()}
