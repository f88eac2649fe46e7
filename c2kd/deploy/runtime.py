"""Ranking items with an exported recommender: onnxruntime and numpy only, no PyTorch.

    ranker = Ranker.load("runs/student-onnx")
    scores = ranker.scores(history=[50, 181, 172], candidates=[...])         # one score per candidate
    top = ranker.recommend(history=[50, 181, 172], candidates=[...], top=10)  # [(item, score), ...]

Prompts are built from item ids exactly as `c2kd.recmodel.prompts` builds an `ids` prompt (bos,
"history:", the items, "candidates:", the candidates, "next:"), in the exported model's small
vocabulary (`ranker.json`). The models choose among the candidates in their prompt (that is what
they were trained and evaluated on), so a recommendation ranks given candidates.
An ONNX ranker needs only onnxruntime and numpy: this module imports torch only to run an
ExecuTorch program through its Python bindings.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

RANKER_KIND = "c2kd-ranker"
RANKER_FILE = "ranker.json"


class RankerError(ValueError):
    """An exported folder or a request the ranker cannot serve (the message says which)."""


@dataclass
class Ranker:
    run: Callable[[np.ndarray, np.ndarray], np.ndarray]  # (input_ids, attention_mask) -> scores
    spec: dict
    folder: Path

    @classmethod
    def load(cls, folder: str | Path, threads: int = 1) -> Ranker:
        folder = Path(folder)
        try:
            spec = json.loads((folder / RANKER_FILE).read_text())
        except (OSError, ValueError):
            raise RankerError(f"{folder}: not an exported ranker (no readable {RANKER_FILE})") from None
        model = folder / spec.get("model_file", "model.onnx")
        if spec.get("kind") != RANKER_KIND or not model.is_file():
            raise RankerError(f"{folder}: not an exported ranker ({RANKER_FILE} of kind {RANKER_KIND!r} + {model.name})")
        run = _executorch(model) if model.suffix == ".pte" else _onnxruntime(model, threads)
        return cls(run, spec, folder)

    @property
    def num_items(self) -> int:
        return int(self.spec["num_items"])

    def title(self, item: int) -> str:
        return self.spec["titles"][item]

    def _check(self, items: Sequence[int]) -> None:
        bad = [i for i in items if not 1 <= int(i) <= self.num_items]
        if bad:
            raise RankerError(f"item id(s) {bad[:5]} outside 1..{self.num_items}")

    def prompt(self, history: Sequence[int], candidates: Sequence[int] = ()) -> list[int]:
        """The `ids` prompt of these items, in the exported vocabulary."""
        self._check([*history, *candidates])
        p, offset = self.spec["pieces"], int(self.spec["item_token_offset"]) - 1
        return [*p["bos"], *p["history"], *(offset + int(i) for i in history), *p["candidates"],
                *(offset + int(i) for i in candidates), *p["next"]]

    def catalog_scores(self, prompts: Sequence[Sequence[int]]) -> np.ndarray:
        """[B, N + 1] scores of every item (column 0, padding, is -inf) for a batch of prompts."""
        width = max(len(p) for p in prompts)
        if width > self.spec.get("max_prompt", width):
            raise RankerError(f"a prompt of {width} tokens: this program takes at most {self.spec['max_prompt']}")
        step = int(self.spec.get("max_batch", len(prompts)))  # a program with a fixed batch runs in chunks
        if step < len(prompts):
            return np.concatenate([self.catalog_scores(prompts[i : i + step]) for i in range(0, len(prompts), step)])
        ids = np.full((len(prompts), width), int(self.spec["pad_id"]), dtype=np.int64)
        mask = np.zeros((len(prompts), width), dtype=np.int64)
        for row, p in enumerate(prompts):  # left-padded: every prompt ends in the last column
            ids[row, width - len(p):] = p
            mask[row, width - len(p):] = 1
        scores = self.run(ids, mask)
        scores[:, 0] = -np.inf
        return scores

    def scores(self, history: Sequence[int], candidates: Sequence[int]) -> np.ndarray:
        """The score of each candidate (in the order given) after this history."""
        return self.catalog_scores([self.prompt(history, candidates)])[0, np.asarray(candidates, dtype=np.int64)]

    def recommend(self, history: Sequence[int], candidates: Sequence[int], top: int = 10) -> list[tuple[int, float]]:
        """The `top` candidates by score, best first."""
        scores = self.scores(history, candidates)
        order = np.argsort(-scores, kind="stable")[:top]
        return [(int(candidates[k]), float(scores[k])) for k in order]


def _onnxruntime(path: Path, threads: int) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")  # no busy-waiting between requests
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return lambda ids, mask: session.run(["scores"], {"input_ids": ids, "attention_mask": mask})[0]


def _executorch(path: Path) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    """An ExecuTorch program through its Python bindings (they take torch tensors: on a device, its
    C++ runtime runs the same .pte without Python)."""
    import torch
    from executorch.runtime import Runtime

    program = Runtime.get().load_program(str(path))
    with _stderr_silenced():  # the XNNPACK backend logs its CPU probing (lines about /sys files)
        method = program.load_method("forward")
    return lambda ids, mask: method.execute([torch.from_numpy(ids), torch.from_numpy(mask)])[0].numpy().copy()


@contextmanager
def _stderr_silenced() -> Iterator[None]:
    """File descriptor 2 to /dev/null for a while: C++ code writes there directly, not through Python."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
