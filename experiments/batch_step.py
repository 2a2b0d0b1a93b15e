"""What one step of the batching engine costs with short and with long prompts: `--requests` requests decoding
together on the default weights, `--steps` steps timed once every prefill is done, the median step in ms and the
tokens a second they make.

    python experiments/batch_step.py [--requests 32] [--steps 20] [--long-words 450]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from playground.config import EngineParams, GenerationParams, ModelSpec, SamplingParams  # noqa: E402
from playground.engine.engine import Engine  # noqa: E402
from playground.models import load_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--long-words", type=int, default=450, help="about the words of the long prompts")
    args = parser.parse_args()
    target = load_model(ModelSpec())
    passage = "The cat sat on the mat and looked at the birds in the garden. " * (args.long_words // 13)
    for name, prompt in (("short", "Write one sentence about the number {i}."),
                         ("long", "Summarise this text. " + passage + "{i}")):
        engine = Engine(target, EngineParams(max_running=args.requests, num_blocks=args.requests * 200,
                                             max_batch_tokens=1024), record_blocks=False)
        ids = [engine.add_request(prompt.format(i=i), SamplingParams(),
                                  GenerationParams(max_new_tokens=args.steps + 40)) for i in range(args.requests)]
        while any(engine.requests[i].num_computed < len(engine.requests[i].prompt_ids) for i in ids):
            engine.step()  # prefills, and the decode steps beside them
        times, tokens = [], 0
        for _ in range(args.steps):
            start = time.perf_counter()
            tokens += sum(len(out.new_token_ids) for out in engine.step())
            times.append(time.perf_counter() - start)
        prompt_tokens = statistics.mean(len(engine.requests[i].prompt_ids) for i in ids)
        print(f"{name}: prompts of {prompt_tokens:.0f} tokens, {len(engine.running)} running: "
              f"{1000 * statistics.median(times):.1f} ms a step, {tokens / sum(times):.0f} tokens/s", flush=True)


if __name__ == "__main__":
    main()
