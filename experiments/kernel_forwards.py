"""The whole forward with this checkout's kernels.c against a baseline build (a git revision or a file), in one
process: the embedded model on its default weights, the builds' libraries swapped under it round by round.

    python experiments/kernel_forwards.py [--baseline HEAD|REV|FILE] [--widths 1,4,8] [--context 100] [--rounds 10]

Per width (new tokens after --context cached ones): per round and build, the mean of 40 forwards with their
logits (`make_forwards` then `project`, as the engine's decode step runs them); printed, the median over rounds and
the fastest round, and each width over the first width's forward of the same build (the one-token forward
where --widths starts at 1, as by default). One process, so both builds meet
the same moments of a host whose speed drifts by a fifth within minutes; separate processes (as
`forward_parts.py` runs them) cannot tell apart changes smaller than that. PLAYGROUND_NATIVE_ARCH=haswell times the
AVX2 builds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from forward_costs import widths  # noqa: E402
from kernel_costs import baseline_source  # noqa: E402

from playground.config import GenerationParams, ModelSpec  # noqa: E402
from playground.decoding.base import forward_tokens, new_cache  # noqa: E402
from playground.models import load_model, native  # noqa: E402
from playground.models.forwards import make_forwards  # noqa: E402

FORWARDS = 40  # forwards timed per round, build and width


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="HEAD", help="git revision or kernels.c file (default HEAD)")
    parser.add_argument("--widths", type=widths, default=widths("1,4,8"))
    parser.add_argument("--context", type=int, default=100, help="cached tokens before the new ones, 1..4000")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds, 1..50")
    args = parser.parse_args()
    if not 1 <= args.context <= 4000 or not 1 <= args.rounds <= 50:
        parser.error("--context in 1..4000, --rounds in 1..50")
    try:
        baseline = baseline_source(args.baseline)
    except ValueError as exc:
        parser.error(str(exc))
    model = load_model(ModelSpec(device="cpu")).model
    products = model.packed_products()
    if not products:
        parser.error(f"the native kernel runs none of the model's products here ({native.status()})")
    kernel = products[0][1].kernel  # every panel and the layer stack call through this one object
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "kernels-baseline.c"
        source.write_text(baseline, encoding="utf-8")
        libraries = {"baseline": native.load(native.build(Path(folder), "cc", source)).library,
                     "this checkout": kernel.library}
        cache = new_cache(model, args.context + max(args.widths), GenerationParams())
        forward_tokens(model, cache, [i % 1000 for i in range(args.context)])
        run = make_forwards(model, cache, "eager", 1)
        seconds: dict[tuple[int, str], list[float]] = {}
        with torch.inference_mode():
            for _ in range(args.rounds):
                for width in args.widths:
                    ids, positions = [[7] * width], [list(range(args.context, args.context + width))]
                    for name, library in libraries.items():
                        object.__setattr__(kernel, "library", library)
                        model.project(run([0], ids, positions))  # first-call costs
                        cache.truncate(0, args.context)
                        start = time.perf_counter()
                        for _ in range(FORWARDS):
                            model.project(run([0], ids, positions))
                            cache.truncate(0, args.context)
                        seconds.setdefault((width, name), []).append((time.perf_counter() - start) / FORWARDS)
        object.__setattr__(kernel, "library", libraries["this checkout"])
    print(f"{native.status()}; baseline {args.baseline}; context {args.context}; {args.rounds} rounds")
    print(f"width | build | median ms | fastest ms | median over its {args.widths[0]}-token forward | over the "
          "baseline")
    for width in args.widths:
        for name in libraries:
            times = seconds[width, name]
            first = statistics.median(seconds[args.widths[0], name])
            print(f"{width} | {name} | {1e3 * statistics.median(times):.3f} | {1e3 * min(times):.3f} | "
                  f"{statistics.median(times) / first:.2f}x | "
                  f"{statistics.median(times) / statistics.median(seconds[width, 'baseline']):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
