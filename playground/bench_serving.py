"""`python -m playground bench --suite serving`: throughput of the engine serving many requests at once.

One workload (N requests built from the prompt suite, with output limits cycling from an eighth of
--max-new-tokens to all of it, all queued at time 0) runs up to fourteen ways on the same engine and paged cache:
continuous batching, static batching (a new batch only when the whole previous one has finished),
sequentially (one request at a time), continuous and sequential again with the proposers of prompt lookup,
lookahead, and the Medusa heads, the draft model and the EAGLE head where they ship for the target, and sequential
with prompt lookup's copies grafted onto the Medusa heads' trees. Greedy
outputs must be identical in every mode. KV memory is read from the engine's per-step memory events: the paged
pool's internal fragmentation versus what reserving prompt + max_new_tokens slots per running request (a
contiguous cache) would waste.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

from .bench_suite import workload
from .config import EngineParams, GenerationParams, PromptLookupParams, SamplingParams
from .decoding.proposer import Proposer
from .decoding.registry import build_proposer
from .engine import Engine
from .metrics import memory_summary
from .models.eagle import default_head
from .models.loader import default_draft
from .models.medusa import default_heads


@dataclass(frozen=True)
class Shipped:
    """A proposer the suite runs continuous and sequential where its weights ship for the target: `key` names its
    ratios (`medusa_vs_continuous`, ...), `mode` its modes, `ships` finds its weights for a target spec; `both`:
    it also runs sequential with prompt lookup's copies grafted onto its trees (`sequential + both`)."""

    key: str
    mode: str
    algo: str
    ships: Callable[[str], str | None]
    what: str  # how the summary names its proposals
    missing: str  # what the suite says when none ship
    both: bool = False


SHIPPED = (Shipped("medusa", "Medusa", "medusa", default_heads, "Medusa heads' trees", "no Medusa heads ship",
                   both=True),
           Shipped("draft", "draft", "speculative", default_draft, "the draft's chains", "no draft ships"),
           Shipped("eagle", "EAGLE", "eagle", default_head, "the EAGLE head's trees", "no EAGLE head ships"))


def serve(target: Any, requests: list[tuple[str, GenerationParams]], params: EngineParams,
          proposer: Proposer | None = None) -> dict[str, Any]:
    """Run the workload to the end on a fresh engine; throughput and memory from its own clock and events."""
    engine = Engine(target, params, record_blocks=False, proposer=proposer)
    ids = [engine.add_request(prompt, SamplingParams(), generation) for prompt, generation in requests]
    try:
        outputs = engine.run_all()
    finally:
        engine.close()
    tokens = sum(len(outputs[i].token_ids) for i in ids)
    return {
        "tokens": tokens,
        "wall_s": engine.busy_s,
        "tokens_per_s": tokens / engine.busy_s,
        "steps": engine.step_count,
        "preemptions": sum(r.preemptions for r in engine.requests.values()),
        "proposals": {source: asdict(counts) for source, counts in engine.counts.items()},
        **memory_summary(engine.events),
        "token_ids": [list(outputs[i].token_ids) for i in ids],
    }


