"""How much faster does `prepare.py text` tokenize with 2 worker processes than with 1?

    python -m bench.labs.prepare_speed                  # a 50 MB corpus, a 256 + 1000 token BPE, 1 then 2 workers
    python -m bench.labs.prepare_speed --mb 4 --quick   # the smoke test

An offline corpus (this Python's standard library as .txt and .jsonl documents) and a byte-level BPE learned from its
first MB (train_bpe). The worker counts alternate --repeats times; a busy loop in 1 and 2 processes before each run
bounds what 2 processes could reach on a shared machine, and CPU seconds per MB show the extra work. The shards of
both runs must be byte-identical.
"""
import base64
import json
import multiprocessing
import os
import re
import resource
import shutil
import statistics
import sysconfig
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench import common
from data.prepare import python_files
from data.text import prepare_text

WORDS = re.compile(r" ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+")


def train_bpe(text, merges):
    """A byte-level BPE learned from text: the 256 bytes, then `merges` tokens, each the most frequent adjacent pair
    (ties broken by the bytes) within the words of the text. Returns {token bytes: rank}, the .tiktoken content."""
    ranks = {bytes([i]): i for i in range(256)}
    words = Counter(w.encode() for w in WORDS.findall(text))
    split = {w: [w[i:i + 1] for i in range(len(w))] for w in words}
    for _ in range(merges):
        pairs = Counter()
        for w, n in words.items():
            parts = split[w]
            for a, b in zip(parts, parts[1:]):
                pairs[a, b] += n
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        ranks[a + b] = len(ranks)
        for w in words:
            parts, out, i = split[w], [], 0
            while i < len(parts):
                if i + 1 < len(parts) and parts[i] == a and parts[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(parts[i])
                    i += 1
            split[w] = out
    return ranks


def write_tiktoken(ranks, path):
    Path(path).write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    return path


def build_corpus(folder, megabytes):
    """Copies of the standard library's .py files as .txt documents plus .jsonl lines, until `megabytes` MB."""
    sources = python_files(sysconfig.get_paths()["stdlib"])
    folder.mkdir(parents=True)
    size, copy = 0, 0
    with open(folder / "lines.jsonl", "w") as lines:
        while size < megabytes * 1e6:
            for i, path in enumerate(sources):
                text = path.read_text(encoding="utf-8", errors="replace")
                (folder / f"{copy:02d}_{i:05d}.txt").write_text(text)
                size += len(text.encode())
                if i % 3 == 0:
                    lines.write(json.dumps({"text": text}) + "\n")
                    size += len(text.encode())
                if size >= megabytes * 1e6:
                    break
            copy += 1
    return size


def busy(n=2_000_000):
    total = 0
    for i in range(n):
        total += i
    return total


def two_process_headroom():
    """Wall-time speedup of two busy loops in 2 processes over the same two in 1: about 2 on two free cores."""
    t0 = time.perf_counter()
    busy(), busy()
    serial = time.perf_counter() - t0
    with multiprocessing.get_context("fork").Pool(2) as pool:
        t0 = time.perf_counter()
        pool.map(busy, [2_000_000] * 2)
        parallel = time.perf_counter() - t0
    return serial / parallel


def cpu_seconds():
    """CPU seconds of this process and of its finished children (the pool's workers are joined when it ends)."""
    return sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for f in ("ru_utime", "ru_stime"))


def shard_bytes(folder):
    return {p.name: p.read_bytes() for p in sorted(Path(folder).glob("*.bin"))}


@common.command
def main(argv=None):
    p = common.parser(__doc__, results=False)
    p.add_argument("--mb", type=float, default=50.0, help="corpus size in MB")
    p.add_argument("--merges", type=int, default=1000, help="BPE merges learned for the tokenizer")
    p.add_argument("--repeats", type=int, default=2, help="runs per worker count (the best is kept)")
    p.add_argument("--quick", action="store_true", help="100 merges, one run each")
    p.add_argument("--out", default=str(common.RESULTS))
    args = p.parse_args(argv)
    merges, repeats = (100, 1) if args.quick else (args.merges, args.repeats)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        size = build_corpus(tmp / "corpus", args.mb)
        sample = "".join(q.read_text() for q in sorted((tmp / "corpus").glob("*.txt"))[:200])[:1_000_000]
        bpe = write_tiktoken(train_bpe(sample, merges), tmp / "bench.tiktoken")
        best, cpu, headroom, loads, shards, rates = {}, {}, {}, {}, {}, {}
        for _ in range(repeats):
            for workers in (1, 2):
                out = tmp / f"out{workers}"
                shutil.rmtree(out, ignore_errors=True)
                headroom.setdefault(workers, []).append(two_process_headroom())
                t0, c0 = time.perf_counter(), cpu_seconds()
                meta = prepare_text([tmp / "corpus"], out, str(bpe), workers=workers, shard_tokens=10_000_000)
                rate, per_mb = size / 1e6 / (time.perf_counter() - t0), (cpu_seconds() - c0) / (size / 1e6)
                rates.setdefault(workers, []).append(rate)
                if rate > best.get(workers, 0):
                    best[workers], cpu[workers] = rate, per_mb
                loads.setdefault(workers, []).append(os.getloadavg()[0])
                shards[workers] = shard_bytes(out)
        identical = shards[1] == shards[2]
    ratio = best[2] / best[1]
    median = {w: statistics.median(rates[w]) for w in rates}
    rows = [[w, f"{best[w]:.2f}", f"{best[w] / best[1]:.2f}x", " / ".join(f"{r:.2f}" for r in rates[w]),
             f"{median[w] / median[1]:.2f}x", f"{cpu[w]:.3f}",
             " / ".join(f"{x:.2f}x" for x in headroom[w]), " / ".join(f"{x:.1f}" for x in loads[w])] for w in (1, 2)]
    notes = [f"corpus: {size / 1e6:.1f} MB ({meta['train_docs'] + meta['val_docs']:,} documents, "
             f"{meta['train_tokens'] + meta['val_tokens']:,} tokens), BPE of {256 + merges} tokens + <|endoftext|>",
             f"best of {repeats} run(s) per worker count; shards of 1 and 2 workers byte-identical: {identical}",
             f"{common.cpu_cores()} cores; the load average (1 min) after each run shows what else was running"]
    common.write_result(args.out, "prepare_speed", "prepare.py text: throughput by worker count",
                        ["workers", "best MB/s", "vs 1 worker", "each run, MB/s", "medians vs 1 worker",
                         "CPU s per MB (all processes)",
                         "busy-loop speedup of 2 processes before each run", "load average after each run"],
                        rows, notes)
    print(f"2 workers: {ratio:.2f}x the throughput of 1 ({best[2]:.2f} vs {best[1]:.2f} MB/s; a busy loop's 2-process "
          f"speedup at the time: {max(headroom[2]):.2f}x); CPU per MB {cpu[2] / cpu[1]:.2f}x; identical: {identical}")
    return 0 if identical else 1
