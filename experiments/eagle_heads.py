"""EAGLE heads compared as their trainer's report judges one (`playground.train.eagle.evaluate`: greedy, 64 tokens,
planned on the flat curve so that the figures judge the heads, not the host): tokens per target forward and the
share of steps keeping at least d drafted tokens, on the trainer's 24 held-out template prompts and on the bench's
14 prompts, for each head folder named.

    python experiments/eagle_heads.py assets/eagle-smollm2-135m OTHER_HEAD_FOLDER ...
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from playground.bench.suite import SUITE  # noqa: E402
from playground.config import ModelSpec  # noqa: E402
from playground.models import load_model  # noqa: E402
from playground.train.eagle import evaluate  # noqa: E402
from playground.train.prompts import held_out_prompts  # noqa: E402


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        return 0 if len(sys.argv) > 1 else 2
    target = load_model(ModelSpec())
    print("| head | prompts | tokens per target forward | kept at least 1, 2, 3, ... drafted |")
    print("|---|---|---|---|")
    for folder in sys.argv[1:]:
        for name, prompts in (("24 template prompts", held_out_prompts()), ("the bench's 14", [p for _, p in SUITE])):
            report = evaluate(target, Path(folder), prompts)
            kept = ", ".join(f"{share:.2f}" for share in report["held_out_kept_at_least"].values())
            print(f"| {folder} | {name} | {report['held_out_tokens_per_target_forward']:.2f} | {kept} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
