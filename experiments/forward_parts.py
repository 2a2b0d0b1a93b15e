"""Where a one-token forward's time goes: the same forward on builds of kernels.c with parts of its work taken out.

    python experiments/forward_parts.py [--rounds 7] [--context 100]

Builds (each in its own process, since a process loads one kernel): this checkout's kernels.c; one whose matrix
products return at once (what the rest of a forward costs: attention, norms, barriers, the model's Python); one with
every OpenMP barrier removed (what waiting at them costs; its results are wrong, its timing is not). Per build: the
median and fastest of --rounds rounds of 40 one-token forwards after a context of --context tokens, the embedded
model on its default weights. Timings only: nothing here runs in the product.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

VARIANTS = {
    "this checkout": lambda source: source,
    "products return at once": lambda source: source.replace("int nt) {\n    if (n <= 0) return;",
                                                             "int nt) {\n    if (1) return;"),
    "no barriers (wrong results)": lambda source: source.replace("#pragma omp barrier", ""),
}


def time_forward(source: Path, rounds: int, context: int) -> tuple[float, float]:
    """(median, fastest) seconds of a one-token forward with the kernel built from `source`."""
    import torch

    from playground.config import GenerationParams, ModelSpec
    from playground.decoding.base import new_cache
    from playground.models import load_model, native

    native.SOURCE = source
    model = load_model(ModelSpec(device="cpu")).model
    cache = new_cache(model, context + 8, GenerationParams())
    times = []
    with torch.inference_mode():
        model(torch.randint(0, 1000, (1, context)), torch.arange(context).unsqueeze(0), cache, (0,))
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(40):
                model(torch.tensor([[5]]), torch.tensor([[context]]), cache, (0,))  # (1, 1) token, its position
                cache.truncate(0, context)
            times.append((time.perf_counter() - start) / 40)
    return statistics.median(times), min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--context", type=int, default=100)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child process: time this source and print the figures
    args = parser.parse_args()
    if args.one:
        median, fastest = time_forward(Path(args.one), args.rounds, args.context)
        print(f"{median} {fastest}")
        return
    source = (ROOT / "playground/models/kernels.c").read_text()
    with tempfile.TemporaryDirectory() as folder:
        for name, change in VARIANTS.items():
            variant = Path(folder) / f"kernels-{len(name)}.c"
            variant.write_text(change(source))
            assert name == "this checkout" or variant.read_text() != source, f"{name}: the change no longer applies"
            out = subprocess.run([sys.executable, __file__, "--one", str(variant), "--rounds", str(args.rounds),
                                  "--context", str(args.context)], check=True, capture_output=True, text=True)
            median, fastest = (float(v) for v in out.stdout.split()[-2:])
            print(f"{name}: one-token forward median {1e3 * median:.3f} ms, fastest {1e3 * fastest:.3f} ms")


if __name__ == "__main__":
    main()