def run_serving(target: Any, num_requests: int, max_new_tokens: int, max_running: int, block_size: int,
                num_blocks: int, progress: Any) -> dict[str, Any]:
    requests = workload(num_requests, max_new_tokens)
    many = EngineParams(num_blocks=num_blocks, block_size=block_size, max_running=max_running)
    one = EngineParams(num_blocks=num_blocks, block_size=block_size, max_running=1)
    # mode -> (engine settings, algorithm, prompt lookup's copies grafted onto its trees)
    modes: dict[str, tuple[EngineParams, str, PromptLookupParams | None]] = {
        "continuous": (many, "ar", None), "static": (replace(many, policy="static"), "ar", None),
        "sequential": (one, "ar", None), "continuous + prompt lookup": (many, "prompt-lookup", None),
        "sequential + prompt lookup": (one, "prompt-lookup", None),
        "continuous + lookahead": (many, "lookahead", None), "sequential + lookahead": (one, "lookahead", None),
    }
    shipped = [family for family in SHIPPED if family.ships(target.spec.source) is not None]
    for family in SHIPPED:
        if family in shipped:
            modes.update({f"continuous + {family.mode}": (many, family.algo, None),
                          f"sequential + {family.mode}": (one, family.algo, None)})
        else:
            progress(f"{family.missing} for this model: the serving suite runs without the {family.mode} modes")
    for family in shipped:
        if family.both:
            modes["sequential + both"] = (one, family.algo, PromptLookupParams())
    serve(target, workload(2, 8), many)  # warm-up: first-call allocations and kernel choices
    http = http_latency(target)
    progress(f"HTTP, a 1-token completion through {http['client']}: {1000 * http['keep_alive_s']:.1f} ms on a "
             f"kept-alive connection, {1000 * http['fresh_s']:.1f} ms on a fresh one")
    results = {}
    for name, (params, algo, copies) in modes.items():
        results[name] = serve(target, requests, params, build_proposer(target, algo, copies=copies))
        progress(f"{name}: {results[name]['tokens']} tokens in {results[name]['wall_s']:.1f} s = "
                 f"{results[name]['tokens_per_s']:.1f} tok/s")
    same = all(results[m]["token_ids"] == results["continuous"]["token_ids"] for m in modes)
    for result in results.values():
        del result["token_ids"]
    continuous, sequential = results["continuous"], results["sequential"]
    return {
        "requests": num_requests, "max_new_tokens": max_new_tokens, "max_running": max_running,
        "block_size": block_size, "num_blocks": num_blocks,
        "continuous_tokens_per_s": continuous["tokens_per_s"],
        "static_tokens_per_s": results["static"]["tokens_per_s"],
        "sequential_tokens_per_s": sequential["tokens_per_s"],
        "continuous_vs_sequential": continuous["tokens_per_s"] / sequential["tokens_per_s"],
        "continuous_vs_static": continuous["tokens_per_s"] / results["static"]["tokens_per_s"],
        "lookup_vs_continuous": results["continuous + prompt lookup"]["tokens_per_s"] / continuous["tokens_per_s"],
        "lookup_vs_sequential": results["sequential + prompt lookup"]["tokens_per_s"] / sequential["tokens_per_s"],
        "lookahead_vs_continuous": results["continuous + lookahead"]["tokens_per_s"] / continuous["tokens_per_s"],
        "lookahead_vs_sequential": results["sequential + lookahead"]["tokens_per_s"] / sequential["tokens_per_s"],
        **{f"{family.key}_vs_{mode}": results[f"{mode} + {family.mode}"]["tokens_per_s"] / base["tokens_per_s"]
           for family in shipped for mode, base in (("continuous", continuous), ("sequential", sequential))},
        **({"both_vs_sequential": results["sequential + both"]["tokens_per_s"] / sequential["tokens_per_s"]}
           if "sequential + both" in results else {}),
        "kv_waste_fraction": continuous["kv_waste_fraction"],
        "contiguous_waste_fraction": continuous["contiguous_waste_fraction"],
        "same_tokens_in_every_mode": same,
        "http": http,
        "modes": results,
    }


def http_latency(target: Any, rounds: int = 5, per_round: int = 8) -> dict[str, Any]:
    """The median time of a 1-token completion over HTTP (`playground.api`, plain decoding) on a kept-alive
    connection against a fresh connection per request, interleaved over `rounds`; through the `openai` client where
    it is installed (it keeps connections alive, as every OpenAI client does), else `http.client`."""
    import http.client
    import json
    import statistics
    import threading
    import time

    from .api import Service, listen

    service = Service(target, EngineParams(num_blocks=64, block_size=8, max_running=1), listen("127.0.0.1", 0),
                      quiet=True)
    service.start()
    worker = threading.Thread(target=service.worker.run)
    worker.start()
    while not service.http.started:
        time.sleep(0.01)
    body = {"prompt": "Hello", "max_tokens": 1}
    try:
        import openai

        def client() -> Callable[[], Any]:
            kept = openai.OpenAI(base_url=f"{service.url}/v1", api_key="unused", max_retries=0)
            return lambda: kept.completions.create(model=target.name, **body)
        name = f"the openai client {openai.__version__}"
    except ImportError:
        def client() -> Callable[[], Any]:
            kept = http.client.HTTPConnection(service.host, service.port)

            def send() -> bytes:
                kept.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
                return kept.getresponse().read()
            return send
        name = "http.client"
    times: dict[str, list[float]] = {"keep_alive": [], "fresh": []}
    try:
        kept = client()
        kept()  # the connection opened, the first request's costs paid
        for _ in range(rounds):
            for mode in times:
                for _ in range(per_round):
                    send = kept if mode == "keep_alive" else client()
                    start = time.perf_counter()
                    send()
                    times[mode].append(time.perf_counter() - start)
    finally:
        service.worker.close()
        worker.join()
        service.stop()
    keep_alive, fresh = statistics.median(times["keep_alive"]), statistics.median(times["fresh"])
    return {"client": name, "requests": rounds * per_round, "keep_alive_s": keep_alive, "fresh_s": fresh,
            "keep_alive_vs_fresh": keep_alive / fresh}


