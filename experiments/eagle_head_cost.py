"""What one EAGLE head forward costs with its decoder layer in the native kernel (as `load_head` serves it beside a
target whose layers run there) against the same layer in PyTorch's ops around the same prepacked products.

    python experiments/eagle_head_cost.py [--batches 1 4 16] [--rows 4] [--keys 100] [--rounds 60]

Per batch size, B requests of `--rows` new rows each (a depth of the tree: top_k nodes) over `--keys` committed
keys, every key visible, then the head's output rows: the median milliseconds of each form over `--rounds`
interleaved calls in one process, and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from playground.config import ModelSpec  # noqa: E402
from playground.models import load_model, native  # noqa: E402
from playground.models.eagle import EagleHead, load_head  # noqa: E402
from playground.models.linear import Linear  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--keys", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=60)
    args = parser.parse_args()
    target = load_model(ModelSpec())
    loaded = load_head(None, target)
    if loaded.head.layer.kernel is None:
        sys.exit(f"the head's layer does not run in the native kernel here (kernel {native.status()})")
    pytorch = EagleHead(loaded.head.config, loaded.head.taps).eval().requires_grad_(False)
    pytorch.load_state_dict(loaded.head.state_dict())
    for module in pytorch.modules():  # its products prepacked as before, the rest in PyTorch's ops
        if isinstance(module, Linear):
            module.packed = target.model.pack_like_own(module.weight)
    forms = {"PyTorch layer": pytorch, "native layer": loaded.head}
    cfg, t, past = pytorch.config, args.rows, args.keys
    print(f"one EAGLE head forward of {t} rows a request over {past} keys, then {len(loaded.vocab_ids)} output rows; "
          f"median of {args.rounds}\n")
    print("| requests | PyTorch layer ms | native layer ms | native / PyTorch |\n|---|---|---|---|")
    torch.manual_seed(0)
    for b in args.batches:
        embeddings, features = torch.randn(b, t, cfg.hidden_size), torch.randn(b, t, cfg.hidden_size)
        cos, sin = target.model.rope(torch.arange(past, past + t).repeat(b, 1), torch.float32)
        past_k, past_v = (torch.randn(b, cfg.num_kv_heads, past, cfg.head_dim) for _ in range(2))
        visible = torch.ones(b, t, past + t, dtype=torch.bool)
        times: dict[str, list[float]] = {name: [] for name in forms}
        with torch.inference_mode():
            for i in range(args.rounds + 2):  # the first two warm up
                for name, head in forms.items():
                    start = time.perf_counter()
                    loaded.output.logits(head(embeddings, features, cos, sin, past_k, past_v, visible)[0])
                    if i >= 2:
                        times[name].append(1e3 * (time.perf_counter() - start))
        before, after = (statistics.median(times[name]) for name in forms)
        print(f"| {b} | {before:.2f} | {after:.2f} | {after / before:.2f} |")


if __name__ == "__main__":
    main()
