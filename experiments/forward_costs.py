"""What a forward over several new tokens costs, and whether its logits equal plain decoding's bit for bit, with
the native layer stack (every layer in one call), the native kernels layer by layer, and PyTorch's attention, on the
embedded model (or --model, e.g. the draft: assets/draft-smollm2-135m).

    python experiments/forward_costs.py [--context 300] [--widths 1,5,7,9,12] [--rounds 3] [--repeats 30]
        [--weights auto|gguf|float32]

Per path and width: the median wall time of a forward over that many new tokens after a prefill of --context
tokens (the rounds interleave the paths, since this machine's speed drifts), its ratio to the one-token
forward of the same round, and the largest difference between the logits of a --exact-width verifying forward and
those of the same tokens decoded one per step (0 means greedy exactness holds whatever the prompt).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from playground.config import WEIGHTS, GenerationParams, ModelSpec  # noqa: E402
from playground.decoding.base import forward_tokens, new_cache  # noqa: E402
from playground.models import load_model, native  # noqa: E402

# path -> (native attention, the whole-stack call): PyTorch's attention runs layer by layer
PATHS = {"stack": (True, True), "layers": (True, False), "pytorch": (False, False)}


def widths(text: str) -> list[int]:
    values = [int(part) for part in text.split(",") if part.strip()]
    if not values or min(values) < 1 or max(values) > 64:
        raise argparse.ArgumentTypeError(f"widths must be integers in 1..64, got {text!r}")
    return values


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--weights", default="auto", choices=WEIGHTS, help="what the products read (see the CLI)")
    parser.add_argument("--context", type=int, default=300, help="prefill tokens before the timed forwards")
    parser.add_argument("--widths", type=widths, default=widths("1,5,7,9,12"))
    parser.add_argument("--exact-width", type=int, default=7, help="tokens of the verifying forward checked")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=30, help="forwards timed per width and round")
    args = parser.parse_args()
    for name in ("context", "exact_width", "rounds", "repeats"):
        if not 1 <= getattr(args, name) <= 4096:
            parser.error(f"--{name.replace('_', '-')} must be in 1..4096, got {getattr(args, name)}")
    model = load_model(ModelSpec(source=args.model, device="cpu", weights=args.weights)).model
    print(f"native kernels: {native.status()}; products read {native.formats_read(model)}")
    stack = model.native_stack

    def use(path: str) -> None:
        attention, whole = PATHS[path]
        model.native_attention = attention
        model.native_stack = stack if whole else None
    capacity = args.context + max(*args.widths, args.exact_width)
    cache = new_cache(model, capacity, GenerationParams())
    forward_tokens(model, cache, [100 + i % 1000 for i in range(args.context)])
    tokens = [2000 + i for i in range(capacity - args.context)]

    def timed(width: int) -> float:
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            forward_tokens(model, cache, tokens[:width], num_logits=width)
            times.append(time.perf_counter() - start)
            cache.truncate(0, args.context)
        return statistics.median(times)

    for round_ in range(1, args.rounds + 1):
        for name in PATHS:
            use(name)
            costs = {width: timed(width) for width in args.widths}
            one = costs.get(1)
            cells = [f"{w} tokens {s * 1e3:.2f} ms" + (f" ({s / one:.3f})" if one else "") for w, s in costs.items()]
            print(f"round {round_} {name:>7}: " + ", ".join(cells))
    for name in PATHS:
        use(name)
        width = args.exact_width
        steps = torch.stack([forward_tokens(model, cache, [token])[-1] for token in tokens[:width]])  # (W, V)
        cache.truncate(0, args.context)
        verified = forward_tokens(model, cache, tokens[:width], num_logits=width)  # (W, V)
        cache.truncate(0, args.context)
        print(f"{name}: {width}-token verify vs one token per step, largest logit difference "
              f"{(verified - steps).abs().max().item():.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