def markdown_serving(report: dict[str, Any]) -> str:
    s = report["serving"]
    lines = [f"# Serving benchmark: {report['model']}, {report['environment']['device']}, "
             f"{report['environment']['dtype']}", "",
             f"{s['requests']} requests queued at once, output limits {max(1, s['max_new_tokens'] // 8)} to "
             f"{s['max_new_tokens']} tokens, at most {s['max_running']} running, paged KV with "
             f"{s['num_blocks']} blocks of {s['block_size']} tokens.", "",
             "| mode | tokens | seconds | tok/s | steps | mean running | preemptions | peak KV MB | proposed tokens "
             "accepted (by source) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in s["modes"].items():
        proposals = "; ".join(f"{source} {c['accepted']} of {c['proposed']} in {c['steps']} steps"
                              for source, c in r["proposals"].items())
        lines.append(f"| {name} | {r['tokens']} | {r['wall_s']:.1f} | {r['tokens_per_s']:.1f} | {r['steps']} | "
                     f"{r['mean_running']:.1f} | {r['preemptions']} | {r['peak_kv_bytes'] / 1e6:.1f} | "
                     f"{proposals} |")
    lines += ["",
              f"- continuous vs sequential: {s['continuous_vs_sequential']:.2f}x (goal >= 3)",
              f"- continuous vs static: {s['continuous_vs_static']:.2f}x",
              f"- prompt lookup in the batch: {s['lookup_vs_continuous']:.2f}x continuous, "
              f"{s['lookup_vs_sequential']:.2f}x sequential (the same tokens)",
              f"- lookahead in the batch: {s['lookahead_vs_continuous']:.2f}x continuous, "
              f"{s['lookahead_vs_sequential']:.2f}x sequential (the same tokens)",
              *(_shipped_line(family, s) for family in SHIPPED),
              f"- KV waste (paged internal fragmentation / KV in use, summed over steps): "
              f"{100 * s['kv_waste_fraction']:.1f}% (goal < 4%); contiguous reservation of prompt + max_new_tokens "
              f"per request would waste {100 * s['contiguous_waste_fraction']:.0f}%",
              f"- same greedy tokens in every mode: {'yes' if s['same_tokens_in_every_mode'] else 'NO'}",
              f"- HTTP, a 1-token completion through {s['http']['client']} (median of {s['http']['requests']}): "
              f"{1000 * s['http']['keep_alive_s']:.1f} ms on a kept-alive connection, "
              f"{1000 * s['http']['fresh_s']:.1f} ms on a fresh one: {s['http']['keep_alive_vs_fresh']:.2f}x "
              "(goal <= 1.2)"]
    return "\n".join(lines) + "\n"


def _shipped_line(family: Shipped, s: dict[str, Any]) -> str:
    """The summary's line for a shipped proposer: its ratios, or why it did not run."""
    if family.key + "_vs_continuous" not in s:
        return f"- {family.what} in the batch: not run ({family.missing} for this model)"
    both = f"; with prompt lookup too: {s['both_vs_sequential']:.2f}x sequential" if family.both else ""
    return (f"- {family.what} in the batch: {s[family.key + '_vs_continuous']:.2f}x continuous, "
            f"{s[family.key + '_vs_sequential']:.2f}x sequential{both} (the same tokens)")
