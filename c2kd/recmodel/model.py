"""`RecLM`: any Hugging Face causal LM wrapped as a next-item recommender (teacher and student alike).

The wrapper owns the hybrid item embeddings: a frozen table of SASRec item embeddings and an MLP
projector (Linear -> GELU -> Linear, SASRec width -> LM width). In `llara` prompts the projected
embedding REPLACES the `<slot>` token's embedding; in `ids` prompts it is ADDED to the item
token's embedding. Everything else is the plain LM, so hidden states, logits and the loss are the
Hugging Face ones.

A saved model folder holds the LM (`save_pretrained`, safetensors), the tokenizer,
`projector.safetensors`, `item_embeddings.safetensors` and `reclm.json`.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from c2kd.errors import C2KDError
from c2kd.recmodel.presets import get_preset, resolve_pretrained
from c2kd.recmodel.prompts import check_format
from c2kd.recmodel.tokenizer import add_item_tokens, item_token_ids, slot_token_id

RECLM_KIND = "reclm"
RECLM_VERSION = 1
SPEC_FILE = "reclm.json"
PROJECTOR_FILE = "projector.safetensors"
ITEM_EMBEDDINGS_FILE = "item_embeddings.safetensors"
ITEM_EMBEDDINGS_KEY = "item_embeddings"


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

    def to_json(self) -> dict:
        return {"kind": RECLM_KIND, "version": RECLM_VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, data: dict, source: str) -> RecLMSpec:
        if data.get("kind") != RECLM_KIND or data.get("version") != RECLM_VERSION:
            raise C2KDError(
                f"{source}: kind {data.get('kind')!r} v{data.get('version')!r}, expected {RECLM_KIND!r} v{RECLM_VERSION}"
            )
        fields = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        missing = set(cls.__dataclass_fields__) - set(fields)
        if missing:
            raise C2KDError(f"{source}: missing fields {sorted(missing)}")
        return cls(**fields)


def _is_peft(lm: nn.Module) -> bool:
    # peft can only have wrapped the model if it has been imported.
    if "peft" not in sys.modules:
        return False
    from peft import PeftModel

    return isinstance(lm, PeftModel)


def _plain_copy(lm: nn.Module) -> PreTrainedModel:
    """A plain Hugging Face model with the same weights: LoRA adapters merged, nothing shared."""
    if _is_peft(lm):
        return copy.deepcopy(lm).merge_and_unload()
    return copy.deepcopy(lm)


def _rebuild(lm: PreTrainedModel, config=None, state_dict: dict | None = None) -> PreTrainedModel:
    """A fresh model built from a config, holding the given weights (GGUF-loaded models cannot be
    saved as they are, and truncation needs a smaller config)."""
    config = copy.deepcopy(config if config is not None else lm.config)
    fresh = AutoModelForCausalLM.from_config(config, dtype=lm.dtype)
    state = state_dict if state_dict is not None else lm.state_dict()
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    tied = {k for k in missing if fresh.config.tie_word_embeddings and k.endswith("lm_head.weight")}
    if set(missing) - tied or unexpected:
        raise C2KDError(f"rebuilding {type(lm).__name__}: missing weights {sorted(set(missing) - tied)[:5]}, unexpected {unexpected[:5]}")
    fresh.tie_weights()
    return fresh.to(lm.device)


def _mark_config(path: Path) -> None:
    # Run folders say what they are in config.json's "kind"; the LM config keeps its own fields.
    config = json.loads(path.read_text())
    config["kind"] = RECLM_KIND
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


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
    ):
        super().__init__()
        check_format(fmt)
        if item_embeddings.dim() != 2 or item_embeddings.shape[0] < 2:
            raise C2KDError(f"item_embeddings must be [num_items + 1, dim], got {tuple(item_embeddings.shape)}")
        num_items = item_embeddings.shape[0] - 1
        self.lm = lm
        self.tokenizer = tokenizer
        width = self._text_config().hidden_size
        hidden = projector_hidden or width
        self.projector = nn.Sequential(
            nn.Linear(item_embeddings.shape[1], hidden), nn.GELU(), nn.Linear(hidden, width)
        )
        # A buffer, not a parameter: the SASRec embeddings are frozen and travel with .to(device).
        self.register_buffer("item_embeddings", item_embeddings.detach().float().clone())
        token_ids = item_token_ids(tokenizer, num_items)
        self.register_buffer("_item_token_ids", torch.tensor(token_ids, dtype=torch.long), persistent=False)
        if self.lm.get_input_embeddings().num_embeddings < len(tokenizer):
            raise C2KDError(
                f"the LM has {self.lm.get_input_embeddings().num_embeddings} token embeddings but the tokenizer "
                f"{len(tokenizer)} tokens; resize_token_embeddings first"
            )
        self.spec = RecLMSpec(
            format=fmt,
            num_items=num_items,
            item_token_ids=token_ids,
            slot_token_id=slot_token_id(tokenizer),
            data_fingerprint=data_fingerprint,
            base=base,
            preset=preset,
            sasrec_dim=int(item_embeddings.shape[1]),
            projector_hidden=hidden,
        )

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
            model = cls(lm, tokenizer, item_embeddings, fmt, data_fingerprint, base=f"llama preset {name} (random init, seed {seed})", preset=name)
        return model

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        item_embeddings: torch.Tensor,
        fmt: str,
        data_fingerprint: str = "",
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
    ) -> RecLM:
        """A pretrained LM (a local Hugging Face folder, a `.gguf` file or an alias such as
        "smollm2-135m") with the item and slot tokens added to its own tokenizer and embedding
        table (new rows seeded). A folder written by `save` is loaded as it is."""
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
            if not path.is_file():
                raise C2KDError(f"{path}: GGUF file not found")
            folder, kwargs = str(path.parent), {"gguf_file": path.name}
        elif path.is_dir() and (path / "config.json").is_file():
            folder, kwargs = str(path), {}
        else:
            raise C2KDError(f"{path}: expected a Hugging Face model folder (with config.json) or a .gguf file")
        tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
        lm = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs)
        if "gguf_file" in kwargs:
            lm = _rebuild(lm)  # dequantised GGUF weights in a plain model that save_pretrained accepts
        add_item_tokens(tokenizer, item_embeddings.shape[0] - 1)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            lm.resize_token_embeddings(len(tokenizer))
            lm.config.pad_token_id = tokenizer.pad_token_id
            text = lm.config.get_text_config()
            base = f"{path.name} ({text.model_type}, {text.num_hidden_layers} layers, width {text.hidden_size})"
            return cls(lm, tokenizer, item_embeddings, fmt, data_fingerprint, base=base)

    def truncated(self, num_layers: int) -> RecLM:
        """A student keeping the embeddings, the first `num_layers` layers, the final norm, the head
        and the projector of this model (copies; LoRA adapters merged)."""
        if not 1 <= num_layers <= self.num_layers:
            raise C2KDError(f"can keep 1..{self.num_layers} layers, asked for {num_layers}")
        plain = _plain_copy(self.lm) if _is_peft(self.lm) else self.lm  # _rebuild copies the weights
        config = copy.deepcopy(plain.config)
        text = config.get_text_config()
        text.num_hidden_layers = num_layers
        if isinstance(getattr(text, "layer_types", None), list):
            text.layer_types = text.layer_types[:num_layers]
        layer_key = re.compile(r"\.layers\.(\d+)\.")
        state = {
            k: v for k, v in plain.state_dict().items()
            if not (m := layer_key.search(k)) or int(m.group(1)) < num_layers
        }
        lm = _rebuild(plain, config, state)
        student = RecLM(
            lm, self.tokenizer, self.item_embeddings, self.spec.format, self.spec.data_fingerprint,
            base=f"first {num_layers} of {self.num_layers} layers of {self.spec.base}",
            projector_hidden=self.spec.projector_hidden,
        )
        student.projector.load_state_dict(self.projector.state_dict())
        return student.to(self.device)

    # -- the model ---------------------------------------------------------------------------
    def embed_inputs(self, input_ids: torch.Tensor, slot_items: torch.Tensor) -> torch.Tensor:
        """Token embeddings with the projected SASRec embedding at every slot position."""
        tokens = self.lm.get_input_embeddings()(input_ids)
        mask = slot_items > 0
        if not bool(mask.any()):
            return tokens
        projected = self.projector(self.item_embeddings[slot_items[mask]]).to(tokens.dtype)
        at_slots = torch.zeros_like(tokens)
        at_slots[mask] = projected
        if self.spec.format == "ids":
            return tokens + at_slots
        return torch.where(mask.unsqueeze(-1), at_slots, tokens)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        slot_items: torch.Tensor,
        labels: torch.Tensor | None = None,
        output_hidden_states: bool = False,
        position_ids: torch.Tensor | None = None,
        cache=None,
        use_cache: bool = False,
        logits_to_keep: int = 0,
    ):
        """Hugging Face CausalLMOutputWithPast; `loss` = cross-entropy on the labelled (answer)
        tokens. `hidden_states[l]` is the output of layer l (index L is final-normed).
        `position_ids`, `cache`, `use_cache` and `logits_to_keep` (last k positions only) serve
        incremental decoding."""
        extra: dict = {}
        if logits_to_keep:
            extra["logits_to_keep"] = logits_to_keep
        if position_ids is not None:
            extra["position_ids"] = position_ids
        if cache is not None:
            extra["cache"] = cache
        return self.lm(
            inputs_embeds=self.embed_inputs(input_ids, slot_items),
            attention_mask=attention_mask,
            labels=labels,
            output_hidden_states=output_hidden_states,
            use_cache=use_cache,
            **extra,
        )

    # -- views used by caches and losses -----------------------------------------------------
    def base_lm(self) -> PreTrainedModel:
        """The Hugging Face model under any peft wrapper (weights shared, not copied)."""
        return self.lm.get_base_model() if _is_peft(self.lm) else self.lm

    def _text_config(self):
        return self.lm.config.get_text_config()

    @property
    def device(self) -> torch.device:
        return self.item_embeddings.device

    @property
    def num_layers(self) -> int:
        return int(self._text_config().num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        return int(self._text_config().hidden_size)

    @property
    def final_norm(self) -> nn.Module:
        decoder = self.base_lm().get_decoder()
        norm = getattr(decoder, "norm", None) or getattr(decoder, "final_layernorm", None)
        if norm is None:
            raise C2KDError(f"cannot find the final norm of {type(decoder).__name__}")
        return norm

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.base_lm().get_output_embeddings().weight

    @property
    def item_token_ids(self) -> torch.Tensor:
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
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
        try:
            lm = _plain_copy(self.lm) if _is_peft(self.lm) else self.lm
            lm.save_pretrained(tmp, safe_serialization=True)
            _mark_config(tmp / "config.json")
            self.tokenizer.save_pretrained(tmp)
            save_file({k: v.detach().cpu().contiguous() for k, v in self.projector.state_dict().items()}, tmp / PROJECTOR_FILE)
            save_file({ITEM_EMBEDDINGS_KEY: self.item_embeddings.detach().cpu().contiguous()}, tmp / ITEM_EMBEDDINGS_FILE)
            (tmp / SPEC_FILE).write_text(json.dumps(self.spec.to_json(), indent=2))
            if out_dir.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
                os.replace(out_dir, old / out_dir.name)
                os.replace(tmp, out_dir)
                shutil.rmtree(old)
            else:
                os.replace(tmp, out_dir)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)
        return out_dir

    @classmethod
    def load(cls, model_dir: str | os.PathLike, device: str | torch.device | None = None, dtype: torch.dtype | None = None) -> RecLM:
        """Read a folder written by `save`."""
        model_dir = Path(model_dir)
        spec_path = model_dir / SPEC_FILE
        if not spec_path.is_file():
            raise C2KDError(f"{model_dir}: not a saved recommender LM (no {SPEC_FILE})")
        spec = RecLMSpec.from_json(json.loads(spec_path.read_text()), str(spec_path))
        for name in (PROJECTOR_FILE, ITEM_EMBEDDINGS_FILE):
            if not (model_dir / name).is_file():
                raise C2KDError(f"{model_dir}: missing {name}")
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype if dtype is not None else "auto")
        table = load_file(model_dir / ITEM_EMBEDDINGS_FILE)
        if ITEM_EMBEDDINGS_KEY not in table:
            raise C2KDError(f"{model_dir / ITEM_EMBEDDINGS_FILE}: no tensor {ITEM_EMBEDDINGS_KEY!r}")
        model = cls(
            lm, tokenizer, table[ITEM_EMBEDDINGS_KEY], spec.format, spec.data_fingerprint,
            base=spec.base, preset=spec.preset, projector_hidden=spec.projector_hidden,
        )
        if model.spec.item_token_ids != spec.item_token_ids or model.spec.num_items != spec.num_items:
            raise C2KDError(f"{spec_path}: item token ids do not match the saved tokenizer")
        model.projector.load_state_dict(load_file(model_dir / PROJECTOR_FILE))
        if device is not None:
            model.to(device)
        return model
