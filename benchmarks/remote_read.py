"""Training from a cache behind HTTP: bytes fetched ÷ the cache's size, with the read cache.

    python benchmarks/remote_read.py --work runs/bench/remote_read [--json out.json]

A tiny-teacher cache of ML-100k (<= 5 windows per user, train split, all positions, bfloat16) is
served from 127.0.0.1 by two servers: Python's `http.server` (it ignores Range: every request
gets the whole file) and the same server answering Range requests. For each, `c2kd cache info`,
`c2kd cache verify` and a 2-epoch `c2kd distill` read the cache by URL, the distill through a
fresh read cache; the servers count the bytes they send. Goal: the distill fetches <= 1.05x the
cache's size (each file once).
"""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file (python benchmarks/remote_read.py): the repository root, for `benchmarks.`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import write_result  # noqa: E402


class CountingHandler(http.server.SimpleHTTPRequestHandler):
    """Serves a folder; counts the bytes of every response body; answers Range requests when asked."""

    ranges = False
    sent = 0
    lock = threading.Lock()

    def log_message(self, *args) -> None:  # quiet
        pass

    def _count(self, n: int) -> None:
        with CountingHandler.lock:
            CountingHandler.sent += n

    def copyfile(self, source, outputfile) -> None:
        data = source.read()
        self._count(len(data))
        outputfile.write(data)

    def send_head(self):
        header = self.headers.get("Range")
        if not (self.ranges and header):
            return super().send_head()
        path = self.translate_path(self.path)
        if not os.path.isfile(path):
            self.send_error(404)
            return None
        size = os.path.getsize(path)
        m = re.fullmatch(r"bytes=(\d*)-(\d*)", header.strip())
        start, end = (int(m.group(1) or 0), int(m.group(2)) if m.group(2) else size - 1) if m else (0, size - 1)
        if m and not m.group(1):  # a suffix: the last N bytes
            start, end = max(0, size - int(m.group(2))), size - 1
        end = min(end, size - 1)
        with open(path, "rb") as f:
            f.seek(start)
            body = f.read(end - start + 1)
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        self._count(len(body))
        self.wfile.write(body)
        return None


def serve(folder: Path, ranges: bool) -> tuple[http.server.ThreadingHTTPServer, str]:
    handler = type("Handler", (CountingHandler,), {"ranges": ranges})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(folder)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def c2kd(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "c2kd.cli", *args], check=True, stdout=subprocess.DEVNULL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("runs/bench/remote_read"))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    work = args.work
    data, cache = work / "data", work / "site" / "cache"
    if not data.exists():
        c2kd("prepare", "movielens-100k", "--out", str(data), "--max-train-per-user", "5")
    if not (cache / "manifest.json").exists():
        from c2kd.data.examples import load_examples
        from c2kd.recmodel.model import RecLM
        from c2kd.recmodel.tokenizer import build_word_tokenizer

        examples = load_examples(data)
        torch.manual_seed(0)
        emb = torch.randn(examples.num_items + 1, 64)
        tokenizer = build_word_tokenizer(examples.titles()[1:], examples.num_items)
        RecLM.from_preset("tiny-teacher", tokenizer, emb, "ids", data_fingerprint=examples.fingerprint).save(work / "teacher")
        c2kd("cache-teacher", "--teacher", str(work / "teacher"), "--data", str(data), "--out", str(cache),
             "--splits", "train", "--no-progress")
    size = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file() and "journal" not in p.parts)
    result: dict = {"cache_bytes": size, "servers": {}}
    for name, ranges in (("http.server (no Range)", False), ("with Range", True)):
        for stale in (f"read-cache-{int(ranges)}", f"student-{int(ranges)}", f"student-{int(ranges)}.partial"):
            shutil.rmtree(work / stale, ignore_errors=True)  # a cold read cache, a fresh run
        server, base = serve(work / "site", ranges)
        url = f"{base}/cache"
        row = {}
        for step, cmd in (("info", ["cache", "info", url]), ("verify", ["cache", "verify", url]),
                          ("distill", ["distill", "--cache", url, "--data", str(data), "--out",
                                       str(work / f"student-{int(ranges)}"), "--student", "tiny-student", "--epochs",
                                       str(args.epochs), "--no-progress", "--overwrite", "--read-cache",
                                       str(work / f"read-cache-{int(ranges)}")])):
            CountingHandler.sent = 0
            c2kd(*cmd)
            row[step] = {"bytes": CountingHandler.sent, "ratio_to_cache": CountingHandler.sent / size}
        server.shutdown()
        result["servers"][name] = row
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_result(args.json, result)


if __name__ == "__main__":
    main()
