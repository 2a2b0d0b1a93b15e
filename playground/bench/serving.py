"""`python -m playground bench --suite serving`: throughput of the engine serving many requests at once.

One workload (N requests built from the prompt suite, with output limits cycling from an eighth of
--max-new-tokens to all of it, all queued at time 0) runs many ways on the same engine and paged cache:
continuous batching, static batching (a new batch only when the whole previous one has finished),
sequentially (one request at a time), continuous and sequential again with every registered algorithm's proposer
(those that read weights where theirs ship for the target), and sequential with prompt lookup's copies grafted onto
the trees of the first algorithm that takes them (`both`). Greedy outputs must be identical in every mode. KV
memory is read from the engine's per-step memory events: the paged pool's internal fragmentation versus what
reserving prompt + max_new_tokens slots per running request (a contiguous cache) would waste.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

from ..config import EngineParams, GenerationParams, SamplingParams
from ..decoding.prompt_lookup import PromptLookupParams
from ..decoding.proposer import Proposer
from ..decoding.registry import ALGORITHMS, PLAIN, build_proposer
from ..decoding.spec import Algorithm
from ..engine import Engine
from ..metrics import memory_summary
from .suite import workload


def key(spec: Algorithm) -> str:
    """How the report's ratios name an algorithm's modes (`medusa_vs_continuous`, ...)."""
    return spec.mode.lower().replace(" ", "_").replace("-", "_")


def runs(spec: Algorithm, source: str) -> bool:
    """Whether the suite runs an algorithm for a target: where it needs no weights, or they ship for it."""
    return spec.ships is None or spec.ships(source) is not None


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
        "continuous": (many, PLAIN, None), "static": (replace(many, policy="static"), PLAIN, None),
        "sequential": (one, PLAIN, None)}
    running = [spec for spec in ALGORITHMS.values() if runs(spec, target.spec.source)]
    for spec in ALGORITHMS.values():
        if spec in running:
            modes.update({f"continuous + {spec.mode}": (many, spec.name, None),
                          f"sequential + {spec.mode}": (one, spec.name, None)})
        else:
            progress(f"no weights of {spec.label} ship for this model: the serving suite runs without its modes")
    both = next((spec for spec in running if spec.grafts), None)  # the first that grafts copies, with them
    if both is not None:
        modes["sequential + both"] = (one, both.name, PromptLookupParams())
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
        **{f"{key(spec)}_vs_{mode}": results[f"{mode} + {spec.mode}"]["tokens_per_s"] / base["tokens_per_s"]
           for spec in running for mode, base in (("continuous", continuous), ("sequential", sequential))},
        **({"both": both.name, "both_vs_sequential": results["sequential + both"]["tokens_per_s"]
            / sequential["tokens_per_s"]} if both is not None else {}),
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

    from ..api import Service, listen

    service = Service(target, EngineParams(num_blocks=64, block_size=8, max_running=1), listen("127.0.0.1", 0),
                      quiet=True)
    service.start()
    worker = threading.Thread(target=service.worker.run)
    worker.start()
    while not service.http.started:
        time.sleep(0.01)
    body: dict[str, Any] = {"prompt": "Hello", "max_tokens": 1}
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
              *(_algorithm_line(spec, s) for spec in ALGORITHMS.values()),
              f"- KV waste (paged internal fragmentation / KV in use, summed over steps): "
              f"{100 * s['kv_waste_fraction']:.1f}% (goal < 4%); contiguous reservation of prompt + max_new_tokens "
              f"per request would waste {100 * s['contiguous_waste_fraction']:.0f}%",
              f"- same greedy tokens in every mode: {'yes' if s['same_tokens_in_every_mode'] else 'NO'}",
              f"- HTTP, a 1-token completion through {s['http']['client']} (median of {s['http']['requests']}): "
              f"{1000 * s['http']['keep_alive_s']:.1f} ms on a kept-alive connection, "
              f"{1000 * s['http']['fresh_s']:.1f} ms on a fresh one: {s['http']['keep_alive_vs_fresh']:.2f}x "
              "(goal <= 1.2)"]
    return "\n".join(lines) + "\n"


def _algorithm_line(spec: Algorithm, s: dict[str, Any]) -> str:
    """The summary's line for an algorithm: its ratios, or why it did not run."""
    if key(spec) + "_vs_continuous" not in s:
        return f"- {spec.label} in the batch: not run (no weights of it ship for this model)"
    both = f"; with prompt lookup too: {s['both_vs_sequential']:.2f}x sequential" if s.get("both") == spec.name \
        else ""
    return (f"- {spec.label} in the batch: {s[key(spec) + '_vs_continuous']:.2f}x continuous, "
            f"{s[key(spec) + '_vs_sequential']:.2f}x sequential{both} (the same tokens)")
