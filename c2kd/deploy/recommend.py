"""`c2kd recommend`: what a model recommends to one user, with titles and scores.

A known user is shown their test example: the recent history and the 20 stored candidates, ranked
(the held-out next item is marked). A made-up user is a list of titles; their candidates are the
ones given, or else the 20 items most often watched in the training data that they have not
watched. The models choose among the candidates of their prompt: that is what they were trained
and evaluated on. The model is a saved recommender folder (PyTorch) or an exported ranker
(onnxruntime only).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from c2kd.errors import C2KDError
from c2kd.data.examples import NUM_CANDIDATES, ExampleSet


@dataclass
class Request:
    history: list[int]
    candidates: list[int]
    target: int | None = None  # the held-out next item, when known


def user_request(examples: ExampleSet, user: int) -> Request:
    """The test example of a user of the prepared data (internal user id, 0..U-1)."""
    test = examples.split("test")
    users = test["user"]
    # compared as Python ints first: a number beyond the column's 64 bits would overflow the filter
    rows = test.filter(users == user) if users.min() <= user <= users.max() else test.clear()
    if rows.height == 0:
        raise C2KDError(f"--user {user}: no such user in {examples.root} (users are numbered {users.min()}..{users.max()})")
    row = rows.row(0, named=True)
    return Request(list(row["history"]), list(row["candidates"]), int(row["target"]))


def _items_by_title(examples: ExampleSet) -> dict[str, int]:
    return {title.casefold(): item for item, title in enumerate(examples.titles()) if item and title}


def _parse_titles(text: str, known: dict[str, int], option: str) -> list[int]:
    titles = [t.strip() for t in text.split(";") if t.strip()]
    if not titles:
        raise C2KDError(f"{option}: give titles separated by ';', e.g. \"Toy Story; Heat\"")
    unknown = [t for t in titles if t.casefold() not in known]
    if unknown:
        raise C2KDError(f"{option}: unknown title {unknown[0]!r} (titles are as `c2kd prepare` cleaned them: "
                        "no year, a leading article, e.g. 'The Usual Suspects')")
    return [known[t.casefold()] for t in titles]


def made_up_request(examples: ExampleSet, history: str, candidates: str | None = None) -> Request:
    """A user given as watched titles ("A; B; C"), with given or popular candidates. A candidate
    already in the history is refused: the models rank what comes next, never an item seen."""
    known = _items_by_title(examples)
    watched = _parse_titles(history, known, "--history")
    if candidates is not None:
        chosen = _parse_titles(candidates, known, "--candidates")
        seen = [item for item in chosen if item in set(watched)]
        if seen:
            raise C2KDError(f"--candidates: {examples.titles()[seen[0]]!r} is already in --history; the models rank "
                            "items not yet watched (leave it out of --candidates)")
        if len(set(chosen)) != len(chosen):
            twice = next(item for item in chosen if chosen.count(item) > 1)
            raise C2KDError(f"--candidates: {examples.titles()[twice]!r} is given twice")
        return Request(watched, chosen)
    train = examples.split("train")
    counts = Counter(i for h in train["history"].to_list() for i in h)
    counts.update(train["target"].to_list())
    popular = [i for i, _ in counts.most_common() if i not in set(watched)][:NUM_CANDIDATES]
    return Request(watched, popular)


def rank(model: str | Path, request: Request, examples: ExampleSet, top: int) -> list[tuple[int, float]]:
    """The `top` candidates by the model's score: an exported ranker folder or a saved recommender."""
    from c2kd.deploy.runtime import RANKER_FILE, Ranker, RankerError

    model = Path(model)
    if (model / RANKER_FILE).is_file():
        try:
            ranker = Ranker.load(model)
            _check_data(model, ranker.spec.get("data_fingerprint"), examples)
            return ranker.recommend(request.history, request.candidates, top)
        except RankerError as e:
            raise C2KDError(str(e)) from None
    import torch

    from c2kd.evaluate import rank_scores
    from c2kd.recmodel.model import RecLM
    from c2kd.recmodel.prompts import PromptEncoder

    titles = examples.titles()
    reclm = RecLM.load(model).eval()
    _check_data(model, reclm.spec.data_fingerprint, examples)
    encoder = PromptEncoder(reclm.tokenizer, reclm.spec.format, titles)
    prompt = encoder.encode(0, request.history, request.candidates)
    scores = rank_scores(reclm, encoder, [prompt], torch.tensor([request.candidates])).candidates[0]
    order = torch.argsort(-scores, stable=True)[:top].tolist()
    return [(request.candidates[k], float(scores[k])) for k in order]


def _check_data(model: Path, fingerprint: str | None, examples: ExampleSet) -> None:
    if fingerprint and fingerprint != examples.fingerprint:
        raise C2KDError(f"{model} was trained on other data than {examples.root} (fingerprints differ); "
                        "item ids would not match")
