"""Command line: `python -m playground generate | bench | serve`.

Errors in what the user typed end the program with exit code 2 and one line naming the field and the allowed
range; they never print a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .cli import OneLineParser, add_model_args, check_writable, model_spec, run_cli
from .config import (
    MAX_GAMMA,
    MAX_NGRAM,
    MAX_WAITING,
    PLANS,
    QUANTS,
    ConfigError,
    EngineParams,
    GenerationParams,
    ModelSpec,
    SamplingParams,
    check_int,
    check_text,
)
from .decoding.prompt_lookup import PromptLookupParams
from .models.loader import default_draft

if TYPE_CHECKING:
    from .decoding.costs import OneRequest

ENGINE = EngineParams()
PLAN_HELP = ("how much a step drafts and verifies: measured (only guesses that should save time, judged on this "
             "machine's measured costs) or as-set (all the algorithm's settings ask for, however slow that is here)")


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=128, help="1..4096 (default 128)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 = greedy (default; so is anything below 1e-5), up to 100")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0, help="in (0, 1]; 1 = off")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--raw", action="store_true", help="do not apply the tokenizer's chat template")
    parser.add_argument("--kv", default="contiguous", choices=["contiguous", "paged"], help="KV cache kind")
    parser.add_argument("--block-size", type=int, default=16, help="paged KV block size, 1..256 (default 16)")
    parser.add_argument("--plan", default="measured", choices=PLANS, help=f"{PLAN_HELP} (default measured)")


def sampling_params(args: argparse.Namespace) -> tuple[SamplingParams, GenerationParams]:
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    generation = GenerationParams(max_new_tokens=args.max_new_tokens, stop=tuple(args.stop), raw=args.raw,
                                  kv=args.kv, block_size=args.block_size, plan=args.plan)
    return sampling, generation


def read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompt is not None:
        # bytes that are not UTF-8 reach Python as lone surrogates, which check_text names
        check_text("prompt", args.prompt)
        if not args.prompt.strip():
            raise ConfigError("prompt must be a non-empty string")
        return [args.prompt]
    path = Path(args.prompts_file)
    if not path.is_file():
        raise ConfigError(f"prompts-file: no such file {path}")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        at = data.count(b"\n", 0, exc.start) + 1
        raise ConfigError(f"prompts-file line {at}: not UTF-8 text (byte {data[exc.start]:#04x})") from None
    prompts = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"prompts-file line {number}: not valid JSON ({exc.msg})") from None
        except RecursionError:
            raise ConfigError(f"prompts-file line {number}: not valid JSON (nested too deeply)") from None
        except ValueError:  # Python reads integers of at most 4,300 digits
            raise ConfigError(f"prompts-file line {number}: not valid JSON (an integer too long to read)") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) or not record["prompt"].strip():
            raise ConfigError(f'prompts-file line {number}: expected {{"prompt": "<non-empty text>"}}')
        check_text(f"prompts-file line {number}: prompt", record["prompt"])
        prompts.append(record["prompt"])
    if not prompts:
        raise ConfigError(f"prompts-file: {path} holds no prompts")
    return prompts


def trace_path(base: str, index: int, count: int) -> Path:
    path = Path(base)
    return path if count == 1 else path.with_name(f"{path.stem}-{index}{path.suffix or '.json'}")


def save_trace(trace: Any, path: Path) -> None:
    """The trace written at a path `check_writable` passed; a disk that fills meanwhile is one line too."""
    try:
        trace.save(path)
    except OSError as exc:
        raise ConfigError(f"trace-out: could not write {str(path)[:80]} ({exc.strerror or exc}); the output above "
                          "is complete") from None


def algo_params(args: argparse.Namespace) -> tuple[Any, PromptLookupParams | None]:
    """The chosen algorithm's validated parameters (None for plain decoding) and the copies grafted onto its trees
    (None: none), checked before any model loads: an option of another algorithm is an error, not ignored."""
    from .decoding.registry import PLAIN, algorithm

    given = {dest: getattr(args, dest) for dest in args.algo_options if getattr(args, dest) is not None}
    for dest in given:
        flag, algos = args.algo_options[dest]
        if args.algo not in algos:
            raise ConfigError(f"{flag.lstrip('-')}: a setting of --algo {' or '.join(algos)}, not {args.algo}")
    copies = None
    if "copy_tokens" in given:
        check_int("copy_tokens", args.copy_tokens, 1, MAX_GAMMA)
    if "copy_ngram" in given:
        check_int("copy_ngram", args.copy_ngram, 1, MAX_NGRAM)
        copies = PromptLookupParams(max_ngram=args.copy_ngram, num_draft=args.copy_tokens, branches=1)
    elif "copy_tokens" in given:
        raise ConfigError("copy-tokens sizes the copies --copy-ngram adds: add --copy-ngram")
    if args.algo == PLAIN:
        return None, None
    spec = algorithm(args.algo)
    fields = {dest.split(":", 1)[1]: value for dest, value in given.items() if ":" in dest}
    if spec.loads_draft:
        fields["draft"] = fields.get("draft") or default_draft(args.model)
        if not fields["draft"]:
            raise ConfigError(f"draft: --algo {spec.name} needs --draft SPEC, a model with the target's tokenizer "
                              "(a default draft ships only for the embedded model)")
    return spec.make(fields), copies


def build_proposer(args: argparse.Namespace, target: Any, params: Any, copies: PromptLookupParams | None) -> Any:
    """The proposer of the chosen algorithm (None: plain decoding), its draft model loaded as the target is."""
    from .decoding.registry import PLAIN, algorithm, build_proposer
    from .models import load_model

    draft = None
    if args.algo != PLAIN and algorithm(args.algo).loads_draft:
        print(f"Loading draft {params.draft!r}...", file=sys.stderr, flush=True)
        # beside a target whose products are integer ones, the draft's weights join them as Q8_0 blocks
        weights = "gguf-int8" if target.weights == "gguf-int8" and args.draft_quant is None else "auto"
        draft = load_model(ModelSpec(source=params.draft, device=args.device, dtype=args.dtype,
                                     quant=args.draft_quant, cache_dir=args.cache_dir, weights=weights))
    return build_proposer(target, args.algo, params, copies, draft=draft)


def summary_line(algo: str, metrics: Any, trace: Any, finish_reason: str,
                 relative_cost: OneRequest | None = None,
                 own_price: Callable[[int], float] | None = None) -> str:
    """The run in one line: speed, forwards, and for an algorithm that drafted its acceptance against the theory's
    prediction; where a run drafted in few steps or none, why (`metrics.drafting_note`, priced by `relative_cost`:
    a forward's cost by width in one-token forwards on this machine) instead of an acceptance; and, labelled as a
    projection, what the same steps would give where a forward over a few tokens costs about one (`own_price`: the
    proposer's own forwards a step by their number, as priced here)."""
    from .metrics import FLAT_CURVE, chain_prediction, drafting_note, projected_speedup

    line = (f"[{algo}] {metrics.tokens} tokens in {metrics.wall_s:.2f} s = {metrics.tokens_per_s:.1f} tok/s, first "
            f"token after {metrics.ttft_s or 0:.3f} s, {metrics.target_forwards} target forwards, "
            f"finish: {finish_reason}, plan {trace.params.get('plan', 'measured')}")
    note = drafting_note(trace, relative_cost)
    if note is not None:
        line += f"; {note}" + (f" (forward costs {relative_cost.provenance()})" if relative_cost is not None else "")
    if metrics.acceptance_rate is not None and metrics.drafted:
        line += (f"; acceptance rate a = {metrics.acceptance_rate:.2f} ({metrics.accepted} of the "
                 f"{(metrics.accepted or 0) + (metrics.rejected or 0)} drafted tokens the target judged); "
                 f"{metrics.mean_accepted_tokens:.2f} tokens per target forward (bonus included)")
        prediction = chain_prediction(trace)
        line += (f" against {prediction.tokens:.2f} predicted by (1 - a^(g+1)) / (1 - a) at g = {prediction.g}"
                 if prediction is not None else " (it drafted trees: the formula for one chain does not apply)")
    projected = projected_speedup(trace, own_price) if metrics.drafted else None
    if projected is not None:
        line += f"; projection, not measured: {projected:.2f}x plain decoding's steps {FLAT_CURVE}"
    return line


def cmd_generate(args: argparse.Namespace) -> int:
    from .engine import generate, one_request_costs
    from .metrics import compute, drafting_note
    from .models import load_model

    spec = model_spec(args)
    sampling, generation = sampling_params(args)
    params, copies = algo_params(args)
    prompts = read_prompts(args)
    if args.trace_out:
        check_writable("trace-out", [trace_path(args.trace_out, i, len(prompts)) for i in range(len(prompts))])
    if args.timeline_out:
        check_writable("timeline-out", [Path(args.timeline_out)])
    print(f"Loading model {spec.source!r}...", file=sys.stderr, flush=True)
    target = load_model(spec)
    print(f"Its products read {target.model.formats_read()}.", file=sys.stderr, flush=True)
    proposer = build_proposer(args, target, params, copies)
    relative_cost = one_request_costs(target) if proposer is not None else None
    traces = []
    for index, prompt in enumerate(prompts):
        output, trace = generate(target, prompt, proposer, sampling, generation, args.algo)
        traces.append(trace)
        metrics = compute(trace)
        if args.json:
            record: dict[str, Any] = {
                "prompt": prompt, "text": output.text, "token_ids": list(output.token_ids),
                "metrics": {key: getattr(metrics, key) for key in (
                    "tokens_per_s", "wall_s", "ttft_s", "target_forwards", "mean_accepted_tokens",
                    "acceptance_rate", "kept_of_drafted", "kv_bytes")},
                "plan": generation.plan, "drafting_note": drafting_note(trace, relative_cost),
            }
            print(json.dumps(record, ensure_ascii=False), flush=True)
        else:
            print(output.text, flush=True)
            own = proposer.own_cost() if proposer is not None else None
            print(summary_line(args.algo, metrics, trace, output.finish_reason, relative_cost, own), file=sys.stderr,
                  flush=True)
        if args.trace_out:  # after the output, which a failed write then does not take with it
            save_trace(trace, trace_path(args.trace_out, index, len(prompts)))
    if args.timeline_out:
        from .timeline import save_timeline

        try:
            save_timeline(traces, args.timeline_out)
        except OSError as exc:
            raise ConfigError(f"timeline-out: could not write {str(args.timeline_out)[:80]} ({exc.strerror or exc}); "
                              "the output above is complete") from None
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from .api import listen, serve
    from .models import load_model

    spec = model_spec(args)
    settings, copies = algo_params(args)
    params = EngineParams(num_blocks=args.num_blocks, block_size=args.block_size, max_running=args.max_running,
                          max_batch_tokens=args.max_batch_tokens, prefix_caching=not args.no_prefix_caching,
                          plan=args.plan)
    check_int("max_waiting", args.max_waiting, 0, MAX_WAITING)
    api_key = api_key_of(args.api_key)
    allowed_hosts = None if args.allowed_hosts is None else tuple(h for h in args.allowed_hosts.split(",") if h.strip())
    if allowed_hosts == ():
        raise ConfigError("allowed_hosts must name at least one host (or * for any)")
    allowed_origins = origins_of(args.allowed_origins)
    sock = listen(args.host, args.port)  # a taken port fails before the model loads
    try:
        print(f"Loading model {spec.source!r}...", file=sys.stderr, flush=True)
        target = load_model(spec)
        print(f"Its products read {target.model.formats_read()}.", file=sys.stderr, flush=True)
        serve(target, params, sock, api_key=api_key, max_waiting=args.max_waiting,
              proposer=build_proposer(args, target, settings, copies), allowed_hosts=allowed_hosts,
              metrics_public=args.metrics_public, allowed_origins=allowed_origins)
    finally:
        sock.close()
    return 0


def api_key_of(given: str | None) -> str | None:
    """The key /v1 requests must send: --api-key, else $PLAYGROUND_API_KEY, else None (no key). An empty or blank
    key is refused, never read as "no key": a script passing an unset variable must not start an open server."""
    name = "api-key" if given is not None else "PLAYGROUND_API_KEY"
    key = given if given is not None else os.environ.get(name)
    if key is not None and not key.strip():
        raise ConfigError(f"{name} is empty: give a key, or leave it out to serve without one")
    if key is not None and (key != key.strip() or not key.isprintable() or not key.isascii()):
        raise ConfigError(f"{name} must be printable ASCII without spaces at its ends (a header carries it)")
    return key


def origins_of(given: str | None) -> tuple[str, ...] | None:
    """--allowed-origins as the server takes it: () none (the default), None any ("*"), else the origins named."""
    if given is None:
        return ()
    named = [o for o in given.split(",") if o.strip()]
    if not named:
        raise ConfigError("allowed-origins must name at least one origin, as scheme://host[:port] (or * for any)")
    if "*" in (o.strip() for o in named):
        return None
    from .api import origin_of

    try:
        return tuple(origin_of(o) for o in named)
    except ValueError as exc:
        raise ConfigError(f"allowed-origins: {str(exc)[:80]!r} is not an origin; give scheme://host[:port], e.g. "
                          "http://localhost:3000") from None


def add_algo_args(parser: argparse.ArgumentParser) -> None:
    """--algo and every registered algorithm's settings (`spec.Setting`), as `generate` and `serve` take them. A
    setting left out takes its parameters' default; one given for another algorithm than --algo is an error
    (`algo_params`). Two algorithms' fields of one name take distinct options (--medusa-depth, --eagle-depth)."""
    from .decoding.registry import ALGORITHMS, PLAIN, algorithms

    parser.add_argument("--algo", default=PLAIN, choices=algorithms(), help=f"what each step proposes (default "
                        f"{PLAIN}: plain decoding, nothing)")
    owners: dict[str, tuple[str, tuple[str, ...]]] = {}  # dest -> (its flag, the algorithms it sets)

    def add(options: Any, flag: str, algos: tuple[str, ...], **kwargs: Any) -> None:
        owners[options.add_argument(flag, **kwargs).dest] = (flag, algos)

    for spec in ALGORITHMS.values():
        options = parser.add_argument_group(spec.title)
        for setting in spec.settings:
            default = spec.default(setting)
            shown = setting.help if default is None or "default" in setting.help else f"{setting.help} (default " \
                f"{default})"
            how: dict[str, Any] = ({"action": "store_const", "const": setting.switch} if setting.switch is not None
                                   else {"type": setting.kind, "metavar": setting.field.upper()})
            add(options, setting.option, (spec.name,), dest=f"{spec.name}:{setting.field}", help=shown, **how)
        if spec.loads_draft:
            add(options, "--draft-quant", (spec.name,), choices=QUANTS, help="bitsandbytes quantization of the draft")
    grafting = tuple(name for name, spec in ALGORITHMS.items() if spec.grafts)
    copy = parser.add_argument_group(f"prompt copies added to the tree (--algo {', '.join(grafting)})")
    add(copy, "--copy-ngram", grafting, type=int, help=f"1..{MAX_NGRAM} (default: off): each step may also propose a "
                                                       "copy of earlier text matching the last 1..N tokens, added "
                                                       "to the algorithm's tree")
    add(copy, "--copy-tokens", grafting, type=int, help=f"most tokens a copy proposes, 1..{MAX_GAMMA} (default: as "
                                                        "prompt lookup's --num-draft)")
    parser.set_defaults(algo_options=owners)


def build_parser() -> argparse.ArgumentParser:
    from .bench.harness import add_bench_args

    parser = OneLineParser(prog="python -m playground", description="The decoding playground.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)

    gen = commands.add_parser("generate", help="generate text with one decoding algorithm")
    add_algo_args(gen)
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="the prompt text")
    source.add_argument("--prompts-file", help='JSONL file, one {"prompt": ...} per line')
    add_sampling_args(gen)
    add_model_args(gen)
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    gen.add_argument("--trace-out", help="write the trace JSON here (FILE-<i>.json for several prompts)")
    gen.add_argument("--timeline-out", help="write the run's steps as a timeline here: Chrome's Trace Event JSON, "
                                            "which Perfetto (ui.perfetto.dev) and chrome://tracing open; one track "
                                            "per prompt")
    gen.set_defaults(func=cmd_generate)

    bench = commands.add_parser("bench", help="benchmark against plain decoding and transformers")
    add_bench_args(bench)
    add_model_args(bench)

    server = commands.add_parser("serve", help="serve the model over HTTP (OpenAI-style API) with continuous "
                                               "batching on the paged KV cache; --algo proposes in every step")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine "
                                                            "only; 0.0.0.0 for every interface)")
    server.add_argument("--port", type=int, default=8000, help="0..65535 (default 8000; 0: any free port)")
    server.add_argument("--allowed-hosts", default=None, metavar="NAME[,NAME...]",
                        help="Host header names answered (e.g. myhost.example,10.0.0.5; * for any); default: "
                             "localhost, 127.0.0.1 and [::1] when --host is a loopback address (a web page that "
                             "resolves its own name to this machine is refused), else any")
    server.add_argument("--allowed-origins", default=None, metavar="ORIGIN[,ORIGIN...]",
                        help="web pages that may use the server, as scheme://host[:port] (e.g. http://localhost:3000; "
                             "* for any); they get CORS headers. Default: none, so a request a browser sends from a "
                             "web page is refused (403)")
    server.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on /v1 requests (default: $PLAYGROUND_API_KEY; "
                             "unset: no key)")
    server.add_argument("--metrics-public", action="store_true",
                        help="serve GET /metrics (Prometheus) without the API key (default: behind --api-key, as /v1)")
    server.add_argument("--max-waiting", type=int, default=64,
                        help=f"requests held waiting beyond --max-running, 0..{MAX_WAITING} (default 64); more get "
                             "a 503 with Retry-After")
    server.add_argument("--num-blocks", type=int, default=ENGINE.num_blocks,
                        help=f"KV blocks in the pool, 1..{1 << 20} (default {ENGINE.num_blocks}); a request's prompt "
                             "and max_tokens must fit it")
    server.add_argument("--block-size", type=int, default=ENGINE.block_size,
                        help=f"tokens per KV block, 1..256 (default {ENGINE.block_size})")
    server.add_argument("--max-running", type=int, default=ENGINE.max_running,
                        help=f"requests decoded together, 1..256 (default {ENGINE.max_running})")
    server.add_argument("--max-batch-tokens", type=int, default=ENGINE.max_batch_tokens,
                        help=f"tokens one engine step runs, prefill chunks included, 1..{1 << 16} (default "
                             f"{ENGINE.max_batch_tokens})")
    server.add_argument("--plan", default=ENGINE.plan, choices=PLANS, help=f"{PLAN_HELP} (default {ENGINE.plan})")
    server.add_argument("--no-prefix-caching", action="store_true",
                        help="do not share the KV blocks of identical prompt prefixes between requests")
    add_algo_args(server)
    add_model_args(server)
    server.set_defaults(func=cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run_cli(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
