"""Deployment: the exported student against PyTorch — parity, batch-1 latency, size, memory.

    python benchmarks/deployment.py --data DATA --teacher TEACHER --student STUDENT --out DIR [--sasrec RUN]

1. The student is exported (`c2kd export`) as ONNX fp32, ONNX int8 and ExecuTorch (XNNPACK) into DIR.
2. Parity on the whole test split: the exported scores against the PyTorch student's (max |diff|),
   and HR@1 / NDCG@10 of PyTorch and of each export.
3. Latency at batch 1, one thread, requests interleaved between the variants (one request =
   rank the 20 candidates of one test example): the student in PyTorch eager, in onnxruntime fp32
   and int8 and in ExecuTorch's runtime, the teacher in PyTorch (and SASRec when given); p50 and p95.
4. Size on disk of each, and the peak resident memory of a fresh process that loads the variant
   and answers 20 requests (each variant alone). ExecuTorch runs through its Python bindings
   here, which import torch: its memory figure includes torch's, unlike the C++ runtime on a device.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from c2kd.deploy.export import export_ranker
from c2kd.deploy.runtime import Ranker
from c2kd.latency import interleaved_times, reclm_request, sasrec_request
from c2kd.metrics import candidate_metrics
from c2kd.data.examples import load_examples, target_indices
from c2kd.sasrec.train import load_sasrec
from c2kd.recmodel.model import RecLM

if __package__ in (None, ""):  # run as a file (python benchmarks/deployment.py): the repository root, for `benchmarks.`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import write_result  # noqa: E402


def ranker_request(ranker: Ranker, frame) -> object:
    rows = list(zip(frame["history"].to_list(), frame["candidates"].to_list()))
    return lambda i: ranker.scores(*rows[i])


def timed(requests: dict, n: int) -> dict[str, dict[str, float]]:
    """p50 / p95 milliseconds per request; requests alternate between the variants."""
    times = interleaved_times(requests, n)
    return {name: {"p50_ms": statistics.median(t), "p95_ms": float(np.percentile(t, 95))} for name, t in times.items()}


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def peak_rss_mib(kind: str, path: Path, data: Path) -> float:
    """Peak resident memory of a fresh process loading one variant and answering 20 requests."""
    code = (
        "from c2kd.data.examples import load_examples\n"
        f"test = load_examples({str(data)!r}).split('test')\n"
        "rows = list(zip(test['history'].to_list(), test['candidates'].to_list()))\n"
    )
    if kind == "export":  # the runtime alone (for ONNX: no torch in this process)
        code += (f"from c2kd.deploy.runtime import Ranker\nr = Ranker.load({str(path)!r})\n"
                 "for h, c in rows[:20]: r.scores(h, c)\n")
    else:
        code += ("import torch; torch.set_num_threads(1)\n"
                 "from c2kd.latency import reclm_request\nfrom c2kd.recmodel.model import RecLM\n"
                 f"m = RecLM.load({str(path)!r}).eval()\nreq = reclm_request(m, test, load_examples({str(data)!r}).titles())\n"
                 "for i in range(20): req(i)\n")
    # VmHWM: this process's own peak (ru_maxrss would carry the forking parent's over exec)
    code += "print(next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM')) / 1024)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--teacher", type=Path, required=True)
    parser.add_argument("--student", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sasrec", type=Path)
    parser.add_argument("--requests", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    examples = load_examples(args.data)
    test, titles = examples.split("test"), examples.titles()
    formats = {"onnx-fp32": ("onnx", "none"), "onnx-int8": ("onnx", "int8"), "executorch": ("executorch", "none")}
    exports = {name: args.out / f"student-{name}" for name in formats}
    for name, (fmt, quantize) in formats.items():
        if not exports[name].exists():
            export_ranker(args.student, exports[name], titles, quantize=quantize, fmt=fmt)
    student, teacher = RecLM.load(args.student).eval(), RecLM.load(args.teacher).eval()
    rankers = {name: Ranker.load(folder) for name, folder in exports.items()}

    # parity over the whole test split
    pytorch_request = reclm_request(student, test, titles)
    with torch.no_grad():
        ref = torch.cat([pytorch_request(i) for i in range(test.height)]).numpy()
    got = {name: np.stack([ranker_request(r, test)(i) for i in range(test.height)]) for name, r in rankers.items()}
    target = torch.as_tensor(target_indices(test), dtype=torch.long)
    quality = {"pytorch": candidate_metrics(torch.from_numpy(ref), target)}
    quality.update({name: candidate_metrics(torch.from_numpy(s), target) for name, s in got.items()})
    parity = {name: {"max_abs_diff": float(np.abs(s - ref).max()),
                     "HR@1": round(quality[name]["HR@1"], 3), "NDCG@10": round(quality[name]["NDCG@10"], 3)}
              for name, s in got.items()}
    parity["pytorch"] = {"HR@1": round(quality["pytorch"]["HR@1"], 3), "NDCG@10": round(quality["pytorch"]["NDCG@10"], 3)}

    requests = {"student pytorch": pytorch_request,
                **{f"student {name}": ranker_request(r, test) for name, r in rankers.items()},
                "teacher pytorch": reclm_request(teacher, test, titles)}
    if args.sasrec:
        requests["SASRec"] = sasrec_request(load_sasrec(args.sasrec)[0], test)
    with torch.no_grad():
        latency = timed(requests, min(args.requests, test.height))
    sizes = {"student pytorch": folder_bytes(args.student), "teacher pytorch": folder_bytes(args.teacher),
             **{f"student {name}": folder_bytes(folder) for name, folder in exports.items()}}
    memory = {"student pytorch": peak_rss_mib("pytorch", args.student, args.data),
              "teacher pytorch": peak_rss_mib("pytorch", args.teacher, args.data),
              **{f"student {name}": peak_rss_mib("export", folder, args.data) for name, folder in exports.items()}}
    result = {
        "student": str(args.student), "teacher": str(args.teacher), "test_examples": test.height,
        "parity": parity, "latency": latency, "bytes_on_disk": sizes, "peak_rss_mib": memory,
        "non_embedding_parameters": {"teacher": teacher.non_embedding_parameters(),
                                     "student": student.non_embedding_parameters()},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    write_result(args.out / "deployment.json", result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
