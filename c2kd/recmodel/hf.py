"""The few things c2kd does to Hugging Face models themselves: load a GGUF, rebuild, copy, shrink.

Everything here takes and returns plain `transformers` models (or peft wrappers of them); the
recommender wrapper around them is `c2kd.recmodel.model.RecLM`.
"""

from __future__ import annotations

import copy
import re
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from c2kd.errors import C2KDError

_LAYER_KEY = re.compile(r"\.layers\.(\d+)\.")


def is_peft(lm: nn.Module) -> bool:
    # peft can only have wrapped the model if it has been imported.
    if "peft" not in sys.modules:
        return False
    from peft import PeftModel

    return isinstance(lm, PeftModel)


def base_model(lm: nn.Module) -> PreTrainedModel:
    """The Hugging Face model under any peft wrapper (weights shared, not copied)."""
    return lm.get_base_model() if is_peft(lm) else lm


def plain_copy(lm: nn.Module) -> PreTrainedModel:
    """A plain Hugging Face model with the same weights: LoRA adapters merged, nothing shared."""
    if is_peft(lm):
        return copy.deepcopy(lm).merge_and_unload()
    return copy.deepcopy(lm)


def rebuild(lm: PreTrainedModel, config: Any = None, state_dict: dict | None = None) -> PreTrainedModel:
    """A fresh model built from a config, holding the given weights (GGUF-loaded models cannot be
    saved as they are, and truncation needs a smaller config)."""
    config = copy.deepcopy(config if config is not None else lm.config)
    if hasattr(config, "quantization_config"):  # the weights are dequantised: a plain model from here on
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=lm.dtype)
    state = state_dict if state_dict is not None else lm.state_dict()
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    tied = {k for k in missing if fresh.config.tie_word_embeddings and k.endswith("lm_head.weight")}
    if set(missing) - tied or unexpected:
        raise C2KDError(f"rebuilding {type(lm).__name__}: missing weights {sorted(set(missing) - tied)[:5]}, "
                        f"unexpected {unexpected[:5]}")
    fresh.tie_weights()
    return fresh.to(lm.device)


def load_gguf(path: Path, dtype: torch.dtype = torch.float32) -> tuple[PreTrainedModel, Any]:
    """(model, tokenizer) of a GGUF file, dequantised into a plain model that save_pretrained accepts."""
    if not path.is_file():
        raise C2KDError(f"{path}: GGUF file not found")
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise C2KDError(f"{path}: not a GGUF file (it does not start with the GGUF magic bytes)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        lm = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    except (ValueError, KeyError, OSError, RuntimeError) as e:
        raise C2KDError(f"{path}: transformers cannot load this GGUF ({e})") from None
    return rebuild(lm), tokenizer


def load_folder(path: Path, dtype: torch.dtype | str = torch.float32) -> tuple[PreTrainedModel, Any]:
    """(model, tokenizer) of a Hugging Face model folder."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        lm = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    except (ValueError, KeyError, OSError) as e:
        raise C2KDError(f"{path}: transformers cannot load this model folder ({e})") from None
    return lm, tokenizer


def text_config(lm: nn.Module) -> Any:
    return base_model(lm).config.get_text_config()


def first_layers(lm: nn.Module, num_layers: int) -> PreTrainedModel:
    """A copy of `lm` keeping its embeddings, its first `num_layers` layers, final norm and head."""
    plain = plain_copy(lm) if is_peft(lm) else lm  # rebuild copies the weights
    config = copy.deepcopy(plain.config)
    text = config.get_text_config()
    text.num_hidden_layers = num_layers
    if isinstance(getattr(text, "layer_types", None), list):
        text.layer_types = text.layer_types[:num_layers]
    state = {k: v for k, v in plain.state_dict().items() if not (m := _LAYER_KEY.search(k)) or int(m.group(1)) < num_layers}
    return rebuild(plain, config, state)


def narrow_config(lm: nn.Module, width: int, num_layers: int) -> Any:
    """The config of a narrower model of the same family: `width` wide, `num_layers` deep, the same
    head size, GQA ratio and vocabulary; MLP width and head count scaled with the width."""
    config = copy.deepcopy(base_model(lm).config)
    text = config.get_text_config()
    heads, kv = int(text.num_attention_heads), int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    new_heads = max(1, width // head_dim)
    if width % head_dim:
        raise C2KDError(f"narrow width {width}: must be a multiple of the head size {head_dim} of {text.model_type}")
    text.hidden_size = width
    text.num_attention_heads = new_heads
    text.num_key_value_heads = max(1, new_heads // max(1, heads // kv))
    text.head_dim = head_dim
    text.intermediate_size = max(1, round(text.intermediate_size * width / base_model(lm).config.get_text_config().hidden_size))
    layer_types = getattr(text, "layer_types", None)
    text.num_hidden_layers = num_layers
    if isinstance(layer_types, list):
        text.layer_types = layer_types[:num_layers]
    return config


def decoder(lm: nn.Module) -> nn.Module:
    """The transformer body (embeddings, layers, final norm) without the LM head."""
    return base_model(lm).get_decoder()


def final_norm(lm: nn.Module) -> nn.Module:
    body = decoder(lm)
    norm = getattr(body, "norm", None) or getattr(body, "final_layernorm", None)
    if norm is None:
        raise C2KDError(f"cannot find the final norm of {type(body).__name__}")
    return norm


def embed_scale(embedding: nn.Module) -> float | torch.Tensor:
    """The factor a model's embedding layer multiplies rows by (Gemma: sqrt(width)); 1 otherwise."""
    scale = getattr(embedding, "embed_scale", None)
    return 1.0 if scale is None else scale


def logit_softcap(lm: nn.Module) -> float | None:
    return getattr(text_config(lm), "final_logit_softcapping", None) or getattr(
        base_model(lm).config, "final_logit_softcapping", None)


def plain_attention_for_training(model: nn.Module) -> None:
    """Switch every Hugging Face model inside `model` to the plain (matmul + softmax) attention.

    For training on CPU: at c2kd's prompt lengths (~40 tokens) the fused SDPA kernel's backward is a
    large share of a step (benchmarks/cpu_step.py; docs/RESULTS.md). Both compute the same
    attention; the setting is not saved with the model, so inference keeps the default."""
    for module in model.modules():
        if isinstance(module, PreTrainedModel) and module.config._attn_implementation != "eager":
            module.set_attn_implementation("eager")


def prepare_for_training(model: nn.Module, device: torch.device) -> None:
    """What training does to the Hugging Face models inside `model` once it is on `device`."""
    if device.type == "cpu":
        plain_attention_for_training(model)


def quiet_transformers() -> None:
    """Keep library progress bars and notices ("Loading weights", mean resizing) out of c2kd's output."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
