"""`RecLM`: any Hugging Face causal LM wrapped as a next-item recommender (teacher and student alike).

The wrapper owns the hybrid item embeddings: a frozen table of SASRec item embeddings and an MLP
projector (Linear -> GELU -> Linear, SASRec width -> LM width). In `llara` prompts the projected
embedding REPLACES the `<slot>` token's embedding; in `ids` prompts it is ADDED to the item
token's embedding wherever an item token is read.

The LM head runs only where logits are read (DESIGN §2): at the answer positions when training
(`forward(labels=...)`), at the last position for ranking, and for `ids` ranking only on the item
tokens' rows (`item_scores`). With `item_head="hybrid"` (ids only), item i is scored with its
token row PLUS its projected SASRec embedding, so the output side starts from SASRec's item
geometry (E4SRec/LLaRA-style hybrid items, on the way out as on the way in).

A pretrained model keeps its vocabulary frozen and trains only the rows of the tokens added for
items (`frozen_vocab`, see `added_tokens.py`); models built from a preset or a narrowed config
train their whole (own) table.

A saved model folder holds the LM (`save_pretrained`, safetensors; added rows written into the
tables), the tokenizer, `projector.safetensors`, `item_embeddings.safetensors` and `reclm.json`.
"""

from __future__ import annotations

import json
import os
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from c2kd.errors import C2KDError
from c2kd.recmodel import hf
from c2kd.recmodel.added_tokens import AddedTokenRows
from c2kd.recmodel.presets import get_preset
from c2kd.recmodel.pretrained import resolve_pretrained
from c2kd.recmodel.prompts import answer_index, check_format, gather_rows
from c2kd.recmodel.tokenizer import add_item_tokens, item_token_ids, slot_token_id
from c2kd.atomic import staged_dir

RECLM_KIND = "reclm"
RECLM_VERSION = 1
SPEC_FILE = "reclm.json"
PROJECTOR_FILE = "projector.safetensors"
ITEM_EMBEDDINGS_FILE = "item_embeddings.safetensors"
ITEM_EMBEDDINGS_KEY = "item_embeddings"
ITEM_HEADS = ("token", "hybrid")


@dataclass
class RecLMSpec:
    """What a saved recommender is: prompt format, catalog, token ids and where it came from."""

    format: str
    num_items: int
    item_token_ids: list[int]  # indexed by item id; [0] is the pad token
    slot_token_id: int
    data_fingerprint: str
    base: str  # human-readable description of the underlying LM
    preset: str | None
    sasrec_dim: int
    projector_hidden: int
    item_head: str = "token"  # token | hybrid (ids: item rows + projected SASRec embeddings)
    frozen_vocab: bool = False  # pretrained vocabulary frozen; only the added tokens' rows train

    def to_json(self) -> dict:
        return {"kind": RECLM_KIND, "version": RECLM_VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, data: dict, source: str) -> RecLMSpec:
        if data.get("kind") != RECLM_KIND or data.get("version") != RECLM_VERSION:
            raise C2KDError(
                f"{source}: kind {data.get('kind')!r} v{data.get('version')!r}, expected {RECLM_KIND!r} v{RECLM_VERSION}"
            )
        required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
        missing = required - set(data)
        if missing:
            raise C2KDError(f"{source}: missing fields {sorted(missing)}")
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


@dataclass
class RecLMOutput:
    """`logits`: [N, V] at the N answer positions (batch-major) when labels were given, else
    [B, T or logits_to_keep, V]. `loss`: cross-entropy on the answer tokens (L_LM).
    `hidden_states[l]`: output of layer l (index L is final-normed), when asked. `item_loss`:
    cross-entropy over the catalog where `item_labels` named an item (`ids`)."""

    logits: Tensor | None
    loss: Tensor | None = None
    hidden_states: tuple[Tensor, ...] | None = None
    cache: Any = None
    item_loss: Tensor | None = None


