"""Stage one on a GPU: a teacher of Llama-3-8B's shape (random weights, bfloat16) writing its cache.

    python benchmarks/gpu_stage_one.py --work /tmp/gpu-stage-one --json out.json [--examples 2048] [--backend transformers]

For a machine with a CUDA GPU (none was lent while this was written, so nothing here has been
measured yet). ML-100k (<= 5 windows per user) is prepared, a random-weight recommender of
Llama-3-8B's shape (width 4096, 32 layers, 32 heads / 8 KV heads, MLP 14336, the SmolLM2
tokenizer's vocabulary plus the item tokens) is saved, and `--examples` train examples are
cached twice, alternating: with the writer process (what `cache-teacher` does) and as a bare
forward; examples/s of each and their ratio (the writer's overhead with the forward on the GPU,
where it leaves the CPU to the writer), positions `answer` and `all`. With `--backend vllm` (in
an environment with vLLM for CUDA) the vLLM backend is timed too, both ways it gives the layers
back: `extract` (vLLM's extract_hidden_states, compiled with CUDA graphs — what `auto` picks for
this Llama) and `hooks` (eager). Everything runs from local
files: no download.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file (python benchmarks/gpu_stage_one.py): the repository root, for `benchmarks.`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import write_result  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--examples", type=int, default=2048)
    parser.add_argument("--backend", default="transformers", choices=["transformers", "vllm"])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this benchmark is for a GPU machine")
    from transformers import LlamaConfig, LlamaForCausalLM

    from c2kd.pipeline.cache_teacher import CacheTeacherSettings, TransformersStates, cache_teacher, length_buckets
    from c2kd.data.examples import load_examples
    from c2kd.data.prepare import prepare
    from c2kd.sasrec.train import SASRecTrainConfig, load_item_embeddings, train_sasrec
    from c2kd.recmodel import hf
    from c2kd.recmodel.layers import late_layers
    from c2kd.recmodel.model import RecLM
    from c2kd.recmodel.pretrained import converted_folder
    from c2kd.recmodel.prompts import PromptEncoder
    from c2kd.recmodel.tokenizer import add_item_tokens

    work = args.work
    data, sasrec, teacher = work / "data", work / "sasrec", work / "teacher-8b-shape"
    if not data.exists():
        prepare("movielens-100k", data, max_train_per_user=5)
    examples = load_examples(data)
    if not sasrec.exists():
        train_sasrec(examples, sasrec, SASRecTrainConfig(epochs=5))
    if not teacher.exists():
        _, tokenizer = hf.load_folder(converted_folder("smollm2-135m"))
        add_item_tokens(tokenizer, examples.num_items)
        config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                             num_key_value_heads=8, intermediate_size=14336, max_position_embeddings=2048,
                             tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
                             bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
        with torch.device("cuda"):
            lm = LlamaForCausalLM(config).to(torch.bfloat16)
        RecLM(lm, tokenizer, load_item_embeddings(sasrec), "ids", examples.fingerprint, base="Llama-3-8B shape, random",
              item_head="hybrid").save(teacher)
    result: dict = {"gpu": torch.cuda.get_device_name(0), "examples": args.examples, "runs": []}
    modes = ["cache-teacher", "bare forward"] + (["vllm extract", "vllm hooks"] if args.backend == "vllm" else [])
    for positions in ("answer", "all"):
        for repeat in range(args.repeats):
            for mode in modes:
                out = work / f"cache-{positions}-{mode.replace(' ', '-')}-{repeat}"
                shutil.rmtree(out, ignore_errors=True)
                start = time.perf_counter()
                if mode != "bare forward":  # transformers, or vLLM with its layers through extract / hooks
                    vllm = {"backend": "vllm", "vllm_states": mode.split()[1]} if mode.startswith("vllm") else {}
                    summary = cache_teacher(teacher, examples, out, CacheTeacherSettings(
                        splits=("train",), positions=positions, max_examples=args.examples, progress=False, **vllm))
                    seconds = summary["loop_seconds"]
                else:  # the same teacher forward, nothing written
                    model = RecLM.load(teacher, device="cuda").eval()
                    encoder = PromptEncoder(model.tokenizer, "ids", examples.titles())
                    frame = examples.split("train").head(args.examples)
                    encoded = [encoder.encode(r["example_id"], r["history"], r["candidates"], r["target"])
                               for r in frame.iter_rows(named=True)]
                    states = TransformersStates(model, encoder.pad_id, torch.device("cuda"))
                    start = time.perf_counter()
                    for batch in length_buckets([len(e) for e in encoded], 8192):
                        states([encoded[i] for i in batch], late_layers(model.num_layers))
                    seconds = time.perf_counter() - start
                result["runs"].append({"positions": positions, "mode": mode, "repeat": repeat,
                                       "examples_per_s": args.examples / seconds, "wall_s": time.perf_counter() - start})
    write_result(args.json, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
