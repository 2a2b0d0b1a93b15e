"""How fast a trace file is loaded and validated (`Trace.from_json`), in MB of JSON per second.

    python scripts/trace_speed.py TRACE.json [TRACE.json ...] [--mb 20] [--rounds 3]

The events of the given traces (write some with `python -m playground generate --trace-out`) are repeated into one
trace of about --mb megabytes, which is then loaded --rounds times; each round's rate is printed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from playground.trace import Trace, TraceError  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--mb", type=float, default=20.0, help="size of the trace loaded, 1..200 MB (default 20)")
    parser.add_argument("--rounds", type=int, default=3, help="1..20 (default 3)")
    args = parser.parse_args()
    if not 1 <= args.mb <= 200 or not 1 <= args.rounds <= 20:
        parser.error("--mb must be in [1, 200] and --rounds in [1, 20]")
    try:
        traces = [Trace.load(path) for path in args.traces]
    except TraceError as exc:
        parser.error(str(exc))
    data = traces[0].to_dict()
    events = [e for trace in traces for e in trace.to_dict()["events"]]
    size = len(json.dumps(events).encode())
    data["events"] = events * max(1, round(args.mb * 1e6 / size))
    text = json.dumps(data).encode()
    for _ in range(args.rounds):
        start = time.perf_counter()
        Trace.from_json(text)
        elapsed = time.perf_counter() - start
        print(f"{len(text) / 1e6:.1f} MB, {len(data['events'])} events: {len(text) / 1e6 / elapsed:.1f} MB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
