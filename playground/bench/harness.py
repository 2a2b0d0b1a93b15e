"""Benchmark harness (`python -m playground bench`): our algorithms vs plain decoding vs transformers, in one run.

Speed claims are ratios measured in the same process, one prompt after another, because these machines are
noisy; absolute tokens/s are reported next to the memory-bandwidth bound that caps batch-1 decoding.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ..cli import check_writable, model_spec
from ..config import (
    MAX_GAMMA,
    PLANS,
    ConfigError,
    EngineParams,
    GenerationParams,
    ModelSpec,
    SamplingParams,
    check_int,
)
from ..decoding import encode_prompt
from ..decoding.costs import LoadMeter, OneRequest
from ..decoding.prompt_lookup import LOOKUP_TOKENS, CopyProposer, PromptLookupParams
from ..decoding.registry import ALGORITHMS, PLAIN, algorithm, build_proposer, find
from ..decoding.tree import DYNAMIC_TREE
from ..engine import generate, one_request_costs, warm_up
from ..metrics import chain_prediction, compute, depth_profile, drafting_note, perfect, priced
from ..models import LoadedModel, ModelLoadError, load_model
from ..models.loader import default_draft, load_hf_peer, source_gguf
from ..models.transformer import Transformer
from ..remote import Remote, endpoint_urls
from ..speedup import ROUNDS, Speedup, compare, measure, median_interval, median_run
from .kernel import markdown_kernel, run_kernel
from .peers import PeerRuns, Run, endpoint_stats, llama_cpp_peer, run_hf, run_llama, run_stats
from .quality import MIN_TOKENS, held_out_text, llama_logits, markdown_quality, measure_quality, window_logits
from .quality import windows as token_windows
from .report import REACHED, Costs, add_copy_bounds, environment, markdown, write_report
from .serving import markdown_serving, run_serving
from .suite import GROUNDED, SUITE, per_category, read_prompts_file, spread


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--suite", default="default", choices=["default", "serving", "kernel", "quality"],
                        help="default: every algorithm per prompt against plain decoding; serving: the batching "
                             "engine with continuous vs static batching vs one request at a time; kernel: the "
                             "native matrix products and the one-token forward against this processor's bounds; "
                             "quality: each way of reading a GGUF model's weights against its float32 weights "
                             "(KL divergence, top-1 agreement, perplexity on held-out text)")
    parser.add_argument("--max-new-tokens", type=int, default=128,
                        help="1..4096 (default 128); serving: the longest output limit of the workload")
    parser.add_argument("--limit", type=int, default=None,
                        help="run only N prompts of the suite, spread over its categories (one of each first); "
                             "quality: only N windows of held-out text")
    parser.add_argument("--prompts", default=None, metavar="FILE.jsonl",
                        help="the prompts to race instead of the built-in suite: JSONL rows {\"prompt\": ..., "
                             "\"category\": ...} or Spec-Bench's question.jsonl (each row's first turn, by its "
                             "category); the report adds a table per category as Spec-Bench tabulates")
    parser.add_argument("--per-category", type=int, default=None,
                        help="run only the first N prompts of each category, 1..1000")
    parser.add_argument("--rounds", type=int, default=ROUNDS,
                        help=f"runs of plain decoding and each algorithm per prompt, interleaved; speedups are the "
                             f"median of their rounds' ratios, 1..10 (default {ROUNDS})")
    parser.add_argument("--no-peers", action="store_true",
                        help="skip the peers: transformers, llama.cpp (when llama-cpp-python is installed and the "
                             "model is a GGUF file) and, for --weights gguf, plain decoding on the float32 weights")
    parser.add_argument("--draft", default=None,
                        help="draft model spec: adds speculative decoding and transformers assisted generation "
                             "(default for the embedded model: its shipped draft; 'none' to skip)")
    parser.add_argument("--gamma", type=int, default=4, help="draft tokens per step for --draft, 1..16 (default 4)")
    parser.add_argument("--tree", default=DYNAMIC_TREE,
                        help="Medusa candidate tree: dynamic (default), chain, small, medium, wide or a JSON file "
                             "of top-k paths")
    parser.add_argument("--plan", default="measured", choices=PLANS,
                        help="how much the algorithms' steps draft and verify: measured (default; only guesses that "
                             "should save time on this machine) or as-set (all their settings ask for)")
    names = ",".join(ALGORITHMS)
    parser.add_argument("--algos", default=names,
                        help=f"comma-separated algorithms to race against plain decoding (default {names})")
    serving = parser.add_argument_group("serving suite (--suite serving)")
    serving.add_argument("--requests", type=int, default=16, help="requests in the workload, 1..256 (default 16)")
    serving.add_argument("--max-running", type=int, default=16, help="requests decoded together, 1..256 (default 16)")
    serving.add_argument("--block-size", type=int, default=8, help="tokens per KV block, 1..256 (default 8)")
    serving.add_argument("--num-blocks", type=int, default=512, help="KV blocks in the pool (default 512)")
    remote = parser.add_argument_group("remote lanes: any OpenAI-compatible server (vLLM, SGLang, llama.cpp's, ours)")
    remote.add_argument("--endpoint", default=None, metavar="URL[,URL...]",
                        help="also stream every prompt from these servers' /v1/chat/completions (base URLs such as "
                             "http://127.0.0.1:8000/v1), interleaved with the local runs; reported as wall-clock "
                             "tok/s over HTTP beside plain decoding, with no steps and no exactness check")
    remote.add_argument("--endpoint-model", default=None,
                        help="the model to ask each endpoint for (default: the first its /v1/models lists)")
    remote.add_argument("--endpoint-key", default=None,
                        help="the endpoints' API key (default: $OPENAI_API_KEY, else none)")
    parser.add_argument("--json", default=None,
                        help="where to write the JSON results (default bench_results/bench.json, serving.json)")
    parser.add_argument("--markdown", default=None,
                        help="where to write the markdown table (default bench_results/bench.md, serving.md)")
    parser.set_defaults(func=cmd_bench)


def copy_bandwidth(device: torch.device, megabytes: int = 256, repeats: int = 10) -> float:
    """Bytes/s of a large tensor copy, counting the read and the write (the STREAM 'copy' convention)."""
    src = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / best


def weight_bytes_per_token(model: Transformer) -> int:
    """Bytes of weights one decode step reads: every parameter as the forward reads it (a product's weight as the
    native kernel's panels, which hold 16-bit floats where the weight is exactly those), except that an untied input
    embedding only contributes the one row it looks up (a tied one is read whole as the output projection)."""
    read = {id(p): p.numel() * p.element_size() for p in model.parameters()}
    for weight, panels in model.packed_products():
        read[id(weight)] = panels.data.numel() * panels.data.element_size()
    if model.lm_head is not None:
        emb = model.embed_tokens.weight
        read[id(emb)] = emb.shape[1] * emb.element_size()
    return sum(read.values())


def trace_of(target: Any, contender: Contender, prompt: str, generation: GenerationParams) -> Any:
    """One generation on our engine (on the contender's own target where it has one): its trace."""
    return generate(contender.target or target, prompt, contender.proposer, contender.sampling, generation,
                    contender.algo)[1]


def run_of(trace: Any) -> Run:
    """A trace's run as the report counts it."""
    ids = trace.finished().token_ids
    return Run(len(ids), compute(trace).wall_s, tuple(ids))


# the rows of plain decoding on float32 weights, of plain decoding with eager forwards, and of llama.cpp
FLOAT32, EAGER, LLAMA, SAMPLED_PLAIN = "ar-float32", "ar-eager", "llama.cpp", "ar-sampled"
FLOAT_BLOCKS = "ar-gguf"  # plain decoding on the GGUF blocks against float32 activations
SUITE_CONTEXT = 2048  # llama.cpp's context: the suite's longest prompt and output fit
# Under the measured plan a contender may always verify nothing, so its median speedup should not fall below this
# beyond noise: below it while the upper end of its interval (`median_interval`) is too is a loss
NEVER_BELOW = 0.98
SAMPLED = SamplingParams(temperature=0.7, seed=0)  # Medusa's lossless vs typical acceptance differ only when sampling


@dataclass(frozen=True, slots=True)
class Contender:
    """One algorithm in the benchmark, with the transformers feature that does the same thing (if any)."""

    name: str
    algo: str
    proposer: Any  # None: plain decoding
    setting: str  # its parameters, for the report
    peer: str | None = None  # the transformers feature used as its peer
    peer_kwargs: dict[str, Any] | None = None
    sampling: SamplingParams = SamplingParams()  # SAMPLED: its tokens are not expected to equal greedy plain decoding
    target: Any = None  # the model it runs on, where not the bench's target (plain decoding on float32 weights or
    # with eager forwards)

    @property
    def sampled(self) -> bool:
        return not self.sampling.greedy

    @property
    def drafts(self) -> bool:
        """Whether it runs a draft model (whose chains the chain formula and assisted generation describe)."""
        spec = find(self.algo)
        return spec is not None and spec.loads_draft


def setting(proposer: Any, *extra: str) -> str:
    """A proposer's settings as the report shows them."""
    shown = [f"{key.replace('_', ' ')} {value}" for key, value in proposer.describe().items() if key != "proposer"]
    return ", ".join([*shown, *extra])


def build_contenders(args: argparse.Namespace, target: Any) -> tuple[list[Contender], Any]:
    """The algorithms to race against plain decoding, each with its defaults (and --gamma and --tree where its
    parameters have those fields), with prompt lookup's copies grafted where it grafts, and its variants
    (`spec.Variant`); and the draft model, where an algorithm runs one."""
    contenders, draft = [], None
    copies = PromptLookupParams(num_draft=LOOKUP_TOKENS, branches=1)  # the copying variants graft one span
    for name in args.algos:
        spec = algorithm(name)
        known = {f.name for f in fields(spec.params)} if spec.params is not None else set()
        changes = {key: value for key, value in (("gamma", args.gamma), ("tree", args.tree)) if key in known}
        if spec.loads_draft:
            source = default_draft(args.model) if args.draft is None else args.draft
            if not source or source == "none":
                continue
            draft = draft or load_model(ModelSpec(source=source, device=args.device, dtype=args.dtype,
                                                  cache_dir=args.cache_dir))
            changes["draft"] = source
        base = build_proposer(target, name, spec.make(changes), draft=draft if spec.loads_draft else None)
        assert base is not None  # a registered algorithm's proposer
        loaded = base.loaded()
        # transformers has no copy proposals: a copying variant meets the same peer run as its copy-free row
        peer, peer_kwargs = spec.peer(base) if spec.peer is not None else (None, None)
        contenders.append(Contender(name, name, base, setting(base), peer, peer_kwargs))
        if spec.grafts:
            grafting = build_proposer(target, name, spec.make(changes), copies, **loaded)
            contenders.append(Contender(f"{name}-copy", name, grafting, setting(grafting), peer,
                                        None if peer_kwargs is None else dict(peer_kwargs)))
        for variant in spec.variants:
            proposer = build_proposer(target, name, spec.make({**changes, **variant.changes}), **loaded)
            sampled = (f"temperature {SAMPLED.temperature}", f"seed {SAMPLED.seed}") if variant.sampled else ()
            contenders.append(Contender(f"{name}-{variant.suffix}", name, proposer,
                                        setting(proposer, *sampled, *([variant.note] if variant.note else [])),
                                        sampling=SAMPLED if variant.sampled else SamplingParams()))
    return contenders, draft


def parse_algos(text: str) -> tuple[str, ...]:
    names = tuple(a.strip() for a in text.split(",") if a.strip())
    unknown = [a for a in names if a not in ALGORITHMS]
    if unknown:
        raise ConfigError(f"algos: unknown {', '.join(unknown)}; choose from {', '.join(ALGORITHMS)} (comma-separated)")
    return names


def float_activation_peer(spec: ModelSpec) -> LoadedModel | None:
    """The model's GGUF blocks against float32 activations, or None (said in one line) where its file holds no
    matrix those products read (they read Q8_0 and Q4_1, and Q4_0 and Q5_0 through them)."""
    try:
        return load_model(replace(spec, weights="gguf"))
    except ModelLoadError as exc:
        reason = str(exc).removeprefix("weights: ").removesuffix("; use --weights float32")
        print(f"bench: no row for the blocks against float32 activations: {reason}", file=sys.stderr, flush=True)
        return None


def loading(spec: ModelSpec) -> ModelSpec:
    """`spec`, once the user has been told it loads."""
    print(f"Loading model {spec.source!r}...", file=sys.stderr, flush=True)
    return spec


def cmd_bench(args: argparse.Namespace) -> int:
    """`python -m playground bench`: the options checked, then the suite asked for; the default suite in its phases:
    the prompts chosen, the contenders planned, warmed up, raced prompt by prompt, summarised and reported."""
    check_options(args)
    if args.suite != "default":
        return SUITES[args.suite](args)
    suite, indices = chosen_prompts(args)
    remotes = connect(args)  # refused, or unreachable, before any model loads
    bench = plan_bench(args, remotes)
    warm(bench, args.plan)
    tally = Tally(contenders={c.name: Costs() for c in bench.contenders})
    for run, index in enumerate(indices):
        category, prompt = suite[index]
        tally.bandwidths.append(copy_bandwidth(bench.target.model.device))  # a shared host's bandwidth drifts
        row, progress = race_prompt(bench, args, index, category, prompt, tally)
        tally.rows.append(row)
        print(f"[{run + 1}/{len(indices)}] {category}: {progress} tok/s", file=sys.stderr, flush=True)
    report = summarise(bench, args, tally)
    return write_report(args, report, markdown(report))


def check_options(args: argparse.Namespace) -> None:
    """The options every suite shares, checked (and the output files' defaults set) before any model loads; the
    default suite's too."""
    check_int("max_new_tokens", args.max_new_tokens, 1, 4096)
    check_int("rounds", args.rounds, 1, 10)
    stem = "bench" if args.suite == "default" else args.suite
    args.json = args.json or f"bench_results/{stem}.json"
    args.markdown = args.markdown or f"bench_results/{stem}.md"
    check_writable("json", [Path(args.json)], create_folders=True)  # before minutes of work, not after
    check_writable("markdown", [Path(args.markdown)], create_folders=True)
    if args.suite == "default":
        check_int("gamma", args.gamma, 1, MAX_GAMMA)
        args.algos = parse_algos(args.algos) if isinstance(args.algos, str) else args.algos


def chosen_prompts(args: argparse.Namespace) -> tuple[Sequence[tuple[str, str]], list[int]]:
    """The suite (the built-in one, or --prompts's file) and the indices of its prompts to race: --per-category's
    first of each category, then --limit of them spread over the categories."""
    suite = SUITE if args.prompts is None else read_prompts_file(args.prompts)
    indices = list(range(len(suite)))
    if args.per_category is not None:
        check_int("per_category", args.per_category, 1, 1000)
        indices = per_category(suite, args.per_category)
    if args.limit is not None:
        check_int("limit", args.limit, 1, len(indices))
        chosen = spread(args.limit, [suite[i] for i in indices])
        indices = [indices[i] for i in chosen]
    return suite, indices


@dataclass
class Bench:
    """Everything the default suite races on each prompt: the target, plain decoding (and plain decoding sampled,
    where a contender samples), the contenders, the peers (transformers, llama.cpp, remote endpoints; None or empty
    where absent) and the forward costs the engine plans on."""

    target: LoadedModel
    generation: GenerationParams
    baselines: list[Contender]
    contenders: list[Contender]
    hf_model: Any
    llm: Any
    remotes: dict[str, Remote]
    relative_cost: OneRequest

    @property
    def plain(self) -> Contender:
        return self.baselines[0]

    @property
    def sampled_plain(self) -> Contender | None:
        return self.baselines[1] if len(self.baselines) > 1 else None


@dataclass
class Tally:
    """What the rounds leave for the summary: a row per prompt, the copy bandwidth measured before each, the step
    costs of plain decoding's runs and each contender's, and each prompt's ids with plain decoding's tokens."""

    contenders: dict[str, Costs]
    plain: Costs = field(default_factory=Costs)
    rows: list[dict[str, Any]] = field(default_factory=list)
    bandwidths: list[float] = field(default_factory=list)
    plain_outputs: list[tuple[list[int], list[int]]] = field(default_factory=list)


def plan_bench(args: argparse.Namespace, remotes: dict[str, Remote]) -> Bench:
    """The target loaded, the contenders built (`build_contenders`), plain decoding's other rows (float32 weights,
    the blocks against float32 activations, eager forwards) and the peers, unless --no-peers."""
    target = load_model(loading(model_spec(args)))
    plain = Contender(PLAIN, PLAIN, None, "plain decoding")
    contenders, draft = build_contenders(args, target)
    # a sampled variant races plain decoding sampled alike: drawing from a softmax costs plain decoding too
    sampled = [Contender(SAMPLED_PLAIN, PLAIN, None, "plain decoding, sampled", sampling=SAMPLED)
               if any(c.sampled for c in contenders) else None]
    peers = not args.no_peers
    if target.weights in ("gguf-int8", "gguf") and peers:  # the same model's float32 weights
        contenders.insert(0, Contender(FLOAT32, PLAIN, None, "plain decoding on the dequantised float32 weights",
                                       target=load_model(replace(target.spec, weights="float32"))))
    floats = float_activation_peer(target.spec) if target.weights == "gguf-int8" and peers else None
    if floats is not None:  # the same blocks against float32 activations
        contenders.insert(0, Contender(FLOAT_BLOCKS, PLAIN, None, "plain decoding on the GGUF blocks with float32 "
                                       "activations", target=floats))
    if target.forwards != "eager":  # the same weights' forwards each at its own shape: what the static shapes buy
        contenders.insert(0, Contender(EAGER, PLAIN, None, "plain decoding with eager forwards",
                                       target=replace(target, forwards="eager")))
    hf_model = load_hf_peer(target) if peers else None
    llm = llama_cpp_peer(source_gguf(target.spec), max(SUITE_CONTEXT, 512 + args.max_new_tokens)) if peers else None
    if hf_model is not None and draft is not None:
        assistant = load_hf_peer(draft)
        for contender in contenders:
            if contender.peer_kwargs is not None and contender.drafts:
                contender.peer_kwargs["assistant_model"] = assistant
    return Bench(target, GenerationParams(max_new_tokens=args.max_new_tokens, plan=args.plan),
                 [plain, *[s for s in sampled if s is not None]], contenders, hf_model, llm, remotes,
                 one_request_costs(target))  # the curve the engine plans on: quoted where a run drafted little


def warm(bench: Bench, plan: str) -> None:
    """Every contender and peer run once on a short prompt: its first calls paid, its proposer's prices left
    unlearned."""
    warm = GenerationParams(max_new_tokens=8, plan=plan)
    target, warm_ids = bench.target, encode_prompt(bench.target, "Hello", warm)
    print(f"Warming up {len(bench.baselines) + len(bench.contenders)} contenders...", file=sys.stderr, flush=True)
    for contender in (*bench.baselines, *bench.contenders):
        warm_up(contender.target or target, "Hello", contender.proposer, contender.sampling, warm, contender.algo)
    if bench.llm is not None:
        run_llama(bench.llm, warm_ids, target, warm)
    for remote in bench.remotes.values():
        remote.stream("Hello", warm.max_new_tokens)
    if bench.hf_model is not None:
        run_hf(bench.hf_model, warm_ids, target, warm)
        for contender in bench.contenders:
            if contender.peer_kwargs is not None:
                run_hf(bench.hf_model, warm_ids, target, warm, **contender.peer_kwargs)


def race_prompt(bench: Bench, args: argparse.Namespace, index: int, category: str, prompt: str,
                tally: Tally) -> tuple[dict[str, Any], str]:
    """One prompt: plain decoding, every contender and the peers interleaved over --rounds rounds (each row shows
    its median round); its row of the report and its progress line."""
    target, generation = bench.target, bench.generation
    prompt_ids = encode_prompt(target, prompt, generation)
    entrants = {c.name: partial(trace_of, target, c, prompt, generation) for c in (*bench.baselines,
                                                                                  *bench.contenders)}
    if bench.llm is not None:
        entrants[LLAMA] = partial(run_llama, bench.llm, prompt_ids, target, generation)
    for label, remote in bench.remotes.items():
        entrants[label] = partial(remote.stream, prompt, args.max_new_tokens)
    meter = LoadMeter()
    traces = measure(entrants, args.rounds)
    others = meter.others()
    llama_runs = traces.pop(LLAMA, None)
    remote_runs = {label: traces.pop(label) for label in bench.remotes}
    speedups = compare(traces, bench.plain.name, others)
    if bench.sampled_plain is not None:
        sampled_speedups = compare(traces, bench.sampled_plain.name, others)
        speedups.update({c.name: sampled_speedups[c.name] for c in bench.contenders if c.sampled})
    plain_trace = median_run(traces[bench.plain.name])
    tally.plain.add(plain_trace, index)
    ours = run_of(plain_trace)
    row: dict[str, Any] = {"index": index, "category": category, "prompt": prompt, "prompt_tokens": len(prompt_ids),
                           "ar": run_stats(ours), "algos": {}, "ar_spread": speedups[bench.plain.name].spread}
    tally.plain_outputs.append((prompt_ids, list(ours.token_ids)))
    progress = f"ours {ours.tokens_per_s:.1f}"
    if bench.sampled_plain is not None:  # what the sampled variants are measured against
        row["ar_sampled"] = run_stats(run_of(median_run(traces[bench.sampled_plain.name])))
    if llama_runs is not None:
        row["llama_cpp"] = run_stats(sorted(llama_runs, key=lambda r: r.tokens_per_s)[len(llama_runs) // 2])
        row["ratio_vs_llama_cpp"] = statistics.median(
            run_of(t).tokens_per_s / r.tokens_per_s for t, r in zip(traces[bench.plain.name], llama_runs))
        progress += f", llama.cpp {row['llama_cpp']['tokens_per_s']:.1f}"
    if bench.remotes:
        plain_runs = [run_of(t) for t in traces[bench.plain.name]]
        row["endpoints"] = {label: endpoint_stats(runs, plain_runs) for label, runs in remote_runs.items()}
        progress += "".join(f", {label} {e['tokens_per_s']:.1f} (remote)" for label, e in row["endpoints"].items())
    if bench.hf_model is not None:
        peer = run_hf(bench.hf_model, prompt_ids, target, generation)
        row["hf"] = run_stats(peer)
        row["ratio_vs_hf"] = ours.tokens_per_s / peer.tokens_per_s
        row["same_tokens"] = ours.token_ids == peer.token_ids
        progress += f", transformers {peer.tokens_per_s:.1f}"
    peer_runs = PeerRuns()
    for contender in bench.contenders:
        for each in traces[contender.name]:
            tally.contenders[contender.name].add(each, index)
        result, said = contender_result(bench, contender, traces[contender.name], speedups[contender.name], ours)
        if bench.hf_model is not None and contender.peer_kwargs is not None:
            kwargs = contender.peer_kwargs
            peer = peer_runs.get(kwargs, lambda: run_hf(bench.hf_model, prompt_ids, target, generation, **kwargs))
            result["peer"] = run_stats(peer)
            result["ratio_vs_peer"] = result["tokens_per_s"] / peer.tokens_per_s
            said += f" (transformers {contender.peer} {peer.tokens_per_s:.1f})"
        row["algos"][contender.name] = result
        progress += f", {said}"
    return row, progress


def contender_result(bench: Bench, contender: Contender, traces: list[Any], measured: Speedup,
                     ours: Run) -> tuple[dict[str, Any], str]:
    """A contender's figures on one prompt, from its median round (`traces`: its rounds), against plain decoding's
    run `ours`; and its part of the progress line."""
    trace = median_run(traces)
    fast, metrics = run_of(trace), compute(trace)
    result: dict[str, Any] = {
        **run_stats(fast), "speedup_vs_ar": measured.speedup, "round_speedups": list(measured.ratios),
        "same_tokens_as_ar": None if contender.sampled else all(
            run_of(t).token_ids == ours.token_ids for t in traces),
        "kept_of_drafted": metrics.kept_of_drafted,
        "acceptance_rate": metrics.acceptance_rate,
        # tokens per target forward: 1 where nothing was drafted (plain decoding on float32 weights)
        "mean_accepted_tokens": 1.0 if metrics.mean_accepted_tokens is None else metrics.mean_accepted_tokens,
        "target_forwards": metrics.target_forwards, "step_cost": measured.step_cost,
        "step_split": {"draft": measured.draft, "verify": measured.verify, "other": measured.other},
        "flags": list(measured.flags)}
    if contender.proposer is not None:
        result["drafting_note"] = drafting_note(trace, bench.relative_cost)
        result.update(predicted(trace, bench.relative_cost, contender.proposer.own_cost(), measured.prefill))
        own = contender.proposer.own
        if own is not None and own.measured() is not None:  # a drafting forward, as its last steps ran
            result["draft_forward"] = own.measured()
        if own is not None and own.per_depth and own.measured_first() is not None:
            result["draft_first"] = own.measured_first()  # a step's first depth, its catch-up included
    result.update(depth_profile(trace))
    prediction = chain_prediction(trace)  # a chain's formula, where the run drafted chains
    if prediction is not None:
        result["predicted_tokens_per_forward"] = prediction.tokens
    return result, f"{contender.name} {fast.tokens_per_s:.1f}" + (" (flagged)" if measured.flags else "")


def summarise(bench: Bench, args: argparse.Namespace, tally: Tally) -> dict[str, Any]:
    """The report: each prompt's plain decoding against the bandwidth bound measured just before it, the peers'
    medians, the perfect proposer on this machine's curve, and each contender's summary (`contender_summary`)."""
    rows, bandwidths, target = tally.rows, tally.bandwidths, bench.target
    per_token = weight_bytes_per_token(target.model)
    bandwidth = statistics.median(bandwidths)
    fraction = statistics.median(r["ar"]["tokens_per_s"] * per_token / b for r, b in zip(rows, bandwidths))
    summary: dict[str, Any] = {"ar_median_tokens_per_s": statistics.median(r["ar"]["tokens_per_s"] for r in rows),
                               "fraction_of_bound": fraction, "algos": {}}
    if bench.hf_model is not None:
        summary["hf_median_tokens_per_s"] = statistics.median(r["hf"]["tokens_per_s"] for r in rows)
        summary["median_ratio_vs_hf"] = statistics.median(r["ratio_vs_hf"] for r in rows)
        summary["all_same_tokens"] = all(r["same_tokens"] for r in rows)
    if bench.llm is not None:
        summary["llama_cpp_median_tokens_per_s"] = statistics.median(r["llama_cpp"]["tokens_per_s"] for r in rows)
        summary["median_ratio_vs_llama_cpp"] = statistics.median(r["ratio_vs_llama_cpp"] for r in rows)
    for label, remote in bench.remotes.items():
        ran = [r["endpoints"][label] for r in rows]
        firsts = [e["first_token_s"] for e in ran if e["first_token_s"] is not None]  # None: no text came
        summary.setdefault("endpoints", {})[label] = {
            "url": remote.url, "model": remote.model,
            "median_tokens_per_s": statistics.median(e["tokens_per_s"] for e in ran),
            "median_ratio_vs_ar": statistics.median(e["ratio_vs_ar"] for e in ran),
            "median_first_token_s": statistics.median(firsts) if firsts else None,
            "counted": sorted({e["counted"] for e in ran})}
    width, best = perfect(bench.relative_cost)
    summary["perfect_proposer"] = {"width": width, "speedup": best}
    report: dict[str, Any] = {
        "model": target.name, "max_new_tokens": args.max_new_tokens, "rounds": args.rounds, "plan": args.plan,
        "environment": {**environment(target.model), "forwards": target.forwards},
        "bandwidth": {"copy_gb_per_s": bandwidth / 1e9, "weight_mb_per_token": per_token / 1e6,
                      "bound_tokens_per_s": bandwidth / per_token,
                      "copy_gb_per_s_range": [min(bandwidths) / 1e9, max(bandwidths) / 1e9]},
        "summary": summary, "algos": {}, "prompts": rows}
    for contender in bench.contenders:
        entry = contender_summary(contender.name, rows, args.plan)
        forwards = [r["algos"][contender.name]["draft_forward"] for r in rows
                    if "draft_forward" in r["algos"][contender.name]]
        if forwards:  # one drafting forward of its own (a draft model's, the heads'), against its bytes' prediction
            entry["draft_forward_by_bytes"] = contender.proposer.own_estimate(bench.relative_cost)
            entry["draft_forward_over_bytes"] = entry["draft_forward"] / entry["draft_forward_by_bytes"]
        summary["algos"][contender.name] = entry
        info: dict[str, Any] = {"setting": contender.setting, "peer": contender.peer}
        info.update(tally.contenders[contender.name].ratios(tally.plain))  # in plain decode forwards
        if isinstance(contender.proposer, CopyProposer) and "verify_cost_ratio" in info:  # what copies could reach
            add_copy_bounds(contender.proposer.lookup, rows, tally.plain_outputs, entry, info["verify_cost_ratio"])
        report["algos"][contender.name] = info
    return report


def contender_summary(name: str, rows: list[dict[str, Any]], plan: str) -> dict[str, Any]:
    """A contender's figures over the prompts (its results in each row's "algos"): the median speedup and its
    interval, whether it never loses (under the measured plan), grounded against open-ended prompts, each category
    as Spec-Bench tabulates, why it drafted little, its trees' ceiling and depths, what its steps predicted and its
    own forwards."""
    results = [r["algos"][name] for r in rows]
    low, high = median_interval([tuple(r["round_speedups"]) for r in results])
    entry: dict[str, Any] = {
        "median_speedup_vs_ar": statistics.median(r["speedup_vs_ar"] for r in results),
        "median_speedup_vs_ar_interval": [low, high],
        "all_same_tokens_as_ar": None if results[0]["same_tokens_as_ar"] is None else all(
            r["same_tokens_as_ar"] for r in results),
        "median_tokens_per_target_forward": statistics.median(r["mean_accepted_tokens"] for r in results)}
    if plan == "measured":
        entry["never_loses"] = (f"yes (the interval reaches {high:.2f}x, >= {NEVER_BELOW}x)" if high >= NEVER_BELOW
                                else f"NO (the interval ends at {high:.2f}x, below {NEVER_BELOW}x)")
    # the prompts whose answers draw on their input (what copies and retrieval feed on), and the others
    grounded = [r["algos"][name]["speedup_vs_ar"] for r in rows if r["category"] in GROUNDED]
    open_ended = [r["algos"][name]["speedup_vs_ar"] for r in rows if r["category"] not in GROUNDED]
    if grounded and open_ended:
        entry["median_speedup_vs_ar_grounded"] = statistics.median(grounded)
        entry["median_speedup_vs_ar_open"] = statistics.median(open_ended)
    categories = sorted({r["category"] for r in rows})
    if len(categories) > 1:  # as Spec-Bench tabulates: each category's speedup and mean accepted tokens
        entry["by_category"] = {c: {
            "prompts": sum(r["category"] == c for r in rows),
            "median_speedup": statistics.median(r["algos"][name]["speedup_vs_ar"] for r in rows if r["category"] == c),
            "mean_accepted_tokens": statistics.mean(r["algos"][name]["mean_accepted_tokens"] for r in rows
                                                    if r["category"] == c)} for c in categories}
    if all("ratio_vs_peer" in r for r in results):
        entry["median_ratio_vs_peer"] = statistics.median(r["ratio_vs_peer"] for r in results)
    entry["median_step_cost"] = statistics.median(r["step_cost"] for r in results)
    entry["flagged_prompts"] = sum(bool(r["flags"]) for r in results)
    notes = [(row["index"], row["algos"][name]["drafting_note"]) for row in rows
             if row["algos"][name].get("drafting_note")]
    if notes:  # the plan trimmed, or nothing was proposed: why, with this machine's figures
        entry["drafting"] = f"little on {len(notes)} of {len(results)} prompts (prompt {notes[0][0]}: {notes[0][1]})"
    oracle = [r["oracle_tokens_per_forward"] for r in results if "oracle_tokens_per_forward" in r]
    if oracle:  # what the same trees would commit were their deepest path right: the ceiling of their size
        entry["median_oracle_tokens_per_forward"] = statistics.median(oracle)
        entry["median_nodes_verified"] = statistics.median(r["mean_nodes_verified"] for r in results
                                                           if "mean_nodes_verified" in r)
        deepest = max(len(r["kept_at_least"]) for r in results if "kept_at_least" in r)
        entry["kept_at_least"] = [statistics.mean((r.get("kept_at_least", []) + [0.0] * deepest)[d]
                                                  for r in results) for d in range(deepest)]
    entry.update(reached(results))
    forwards = [r["draft_forward"] for r in results if "draft_forward" in r]
    if forwards:
        entry["draft_forward"] = statistics.median(forwards)
    firsts = [r["draft_first"] for r in results if "draft_first" in r]
    if firsts:  # a drafting step's first depth: its catch-up and the step's fixed work besides a forward
        entry["draft_first"] = statistics.median(firsts)
    judged = [r["acceptance_rate"] for r in results if r["acceptance_rate"] is not None]
    if judged:
        entry["mean_acceptance_rate"] = statistics.mean(judged)
    return entry


def predicted(trace: Any, relative_cost: Any, own_price: Callable[[int], float] | None,
              prefill: float) -> dict[str, Any]:
    """What a run's own decode steps predict on this machine's curve (`metrics.priced`: its verified widths, its
    proposer's forwards at their price), diluted by the prefill share both runs pay, as its speedup is; and that
    prediction's cost of a step (verify, draft), in one-token forwards. Nothing for a run with no decode step."""
    steps = priced(trace, relative_cost, own_price)
    if steps is None:
        return {}
    return {"predicted_speedup": steps.diluted(prefill),
            "predicted_step": {"verify": steps.verify, "draft": steps.draft}}


def reached(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Over the prompts: the median predicted speedup, the median share of it measured and, where that is under
    REACHED, where the rest went: per step, the measured split (in plain decoding's steps) against the predicted
    one (in one-token forwards; a plain step is a one-token forward and its host work)."""
    rows = [r for r in results if "predicted_speedup" in r]
    if not rows:
        return {}
    share = statistics.median(r["speedup_vs_ar"] / r["predicted_speedup"] for r in rows)
    out: dict[str, Any] = {"median_predicted_speedup": statistics.median(r["predicted_speedup"] for r in rows),
                           "median_share_of_predicted": share}
    if share < REACHED:
        measured = {part: statistics.median(r["step_split"][part] for r in rows) for part in ("draft", "verify",
                                                                                             "other")}
        priced_at = {part: statistics.median(r["predicted_step"][part] for r in rows) for part in ("draft", "verify")}
        out["where_the_rest_went"] = (
            f"per step, verifying cost {measured['verify']:.2f} plain steps where the curve says "
            f"{priced_at['verify']:.2f} forwards, drafting {measured['draft']:.2f} where its price says "
            f"{priced_at['draft']:.2f}, and the rest of the step (host work) {measured['other']:.2f}")
    return out


def connect(args: argparse.Namespace) -> dict[str, Remote]:
    """`--endpoint`'s servers by their report label (the model at the host), each asked for its model name."""
    if args.endpoint is None:
        return {}
    key = args.endpoint_key or os.environ.get("OPENAI_API_KEY")
    remotes: dict[str, Remote] = {}
    for number, url in enumerate(endpoint_urls(args.endpoint), start=1):
        remote = Remote(url, args.endpoint_model, key)
        remotes[remote.label if remote.label not in remotes else f"{remote.label} ({number})"] = remote
    return remotes


def cmd_bench_kernel(args: argparse.Namespace) -> int:
    target = load_model(loading(model_spec(args)))
    try:
        kernel = run_kernel(target, lambda line: print(line, file=sys.stderr, flush=True))
    except RuntimeError as exc:
        raise ConfigError(f"suite: {exc}") from None
    report = {"model": target.name, "environment": environment(target.model), "kernel": kernel}
    return write_report(args, report, markdown_kernel(report))


def cmd_bench_quality(args: argparse.Namespace) -> int:
    spec = model_spec(args)
    if args.limit is not None:
        check_int("limit", args.limit, 1, 10_000)
    gguf_file = source_gguf(spec)
    if gguf_file is None:
        raise ConfigError(f"suite: quality compares the ways of reading a GGUF model's weights; {spec.source!r} is "
                          "not one (use the embedded model or a .gguf file)")
    reference = load_model(loading(replace(spec, weights="float32")))
    passages = held_out_text()
    if not passages:
        raise ConfigError("suite: quality reads held-out text from Python's pydoc_data, which this installation "
                          "lacks")
    chosen = token_windows(reference.tokenizer, passages, MIN_TOKENS)[: args.limit]
    contenders: dict[str, Callable[[list[int]], torch.Tensor]] = {}
    labels = {"float32": "float32 (the reference)"}
    for weights, loaded in (("gguf-int8", load_model(replace(spec, weights="gguf-int8"))),
                            ("gguf", float_activation_peer(spec))):
        if loaded is not None:
            contenders[weights] = partial(window_logits, loaded.model)
            labels[weights] = loaded.model.formats_read()
    llama = llama_logits(str(gguf_file))
    if llama is not None:
        contenders["llama.cpp"], labels["llama.cpp"] = llama, "llama.cpp on the same file"
    rows = measure_quality(lambda ids: window_logits(reference.model, ids), contenders, chosen,
                           lambda line: print(line, file=sys.stderr, flush=True))
    for row in rows:
        row["label"] = labels[row["weights"]]
    quality = {"positions": rows[0]["positions"], "windows": len(chosen), "rows": rows,
               "text": "the Python language reference's topics, pydoc_data", "llama_cpp": llama is not None}
    report = {"model": reference.name, "environment": environment(reference.model), "quality": quality}
    return write_report(args, report, markdown_quality(report))


def cmd_bench_serving(args: argparse.Namespace) -> int:
    check_int("requests", args.requests, 1, 256)
    EngineParams(num_blocks=args.num_blocks, block_size=args.block_size, max_running=args.max_running)
    target = load_model(loading(model_spec(args)))
    serving = run_serving(target, args.requests, args.max_new_tokens, args.max_running, args.block_size,
                          args.num_blocks, lambda line: print(line, file=sys.stderr, flush=True))
    report = {"model": target.name, "environment": environment(target.model), "serving": serving}
    return write_report(args, report, markdown_serving(report))


SUITES: dict[str, Callable[[argparse.Namespace], int]] = {
    "serving": cmd_bench_serving, "kernel": cmd_bench_kernel, "quality": cmd_bench_quality}
