"""Load a running `python -m playground serve`: the benchmark suite's prompts sent all at once, then one at a time.

    python scripts/serve_load.py [--url http://127.0.0.1:8000] [--requests 14] [--max-tokens 64]

Prints the tokens per second of both ways (wall time as a client sees it, HTTP included) and checks that every
greedy answer is the same both ways: continuous batching changes when a request's tokens come, never which.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from playground.bench.suite import SUITE  # noqa: E402


def complete(url: str, prompt: str, max_tokens: int) -> tuple[str, int]:
    """One greedy chat completion: its text and its number of tokens."""
    body = json.dumps({"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}).encode()
    request = urllib.request.Request(f"{url}/v1/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        reply = json.loads(response.read())
    return reply["choices"][0]["message"]["content"], reply["usage"]["completion_tokens"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--requests", type=int, default=len(SUITE), help=f"1..{len(SUITE)} (default all)")
    parser.add_argument("--max-tokens", type=int, default=64, help="per request, 1..4096 (default 64)")
    args = parser.parse_args()
    if not 1 <= args.requests <= len(SUITE):
        parser.error(f"--requests must be in [1, {len(SUITE)}], got {args.requests}")
    if not 1 <= args.max_tokens <= 4096:
        parser.error(f"--max-tokens must be in [1, 4096], got {args.max_tokens}")
    prompts = [prompt for _, prompt in SUITE[: args.requests]]
    try:
        complete(args.url, "Hello", 1)  # warm up, and fail early when nothing listens there
    except urllib.error.URLError as exc:
        parser.error(f"--url: no playground server answers at {args.url} ({exc.reason})")
    start = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda p: complete(args.url, p, args.max_tokens), prompts))
    together_s = time.perf_counter() - start
    start = time.perf_counter()
    alone = [complete(args.url, p, args.max_tokens) for p in prompts]
    alone_s = time.perf_counter() - start
    tokens = sum(n for _, n in together)
    print(f"{len(prompts)} requests, {tokens} tokens: all at once {tokens / together_s:.1f} tok/s "
          f"({together_s:.1f} s), one at a time {tokens / alone_s:.1f} tok/s ({alone_s:.1f} s): "
          f"{alone_s / together_s:.2f}x")
    same = sum(a == b for a, b in zip(together, alone))
    print(f"same greedy answer both ways: {same} of {len(prompts)}")
    return 0 if same == len(prompts) else 1


if __name__ == "__main__":
    sys.exit(main())
