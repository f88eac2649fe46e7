"""Tokenizers for the recommender LM.

From-scratch models get a word-level tokenizer built from the catalog titles and the prompt
templates; pretrained models keep their own tokenizer with the item and slot tokens added.
Either way every item has one token `<item_i>` (the `ids` answer) and `<slot>` marks where a
projected SASRec embedding goes in `llara` prompts.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import AddedToken, Tokenizer, normalizers, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from c2kd.errors import C2KDError
from c2kd.recmodel.templates import template_texts

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SLOT = "<slot>"
SPECIALS = (PAD, BOS, EOS, UNK)


def item_token(item: int) -> str:
    return f"<item_{item}>"


def item_tokens(num_items: int) -> list[str]:
    return [item_token(i) for i in range(1, num_items + 1)]


def _word_pipeline() -> Tokenizer:
    """An empty word-level tokenizer: lowercase, split on whitespace and around punctuation."""
    tok = Tokenizer(WordLevel({UNK: 0}, unk_token=UNK))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    # No decoder: decoding joins the words with single spaces.
    return tok


def words_of(texts: Iterable[str]) -> list[str]:
    """The distinct words the word-level tokenizer makes of `texts`, in first-seen order."""
    pipeline = _word_pipeline()
    seen: dict[str, None] = {}
    for text in texts:
        normalized = pipeline.normalizer.normalize_str(text)
        for word, _ in pipeline.pre_tokenizer.pre_tokenize_str(normalized):
            seen.setdefault(word, None)
    return list(seen)


def build_word_tokenizer(titles: Iterable[str], num_items: int, extra_texts: Iterable[str] = ()) -> PreTrainedTokenizerFast:
    """Word-level tokenizer over the catalog titles plus the prompt template words.

    Vocabulary order: the four specials, `<slot>`, `<item_1>..<item_N>`, then the words.
    `extra_texts` defaults to the template text of both prompt formats.
    """
    if num_items < 1:
        raise C2KDError(f"num_items must be >= 1, got {num_items}")
    texts = list(extra_texts) or template_texts()
    reserved = [*SPECIALS, SLOT, *item_tokens(num_items)]
    vocab = {tok: i for i, tok in enumerate(reserved)}
    for word in words_of([*texts, *titles]):
        if word not in vocab:
            vocab[word] = len(vocab)
    backend = _word_pipeline()
    backend.model = WordLevel(vocab, unk_token=UNK)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK
    )
    # Registered as added tokens so that text containing them maps to one id each.
    tokenizer.add_tokens([SLOT, *item_tokens(num_items)], special_tokens=True)
    return tokenizer


def add_item_tokens(tokenizer: PreTrainedTokenizerBase, num_items: int) -> PreTrainedTokenizerBase:
    """Add `<slot>` and `<item_1>..<item_N>` to a pretrained tokenizer (in place) and make sure it
    has a pad token. Returns the same tokenizer.

    The tokens go straight into the fast tokenizer's backend, which takes milliseconds and gives the
    same ids as `add_tokens`."""
    vocab = tokenizer.get_vocab()  # once: it is rebuilt on every call (262k entries for Gemma)
    missing = [t for t in [SLOT, *item_tokens(num_items)] if t not in vocab]
    if missing:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])
        else:
            tokenizer.add_tokens(missing, special_tokens=True)
    if tokenizer.pad_token is None:
        # Reuse eos: padded positions carry no labels and are masked out of attention.
        if tokenizer.eos_token is not None:
            tokenizer.pad_token = tokenizer.eos_token
        else:
            tokenizer.add_special_tokens({"pad_token": PAD})
    return tokenizer


def item_token_ids(tokenizer: PreTrainedTokenizerBase, num_items: int) -> list[int]:
    """Token id of each item, indexed by item id; index 0 (padding item) maps to the pad token."""
    ids = tokenizer.convert_tokens_to_ids(item_tokens(num_items))
    unk = tokenizer.unk_token_id
    if any(i is None or (unk is not None and i == unk) for i in ids):
        raise C2KDError(f"the tokenizer lacks item tokens <item_1>..<item_{num_items}>; call add_item_tokens first")
    return [int(tokenizer.pad_token_id), *map(int, ids)]


def slot_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    sid = tokenizer.convert_tokens_to_ids(SLOT)
    if sid is None or sid == tokenizer.unk_token_id:
        raise C2KDError("the tokenizer lacks the <slot> token; call add_item_tokens first")
    return int(sid)