class RecLM(nn.Module):
    """A causal LM + item projector; see the module docstring."""

    def __init__(
        self,
        lm: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        item_embeddings: torch.Tensor,
        fmt: str,
        data_fingerprint: str = "",
        base: str = "",
        preset: str | None = None,
        projector_hidden: int | None = None,
        item_head: str = "token",
        frozen_vocab: bool = False,
    ):
        super().__init__()
        check_format(fmt)
        if item_head not in ITEM_HEADS:
            raise C2KDError(f"item head {item_head!r}: expected one of {', '.join(ITEM_HEADS)}")
        if item_head == "hybrid" and fmt != "ids":
            raise C2KDError("the hybrid item head scores item tokens; it needs the ids prompt format")
        if item_embeddings.dim() != 2 or item_embeddings.shape[0] < 2:
            raise C2KDError(f"item_embeddings must be [num_items + 1, dim], got {tuple(item_embeddings.shape)}")
        num_items = item_embeddings.shape[0] - 1
        self.lm = lm
        self.tokenizer = tokenizer
        width = hf.text_config(lm).hidden_size
        hidden = projector_hidden or width
        self.projector = nn.Sequential(
            nn.Linear(item_embeddings.shape[1], hidden), nn.GELU(), nn.Linear(hidden, width)
        )
        # A buffer, not a parameter: the SASRec embeddings are frozen and travel with .to(device).
        self.register_buffer("item_embeddings", item_embeddings.detach().float().clone())
        token_ids = item_token_ids(tokenizer, num_items)
        self.register_buffer("_item_token_ids", torch.tensor(token_ids, dtype=torch.long), persistent=False)
        if hf.base_model(lm).get_input_embeddings().num_embeddings < len(tokenizer):
            raise C2KDError(
                f"the LM has {hf.base_model(lm).get_input_embeddings().num_embeddings} token embeddings but the "
                f"tokenizer {len(tokenizer)} tokens; resize_token_embeddings first"
            )
        if getattr(hf.base_model(lm).get_output_embeddings(), "bias", None) is not None:
            raise C2KDError(f"{type(hf.base_model(lm)).__name__}: an LM head with a bias is not supported")
        self.added: AddedTokenRows | None = None
        self.spec = RecLMSpec(
            format=fmt, num_items=num_items, item_token_ids=token_ids, slot_token_id=slot_token_id(tokenizer),
            data_fingerprint=data_fingerprint, base=base, preset=preset, sasrec_dim=int(item_embeddings.shape[1]),
            projector_hidden=hidden, item_head=item_head, frozen_vocab=False,
        )
        if frozen_vocab:
            self.freeze_vocabulary()

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_preset(
        cls,
        name: str,
        tokenizer: PreTrainedTokenizerBase,
        item_embeddings: torch.Tensor,
        fmt: str,
        seed: int = 0,
        data_fingerprint: str = "",
        item_head: str = "token",
    ) -> RecLM:
        """A Llama model of a named size with random weights (seeded), vocab = the tokenizer,
        tied input/output embeddings."""
        preset = get_preset(name)
        if tokenizer.pad_token_id is None or tokenizer.eos_token_id is None:
            raise C2KDError("the tokenizer needs pad and eos tokens")
        config = preset.llama_config(len(tokenizer), tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            lm = AutoModelForCausalLM.from_config(config)
            return cls(lm, tokenizer, item_embeddings, fmt, data_fingerprint,
                       base=f"llama preset {name} (random init, seed {seed})", preset=name, item_head=item_head)

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        item_embeddings: torch.Tensor,
        fmt: str,
        data_fingerprint: str = "",
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        item_head: str = "token",
    ) -> RecLM:
        """A pretrained LM (a local Hugging Face folder, a `.gguf` file or an alias such as
        "smollm2-135m") with the item and slot tokens added to its own tokenizer and embedding
        table (new rows seeded; the pretrained rows frozen). A folder written by `save` is
        loaded as it is."""
        path = resolve_pretrained(path)
        if (path / SPEC_FILE).is_file():
            model = cls.load(path)
            if model.spec.format != fmt or model.spec.num_items != item_embeddings.shape[0] - 1:
                raise C2KDError(
                    f"{path}: a saved recommender for format {model.spec.format!r} and {model.spec.num_items} items, "
                    f"asked for {fmt!r} and {item_embeddings.shape[0] - 1}"
                )
            return model
        if path.suffix == ".gguf":
            lm, tokenizer = hf.load_gguf(path, dtype)
        elif path.is_dir() and (path / "config.json").is_file():
            lm, tokenizer = hf.load_folder(path, dtype)
        else:
            raise C2KDError(f"{path}: expected a Hugging Face model folder (with config.json), a .gguf file or a "
                            "model alias (smollm2-135m, gemma3-270m)")
        add_item_tokens(tokenizer, item_embeddings.shape[0] - 1)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            lm.resize_token_embeddings(len(tokenizer), mean_resizing=True)
            lm.config.pad_token_id = tokenizer.pad_token_id
            text = lm.config.get_text_config()
            base = f"{path.name} ({text.model_type}, {text.num_hidden_layers} layers, width {text.hidden_size})"
            return cls(lm, tokenizer, item_embeddings, fmt, data_fingerprint, base=base, item_head=item_head,
                       frozen_vocab=True)

    def _like(self, lm: PreTrainedModel, base: str, frozen_vocab: bool) -> RecLM:
        return RecLM(lm, self.tokenizer, self.item_embeddings, self.spec.format, self.spec.data_fingerprint, base=base,
                     preset=self.spec.preset, projector_hidden=self.spec.projector_hidden, item_head=self.spec.item_head,
                     frozen_vocab=frozen_vocab)

    def truncated(self, num_layers: int) -> RecLM:
        """A student keeping the embeddings (and added rows), the first `num_layers` layers, the final
        norm, the head and the projector of this model (copies; LoRA adapters merged)."""
        if not 1 <= num_layers <= self.num_layers:
            raise C2KDError(f"can keep 1..{self.num_layers} layers, asked for {num_layers}")
        if self.added is not None:
            self.added.write_into(self.lm)
        student = self._like(hf.first_layers(self.lm, num_layers),
                             f"first {num_layers} of {self.num_layers} layers of {self.spec.base}", self.spec.frozen_vocab)
        student.projector.load_state_dict(self.projector.state_dict())
        return student.to(self.device)

    def narrowed(self, width: int, num_layers: int, seed: int = 0) -> RecLM:
        """A random-initialised (seeded) model of this model's family and tokenizer, `width` wide and
        `num_layers` deep; it trains its whole vocabulary table."""
        if width < 1 or num_layers < 1:
            raise C2KDError(f"a narrow model needs width >= 1 and layers >= 1, got {width} x {num_layers}")
        config = hf.narrow_config(self.lm, width, num_layers)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            lm = AutoModelForCausalLM.from_config(config)
            family = hf.text_config(self.lm).model_type
            return self._like(lm, f"{family} {width} wide x {num_layers} layers (random init, seed {seed}), "
                                  f"tokenizer of {self.spec.base}", frozen_vocab=False).to(self.device)

    def freeze_vocabulary(self) -> None:
        """Freeze the LM's token table and head; only the rows of `<slot>` and the item tokens train."""
        if self.added is None:
            self.added = AddedTokenRows(self.lm, [self.spec.slot_token_id, *self.spec.item_token_ids[1:]]).to(self.device)
            self.spec.frozen_vocab = True

    # -- inputs ------------------------------------------------------------------------------
    def projected_items(self, items: Tensor | None = None) -> Tensor:
        """projector(SASRec embedding) of these item ids (default: the whole catalog, row 0 = padding)."""
        table = self.item_embeddings if items is None else self.item_embeddings[items]
        return self.projector(table)

    def embed_inputs(self, input_ids: Tensor, slot_items: Tensor) -> Tensor:
        """Token embeddings with the projected SASRec embedding at every slot position."""
        embedding = self.base_lm().get_input_embeddings()
        tokens = embedding(input_ids)
        if self.added is not None:
            tokens = self.added.embed(input_ids, tokens, hf.embed_scale(embedding))
        mask = slot_items > 0
        if not bool(mask.any()):
            return tokens
        projected = self.projected_items(slot_items[mask]).to(tokens.dtype)
        at_slots = torch.zeros_like(tokens)
        at_slots[mask] = projected
        if self.spec.format == "ids":
            return tokens + at_slots
        return torch.where(mask.unsqueeze(-1), at_slots, tokens)

    # -- outputs -----------------------------------------------------------------------------
    def _softcap(self, logits: Tensor) -> Tensor:
        cap = hf.logit_softcap(self.lm)
        return logits if not cap else torch.tanh(logits / cap) * cap

    def head_logits(self, h: Tensor) -> Tensor:
        """Logits over the whole vocabulary of final (post-norm) states h [..., d]."""
        head = self.base_lm().get_output_embeddings()
        if self.added is not None:
            logits = self.added.patch_logits(self.added.frozen_logits(head, h), h)
        else:
            logits = head(h)
        if self.spec.item_head == "hybrid":
            extra = h @ self.projected_items()[1:].to(h.dtype).T
            logits = logits.index_add(-1, self._item_token_ids[1:], extra.to(logits.dtype))
        return self._softcap(logits)

    def item_rows(self) -> Tensor:
        """[N + 1, d]: the output rows that score each item (row 0, padding, is never a candidate)."""
        ids = self._item_token_ids
        if self.added is not None:
            rows = torch.cat([self.base_lm().get_output_embeddings().weight[ids[:1]], self.added.rows_of(ids[1:])])
        else:
            rows = self.base_lm().get_output_embeddings().weight[ids]
        if self.spec.item_head == "hybrid":
            rows = rows + self.projected_items().to(rows.dtype)
        return rows

    def item_scores(self, h: Tensor) -> Tensor:
        """The item tokens' logits only, [..., N + 1] (column 0 = -inf): `ids` ranking reads nothing else."""
        scores = self._softcap(h @ self.item_rows().to(h.dtype).T)
        scores[..., 0] = float("-inf")
        return scores

    @torch.no_grad()
    def effective_head_weight(self) -> Tensor:
        """[V, d]: the one matrix W with head_logits(h) == h @ Wᵀ (softcap aside): the pretrained head
        with the added rows, plus the projected SASRec embeddings on the item rows when hybrid."""
        weight = self.base_lm().get_output_embeddings().weight.detach().clone()
        if self.added is not None:
            weight[self.added.token_ids] = self.added.out_rows().detach().to(weight.dtype)
        if self.spec.item_head == "hybrid":
            weight[self._item_token_ids[1:]] += self.projected_items()[1:].to(weight.dtype)
        return weight

    # -- the model ---------------------------------------------------------------------------
    def decode(self, input_ids: Tensor, attention_mask: Tensor, slot_items: Tensor, **kwargs: Any) -> Any:
        """The transformer body without any head: `.last_hidden_state` [B, T, d] is the final
        (post-norm) state the head reads, `.hidden_states[l]` (output_hidden_states=True) the
        output of layer l. kwargs go to the Hugging Face decoder (position_ids, cache, ...)."""
        return hf.decoder(self.lm)(inputs_embeds=self.embed_inputs(input_ids, slot_items), attention_mask=attention_mask,
                                   **kwargs)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        slot_items: Tensor,
        labels: Tensor | None = None,
        output_hidden_states: bool = False,
        position_ids: Tensor | None = None,
        cache: Any = None,
        use_cache: bool = False,
        logits_to_keep: int = 0,
        item_labels: Tensor | None = None,
    ) -> RecLMOutput:
        """With `labels` the head runs at the answer positions only (labels[p + 1] != -100) and the
        loss is their cross-entropy; without, at the last `logits_to_keep` positions (0 = all).
        `item_labels` [B, T] (`ids`): positions p with item_labels[p] > 0 are also scored over the
        catalog's item rows (`item_scores`) against that item, as `item_loss`.
        `position_ids`, `cache` and `use_cache` serve incremental decoding."""
        out = self.decode(input_ids, attention_mask, slot_items, position_ids=position_ids, cache=cache,
                          use_cache=use_cache, output_hidden_states=output_hidden_states)
        h = out.last_hidden_state
        loss = None
        if labels is not None:
            positions, mask = answer_index(labels)
            logits = self.head_logits(gather_rows(h, positions)[mask])
            targets = gather_rows(labels, positions + 1)[mask]
            loss = F.cross_entropy(logits.float(), targets)
        else:
            logits = self.head_logits(h[:, -logits_to_keep:] if logits_to_keep else h)
        item_loss = None
        if item_labels is not None:
            if self.spec.format != "ids":
                raise C2KDError("item_labels score item tokens; they need the ids prompt format")
            at = item_labels > 0
            item_loss = F.cross_entropy(self.item_scores(h[at]).float(), item_labels[at]) if bool(at.any()) else h.sum() * 0
        return RecLMOutput(logits, loss, out.hidden_states, out.cache if use_cache else None, item_loss)

    # -- views used by caches and losses -----------------------------------------------------
    def base_lm(self) -> PreTrainedModel:
        """The Hugging Face model under any peft wrapper (weights shared, not copied)."""
        return hf.base_model(self.lm)

    @property
    def device(self) -> torch.device:
        return self.item_embeddings.device

    @property
    def num_layers(self) -> int:
        return int(hf.text_config(self.lm).num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        return int(hf.text_config(self.lm).hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.base_lm().get_output_embeddings().weight.shape[0])

    @property
    def final_norm(self) -> nn.Module:
        return hf.final_norm(self.lm)

    @property
    def item_token_ids(self) -> Tensor:
        """LongTensor [N+1]: token id of each item (index 0: pad token)."""
        return self._item_token_ids

    @property
    def fmt(self) -> str:
        return self.spec.format

    def non_embedding_parameters(self) -> int:
        """Parameters of the LM itself without its token embedding table and output head (and
        without any peft adapter weights): the size that C2KD's compression ratio refers to."""
        base = self.base_lm()
        embedding_modules = {id(base.get_input_embeddings()), id(base.get_output_embeddings())}
        prefixes = tuple(f"{name}." for name, module in base.named_modules() if id(module) in embedding_modules)
        adapter_marks = ("lora_", "trainable_tokens_", "modules_to_save.")
        total, seen = 0, set()
        for name, p in base.named_parameters(remove_duplicate=False):
            if name.startswith(prefixes) or any(mark in name for mark in adapter_marks) or id(p) in seen:
                continue
            seen.add(id(p))
            total += p.numel()
        return total

    # -- persistence -------------------------------------------------------------------------
    def save(self, out_dir: str | os.PathLike) -> Path:
        """Write the model folder atomically (a temp folder renamed into place); LoRA merged."""
        out_dir = Path(out_dir)
        if self.added is not None:
            self.added.write_into(self.lm)
        lm = hf.plain_copy(self.lm) if hf.is_peft(self.lm) else self.lm
        with staged_dir(out_dir, replace=True) as tmp:
            lm.save_pretrained(tmp, safe_serialization=True)
            _mark_config(tmp / "config.json")
            self.tokenizer.save_pretrained(tmp)
            save_file({k: v.detach().cpu().contiguous() for k, v in self.projector.state_dict().items()}, tmp / PROJECTOR_FILE)
            save_file({ITEM_EMBEDDINGS_KEY: self.item_embeddings.detach().cpu().contiguous()}, tmp / ITEM_EMBEDDINGS_FILE)
            (tmp / SPEC_FILE).write_text(json.dumps(self.spec.to_json(), indent=2))
        return out_dir

    @classmethod
    def load(cls, model_dir: str | os.PathLike, device: str | torch.device | None = None, dtype: torch.dtype | None = None) -> RecLM:
        """Read a folder written by `save`."""
        model_dir = Path(model_dir)
        spec_path = model_dir / SPEC_FILE
        if not spec_path.is_file():
            raise C2KDError(f"{model_dir}: not a saved recommender LM (no {SPEC_FILE})")
        try:
            spec = RecLMSpec.from_json(json.loads(spec_path.read_text()), str(spec_path))
        except (json.JSONDecodeError, UnicodeDecodeError, TypeError) as e:
            raise C2KDError(f"{spec_path}: not a valid recommender spec ({e})") from None
        for name in (PROJECTOR_FILE, ITEM_EMBEDDINGS_FILE):
            if not (model_dir / name).is_file():
                raise C2KDError(f"{model_dir}: missing {name}")
        lm, tokenizer = hf.load_folder(model_dir, dtype if dtype is not None else "auto")
        table = load_file(model_dir / ITEM_EMBEDDINGS_FILE)
        if ITEM_EMBEDDINGS_KEY not in table:
            raise C2KDError(f"{model_dir / ITEM_EMBEDDINGS_FILE}: no tensor {ITEM_EMBEDDINGS_KEY!r}")
        model = cls(
            lm, tokenizer, table[ITEM_EMBEDDINGS_KEY], spec.format, spec.data_fingerprint, base=spec.base,
            preset=spec.preset, projector_hidden=spec.projector_hidden, item_head=spec.item_head,
            frozen_vocab=spec.frozen_vocab,
        )
        if model.spec.item_token_ids != spec.item_token_ids or model.spec.num_items != spec.num_items:
            raise C2KDError(f"{spec_path}: item token ids do not match the saved tokenizer")
        model.projector.load_state_dict(load_file(model_dir / PROJECTOR_FILE))
        if device is not None:
            model.to(device)
        return model


def _mark_config(path: Path) -> None:
    # Run folders say what they are in config.json's "kind"; the LM config keeps its own fields.
    config = json.loads(path.read_text())
    config["kind"] = RECLM_KIND
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
