"""Deployment: student ÷ teacher parameters and per-request (batch 1) CPU latency, side by side.

    python benchmarks/deployment.py --data DATA --teacher TEACHER_DIR --student STUDENT_DIR [--sasrec RUN]

Requests of every model are interleaved in one loop (c2kd.latency), so the ratios hold even on a
noisy machine; the absolute milliseconds are printed with the machine they came from.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path

import torch

from c2kd.latency import interleaved_latency, reclm_request, sasrec_request
from c2kd.pipeline.examples import load_examples
from c2kd.pipeline.sasrec import load_sasrec
from c2kd.recmodel.model import RecLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--teacher", type=Path, required=True)
    parser.add_argument("--student", type=Path, required=True)
    parser.add_argument("--sasrec", type=Path)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    examples = load_examples(args.data)
    test, titles = examples.split("test"), examples.titles()
    teacher, student = RecLM.load(args.teacher), RecLM.load(args.student)
    requests = {"teacher": reclm_request(teacher, test, titles), "student": reclm_request(student, test, titles)}
    if args.sasrec:
        requests["SASRec"] = sasrec_request(load_sasrec(args.sasrec)[0], test)
    latency = interleaved_latency(requests, min(args.requests, test.height))
    result = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "torch_threads": args.threads},
        "parameters": {"teacher": sum(p.numel() for p in teacher.parameters()),
                       "student": sum(p.numel() for p in student.parameters())},
        "non_embedding_parameters": {"teacher": teacher.non_embedding_parameters(),
                                     "student": student.non_embedding_parameters()},
        "latency_ms": latency,
    }
    result["ratios"] = {
        "student/teacher parameters": result["parameters"]["student"] / result["parameters"]["teacher"],
        "student/teacher non-embedding parameters":
            result["non_embedding_parameters"]["student"] / result["non_embedding_parameters"]["teacher"],
        "student/teacher latency": latency["student"] / latency["teacher"],
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
