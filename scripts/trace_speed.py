"""How long a trace takes to load and to draw: `Trace.load` (parse and validate), the app's upload (`load_trace`:
load, every view and chart) and one replay step, for each file given and for the heaviest trace the validator
accepts at the upload cap.

    python scripts/trace_speed.py [TRACE.json ...] [--nodes 256] [--rounds 3]

Write traces with `python -m playground generate --trace-out`. The heaviest trace is built from scratch: steps that
each propose a tree of --nodes nodes, one accepted, one refused and corrected, as many as fit in `MAX_TRACE_BYTES`
(or `trace_check.MAX_STEPS`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from playground.trace import MAX_TRACE_BYTES, Trace, TraceError  # noqa: E402
from playground.trace_check import MAX_NODES, MAX_STEPS  # noqa: E402
from playground.ui import decode  # noqa: E402


def heaviest(nodes: int) -> dict:
    """The densest valid trace under the cap: each step a tree of `nodes` nodes (4 a depth), its first node
    accepted, the first node below it refused and corrected."""
    def token(i: int, position: int, parent: int | None) -> dict:
        return {"id": i % 49_000, "text": " word", "position": position, "p": 0.5, "q": 0.5, "parent": parent}

    events: list[dict] = [{"kind": "bonus", "step": 0, "t": 0.01, "token": token(1, 100, None)},
                          {"kind": "commit", "step": 0, "t": 0.01, "num_tokens": 1, "draft_s": 0.0, "verify_s": 0.01,
                           "overhead_s": 0.0, "kv_bytes": 1000}]
    committed, size, step = [1], 0, 1
    while step < MAX_STEPS:
        at, t = 100 + 2 * step, 0.01 * (step + 1)
        tree = [token(7 * step + i, at + 1 + i // 4, 0 if i < 4 else i - 4) for i in range(nodes)]
        correction = token(3, at + 2, None)
        batch = [{"kind": "draft", "step": step, "t": t, "tokens": tree, "wall_s": 0.001, "draft_forwards": 1},
                 {"kind": "verify", "step": step, "t": t + 0.004, "num_tokens": nodes + 1, "wall_s": 0.003,
                  "target_forwards": 1},
                 {"kind": "accept", "step": step, "t": t + 0.005, "token": tree[0], "u": None},
                 {"kind": "reject", "step": step, "t": t + 0.005, "token": tree[4], "u": None},
                 {"kind": "correct", "step": step, "t": t + 0.005, "token": correction},
                 {"kind": "commit", "step": step, "t": t + 0.006, "num_tokens": 2, "draft_s": 0.001,
                  "verify_s": 0.003, "overhead_s": 0.0, "kv_bytes": 1000}]
        size += len(json.dumps(batch))
        if size > 0.97 * MAX_TRACE_BYTES:
            break
        events += batch
        committed += [tree[0]["id"], correction["id"]]
        step += 1
    events.append({"kind": "finish", "step": step - 1, "t": 0.01 * (step + 1), "reason": "length",
                   "token_ids": committed, "text": "", "wall_s": 0.01 * (step + 1)})
    return {"schema_version": 1, "algo": "eagle", "model": "heaviest", "prompt": "p", "prompt_ids": [1],
            "params": {}, "events": events}


def timed(path: Path, rounds: int) -> None:
    trace = Trace.load(path)
    last = max(e.step for e in trace.events)
    for _ in range(rounds):
        start = time.perf_counter()
        Trace.load(path)
        loaded = time.perf_counter()
        outputs = decode.load_trace(str(path))
        shown = time.perf_counter()
        decode.replay_step(outputs[4], last)
        replayed = time.perf_counter()
        print(f"{path.name}: {path.stat().st_size / 2**20:.2f} MiB, {len(trace.events)} events, {last} steps: "
              f"load {loaded - start:.2f} s, upload drawn {shown - loaded:.2f} s, "
              f"a replay step {replayed - shown:.2f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="*")
    parser.add_argument("--nodes", type=int, default=256, help=f"nodes a step of the heaviest trace, 8..{MAX_NODES}")
    parser.add_argument("--rounds", type=int, default=3, help="1..20 (default 3)")
    args = parser.parse_args()
    if not 8 <= args.nodes <= MAX_NODES or not 1 <= args.rounds <= 20:
        parser.error(f"--nodes must be in [8, {MAX_NODES}] and --rounds in [1, 20]")
    with tempfile.TemporaryDirectory() as folder:
        heavy = Path(folder) / f"heaviest-{args.nodes}-nodes.json"
        heavy.write_text(json.dumps(heaviest(args.nodes)))
        try:
            for path in [*map(Path, args.traces), heavy]:
                timed(path, args.rounds)
        except TraceError as exc:
            parser.error(str(exc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
