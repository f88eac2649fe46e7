"""The fixed text of both prompt formats (the word-level vocabulary must cover it)."""

# Template pieces; texts that start a new word carry a leading space so that BPE tokenizers see
# the same word boundaries as in running text (word-level tokenizers ignore the spaces).
IDS_HISTORY, IDS_CANDIDATES, IDS_NEXT = "history:", " candidates:", " next:"
LLARA_HISTORY, LLARA_CHOOSE, LLARA_ANSWER = "This user has watched", " Choose the next movie from:", " Answer:"
LLARA_SEP, LLARA_END = ",", "."


def template_texts() -> list[str]:
    """All template text of both formats (the word-level vocabulary must cover it)."""
    return [IDS_HISTORY, IDS_CANDIDATES, IDS_NEXT, LLARA_HISTORY, LLARA_CHOOSE, LLARA_ANSWER, LLARA_SEP, LLARA_END]
