"""Command line: `python -m playground generate | bench | serve`.

Errors in what the user typed end the program with exit code 2 and one line naming the field and the allowed
range; they never print a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from .config import (CPU_TREE_ROWS, DYNAMIC_NODES, DYNAMIC_TREE, GPU_DYNAMIC_NODES, MAX_DYNAMIC_NODES, MAX_GAMMA,
                     MAX_NGRAM, MAX_WAITING, MEDUSA_ACCEPTANCE, QUANTS, ConfigError, EngineParams, GenerationParams,
                     LookaheadParams, MedusaParams, ModelSpec, PromptLookupParams, SamplingParams, SpeculativeParams,
                     check_int, check_text)
from .cli import OneLineParser, add_model_args, model_spec, run_cli
from .models.loader import default_draft

LOOKAHEAD = LookaheadParams()  # the defaults the options show
SPECULATIVE = SpeculativeParams()
ENGINE = EngineParams()


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


def sampling_params(args: argparse.Namespace) -> tuple[SamplingParams, GenerationParams]:
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    generation = GenerationParams(max_new_tokens=args.max_new_tokens, stop=tuple(args.stop), raw=args.raw,
                                  kv=args.kv, block_size=args.block_size)
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
        line = data.count(b"\n", 0, exc.start) + 1
        raise ConfigError(f"prompts-file line {line}: not UTF-8 text (byte {data[exc.start]:#04x})") from None
    prompts = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"prompts-file line {number}: not valid JSON ({exc.msg})") from exc
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) or not record["prompt"].strip():
            raise ConfigError(f'prompts-file line {number}: expected {{"prompt": "<non-empty text>"}}')
        prompts.append(record["prompt"])
    if not prompts:
        raise ConfigError(f"prompts-file: {path} holds no prompts")
    return prompts


def trace_path(base: str, index: int, count: int) -> Path:
    path = Path(base)
    return path if count == 1 else path.with_name(f"{path.stem}-{index}{path.suffix or '.json'}")


def check_writable(name: str, path: Path) -> None:
    """A file can be written at `path`: checked before a long run, not after it."""
    folder = path.parent
    if not folder.is_dir():
        raise ConfigError(f"{name}: no such folder {folder}")
    if path.is_dir():
        raise ConfigError(f"{name}: {path} is a folder; give a file name")
    if not os.access(folder, os.W_OK):
        raise ConfigError(f"{name}: cannot write into {folder}")


def algo_params(args: argparse.Namespace) -> tuple[Any, PromptLookupParams | None]:
    """The chosen algorithm's validated parameters (None for plain decoding) and the copies grafted onto its trees
    (None: none), checked before any model loads."""
    copies = None
    check_int("copy_ngram", args.copy_ngram, 0, MAX_NGRAM)
    if args.copy_tokens is not None:
        check_int("copy_tokens", args.copy_tokens, 1, MAX_GAMMA)
    if args.copy_ngram:
        if args.algo not in ("speculative", "medusa"):
            raise ConfigError(f"copy-ngram: copies graft onto the trees of --algo speculative or medusa, not "
                              f"{args.algo}")
        copies = PromptLookupParams(max_ngram=args.copy_ngram, num_draft=args.copy_tokens, branches=1)
    elif args.copy_tokens is not None:
        raise ConfigError("copy-tokens sizes the copies --copy-ngram grafts: add --copy-ngram")
    if args.algo == "speculative":
        args.draft = args.draft or default_draft(args.model)
        if not args.draft:
            raise ConfigError("draft: --algo speculative needs --draft SPEC, a model with the target's tokenizer "
                              "(a default draft ships only for the embedded model)")
        return SpeculativeParams(draft=args.draft, gamma=args.gamma, sample=args.sample_draft), copies
    if args.algo == "prompt-lookup":
        return PromptLookupParams(max_ngram=args.max_ngram, num_draft=args.num_draft, branches=args.branches), None
    if args.algo == "lookahead":
        return LookaheadParams(window=args.window, ngram=args.ngram, guesses=args.guesses,
                               prompt_pool=not args.no_prompt_pool, output_pool=not args.no_output_pool,
                               text_ngram=args.text_ngram, corpus_pool=not args.no_corpus_pool,
                               corpus=args.corpus, context=args.context), None
    if args.algo == "medusa":
        return MedusaParams(heads=args.medusa_heads, depth=args.medusa_depth, tree=args.tree, nodes=args.tree_nodes,
                            acceptance=args.acceptance, epsilon=args.typical_epsilon,
                            alpha=args.typical_alpha), copies
    return None, None


def build_proposer(args: argparse.Namespace, target: Any, params: Any, copies: PromptLookupParams | None) -> Any:
    """The proposer of the chosen algorithm (None: plain decoding), its draft model loaded as the target is."""
    from .decoding.registry import build_proposer
    from .models import load_model

    draft = None
    if args.algo == "speculative":
        print(f"Loading draft {args.draft!r}...", file=sys.stderr, flush=True)
        draft = load_model(ModelSpec(source=args.draft, device=args.device, dtype=args.dtype,
                                     quant=args.draft_quant, cache_dir=args.cache_dir))
    return build_proposer(target, args.algo, params, copies, draft=draft)


def summary_line(algo: str, metrics: Any, trace: Any, finish_reason: str) -> str:
    from .metrics import expected_tokens_per_step, mean_draft_length

    line = (f"[{algo}] {metrics.tokens} tokens in {metrics.wall_s:.2f} s = {metrics.tokens_per_s:.1f} tok/s, first "
            f"token after {metrics.ttft_s or 0:.3f} s, {metrics.target_forwards} target forwards, "
            f"finish: {finish_reason}")
    gamma = mean_draft_length(trace)
    if metrics.acceptance_rate is not None and gamma is not None:
        predicted = expected_tokens_per_step(metrics.acceptance_rate, gamma)
        line += (f"; acceptance {metrics.acceptance_rate:.2f}, tokens per target forward (bonus included) "
                 f"{metrics.mean_accepted_tokens:.2f} measured vs {predicted:.2f} predicted by "
                 f"(1 - a^(g+1)) / (1 - a) at mean g = {gamma:.1f}")
    return line


def cmd_generate(args: argparse.Namespace) -> int:
    from .engine import generate
    from .metrics import compute
    from .models import load_model

    spec = model_spec(args)
    sampling, generation = sampling_params(args)
    params, copies = algo_params(args)
    prompts = read_prompts(args)
    if args.trace_out:
        check_writable("trace-out", trace_path(args.trace_out, 0, len(prompts)))
    print(f"Loading model {spec.source!r}...", file=sys.stderr, flush=True)
    target = load_model(spec)
    proposer = build_proposer(args, target, params, copies)
    for index, prompt in enumerate(prompts):
        output, trace = generate(target, prompt, proposer, sampling, generation, args.algo)
        metrics = compute(trace)
        if args.trace_out:
            trace.save(trace_path(args.trace_out, index, len(prompts)))
        if args.json:
            record: dict[str, Any] = {
                "prompt": prompt, "text": output.text, "token_ids": list(output.token_ids),
                "metrics": {key: getattr(metrics, key) for key in (
                    "tokens_per_s", "wall_s", "ttft_s", "target_forwards", "mean_accepted_tokens",
                    "acceptance_rate", "kv_bytes")},
            }
            print(json.dumps(record, ensure_ascii=False), flush=True)
        else:
            print(output.text, flush=True)
            print(summary_line(args.algo, metrics, trace, output.finish_reason), file=sys.stderr, flush=True)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from .models import load_model
    from .api import listen, serve

    spec = model_spec(args)
    if not args.prompt_lookup and (args.max_ngram is not None or args.num_draft is not None):
        raise ConfigError("--max-ngram and --num-draft set prompt lookup: add --prompt-lookup")
    lookup = PromptLookupParams(max_ngram=3 if args.max_ngram is None else args.max_ngram,
                                num_draft=args.num_draft) if args.prompt_lookup else None
    if not args.medusa and any(v is not None for v in (args.medusa_heads, args.medusa_depth, args.medusa_nodes)):
        raise ConfigError("--medusa-heads, --medusa-depth and --medusa-nodes set Medusa heads in the batch: add "
                          "--medusa")
    medusa = MedusaParams(heads=args.medusa_heads, depth=args.medusa_depth, nodes=args.medusa_nodes) \
        if args.medusa else None
    if not args.speculative and (args.draft is not None or args.gamma is not None):
        raise ConfigError("--draft and --gamma set a draft model in the batch: add --speculative")
    draft = SpeculativeParams(draft=args.draft, **({} if args.gamma is None else {"gamma": args.gamma})) \
        if args.speculative else None
    if not args.lookahead and any(v is not None for v in (args.window, args.ngram, args.guesses)):
        raise ConfigError("--window, --ngram and --guesses set lookahead in the batch: add --lookahead")
    lookahead = LookaheadParams(window=LOOKAHEAD.window if args.window is None else args.window, ngram=args.ngram,
                                guesses=args.guesses) if args.lookahead else None
    params = EngineParams(num_blocks=args.num_blocks, block_size=args.block_size, max_running=args.max_running,
                          max_batch_tokens=args.max_batch_tokens, prefix_caching=not args.no_prefix_caching,
                          lookup=lookup, medusa=medusa, draft=draft, lookahead=lookahead)
    check_int("max_waiting", args.max_waiting, 0, MAX_WAITING)
    api_key = args.api_key or os.environ.get("PLAYGROUND_API_KEY") or None
    sock = listen(args.host, args.port)  # a taken port fails before the model loads
    try:
        print(f"Loading model {spec.source!r}...", file=sys.stderr, flush=True)
        serve(load_model(spec), params, sock, api_key=api_key, max_waiting=args.max_waiting)
    finally:
        sock.close()
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .bench import add_bench_args
    from .decoding.registry import algorithms

    parser = OneLineParser(prog="python -m playground", description="The decoding playground.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)

    gen = commands.add_parser("generate", help="generate text with one decoding algorithm")
    gen.add_argument("--algo", default="ar", choices=algorithms())
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="the prompt text")
    source.add_argument("--prompts-file", help='JSONL file, one {"prompt": ...} per line')
    add_sampling_args(gen)
    add_model_args(gen)
    spec = gen.add_argument_group("speculative decoding (--algo speculative)")
    spec.add_argument("--draft", help="draft model spec (same tokenizer as the target); default for the embedded "
                                      "model: the draft trained by `python -m playground.train draft`")
    spec.add_argument("--gamma", type=int, default=SPECULATIVE.gamma,
                      help=f"most draft tokens per step, 1..{MAX_GAMMA} (default {SPECULATIVE.gamma}); each step "
                           "drafts as deep as the chain's acceptance so far pays for")
    spec.add_argument("--sample-draft", action="store_true",
                      help="when sampling, draw the chain from the draft's distributions and judge it by the lossless "
                           "rule for them: more accepted, same distribution, but a seed no longer gives plain "
                           "decoding's text (default: the draft's greedy chain, seeded outputs unchanged)")
    spec.add_argument("--draft-quant", default=None, choices=QUANTS, help="bitsandbytes quantization of the draft")
    copy = gen.add_argument_group("prompt copies grafted onto the tree (--algo speculative or medusa)")
    copy.add_argument("--copy-ngram", type=int, default=0,
                      help="0..8 (default 0: off): each step may also propose a copy of earlier text matching the last "
                           "1..N tokens, grafted onto the draft's or the heads' tree")
    copy.add_argument("--copy-tokens", type=int, default=None,
                      help="most tokens a copy proposes, 1..16 (default: as prompt lookup's --num-draft)")
    lookup = gen.add_argument_group("prompt-lookup decoding (--algo prompt-lookup)")
    lookup.add_argument("--max-ngram", type=int, default=3,
                        help="longest suffix looked up in the prompt and the text so far, 1..8 (default 3)")
    lookup.add_argument("--num-draft", type=int, default=None,
                        help="most tokens copied after a match, 1..16 (default 5 with more than one branch or where "
                             "only a copy of 5 fits one pass of the native CPU kernel's rows, as with AVX2; "
                             "else 8)")
    lookup.add_argument("--branches", type=int, default=None,
                        help="distinct copies (of different earlier occurrences) verified together in one forward, "
                             "merged into a tree, 1..8 (default: 2 where two copies and the last token fit one pass "
                             "of the native CPU kernel's rows, as with AVX-512; else 1)")
    ahead = gen.add_argument_group("lookahead decoding (--algo lookahead)")
    ahead.add_argument("--window", type=int, default=LOOKAHEAD.window,
                       help=f"Jacobi window width W, 1..16 (default {LOOKAHEAD.window})")
    ahead.add_argument("--ngram", type=int, default=LOOKAHEAD.ngram,
                       help="n-gram size N (window of N - 1 rows), 2..8 (default: 3, or 2 where only then do two "
                            "guesses fit one pass of the CPU kernel's rows: 6 tokens with AVX2)")
    ahead.add_argument("--guesses", type=int, default=LOOKAHEAD.guesses,
                       help="n-grams kept per first token and verified per step G, 1..16 (default: 2 where the "
                            "step's forward fits one pass of the CPU kernel's rows or on a GPU; else 1, with "
                            "M = N + 1 unless --text-ngram is given)")
    ahead.add_argument("--no-prompt-pool", action="store_true", help="do not seed the n-gram pool from the prompt")
    ahead.add_argument("--no-output-pool", action="store_true",
                       help="do not add the committed text's n-grams to the pool (only the window's)")
    ahead.add_argument("--text-ngram", type=int, default=LOOKAHEAD.text_ngram,
                       help="size M of the n-grams the prompt, output and corpus pools take from text, 2..16 "
                            "(default: N, 3 where --ngram chooses 2, or N + 1 as --guesses says; a longer M "
                            "verifies longer copies in wider forwards)")
    ahead.add_argument("--corpus", default=None,
                       help="answers file (`python -m playground.train ngrams`) whose most frequent n-grams seed "
                            "the pool (default: the one shipped for the embedded model)")
    ahead.add_argument("--no-corpus-pool", action="store_true",
                       help="do not seed the pool from the target's answers to other prompts")
    ahead.add_argument("--context", type=int, default=LOOKAHEAD.context,
                       help="look candidates up by the last K tokens first, then fewer, down to the last one, "
                            f"1..8 (default {LOOKAHEAD.context}; 1: keyed by the last token only, as in the paper)")
    tree = gen.add_argument_group("Medusa decoding (--algo medusa)")
    tree.add_argument("--medusa-heads", default=None,
                      help="folder of heads trained by `python -m playground.train medusa` (default: the heads "
                           "shipped for the embedded model)")
    tree.add_argument("--medusa-depth", type=int, default=None,
                      help="heads used, so the deepest guess, 1..the heads' number (default: every head)")
    tree.add_argument("--tree", default=DYNAMIC_TREE,
                      help="candidate tree: dynamic (default: the nodes the heads rate likeliest, chosen at every "
                           "step), chain, small, medium, wide, or a JSON file of top-k paths")
    tree.add_argument("--tree-nodes", type=int, default=None,
                      help=f"nodes of the dynamic tree, 1..{MAX_DYNAMIC_NODES} (default: what one "
                           f"pass of the native CPU kernel serves beside the last token, at most {CPU_TREE_ROWS - 1}; "
                           f"{GPU_DYNAMIC_NODES} on a GPU, {DYNAMIC_NODES} with PyTorch's CPU kernels)")
    tree.add_argument("--acceptance", default="lossless", choices=MEDUSA_ACCEPTANCE,
                      help="when sampling: lossless (exact, default) or typical (LOSSY, accepts more); at "
                           "temperature 0 both are greedy and exact")
    tree.add_argument("--typical-epsilon", type=float, default=0.3, help="typical acceptance epsilon, (0, 1]")
    tree.add_argument("--typical-alpha", type=float, default=0.09, help="typical acceptance alpha, (0, 1]")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    gen.add_argument("--trace-out", help="write the trace JSON here (FILE-<i>.json for several prompts)")
    gen.set_defaults(func=cmd_generate)

    bench = commands.add_parser("bench", help="benchmark against plain decoding and transformers")
    add_bench_args(bench)
    add_model_args(bench)

    server = commands.add_parser("serve", help="serve the model over HTTP (OpenAI-style API) with continuous "
                                               "batching on the paged KV cache")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine "
                                                            "only; 0.0.0.0 for every interface)")
    server.add_argument("--port", type=int, default=8000, help="0..65535 (default 8000; 0: any free port)")
    server.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on /v1 requests (default: $PLAYGROUND_API_KEY; "
                             "unset: no key)")
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
    server.add_argument("--no-prefix-caching", action="store_true",
                        help="do not share the KV blocks of identical prompt prefixes between requests")
    copies = server.add_argument_group("prompt lookup in the batch")
    copies.add_argument("--prompt-lookup", action="store_true",
                        help="verify copies of earlier text (prompt lookup) in the batch's forward where they pay "
                             "for its extra rows: the same tokens as without, more per step on grounded requests")
    copies.add_argument("--max-ngram", type=int, default=None,
                        help="longest suffix looked up in a request's prompt and text so far, 1..8 (default 3)")
    copies.add_argument("--num-draft", type=int, default=None,
                        help="most tokens copied after a match, 1..16 (default: as generate's --num-draft with one "
                             "branch: 5 where only a copy of 5 fits one pass of the native CPU kernel, else 8); "
                             "larger batches copy fewer")
    guesses = server.add_argument_group("Medusa heads in the batch")
    guesses.add_argument("--medusa", action="store_true",
                         help="verify a tree of the Medusa heads' guesses per request in the batch's forward where "
                              "it pays for the extra rows (with --prompt-lookup too, a request's copy grafted onto "
                              "its tree): the same tokens as without")
    guesses.add_argument("--medusa-heads", default=None,
                         help="folder of trained heads (default: the shipped heads of the embedded model)")
    guesses.add_argument("--medusa-depth", type=int, default=None,
                         help="heads used, so the deepest guess, 1..the heads' number (default: every head)")
    guesses.add_argument("--medusa-nodes", type=int, default=None,
                         help=f"most guesses per tree, 1..{MAX_DYNAMIC_NODES} (default: as generate's dynamic tree: "
                              f"the rows one pass of the native CPU kernel serves beside the last token, "
                              f"{GPU_DYNAMIC_NODES} on a GPU); larger batches guess fewer")
    drafts = server.add_argument_group("a draft model in the batch (instead of Medusa heads)")
    drafts.add_argument("--speculative", action="store_true",
                        help="verify a chain of the draft model's greedy tokens per request in the batch's forward "
                             "where it pays for the extra rows (with --prompt-lookup too, a copy that parts from "
                             "the chain verified beside it): the same tokens as without")
    drafts.add_argument("--draft", default=None,
                        help="draft model spec with the target's tokenizer (default: the draft shipped for the "
                             "embedded model)")
    drafts.add_argument("--gamma", type=int, default=None,
                        help=f"most tokens drafted per request and step, 1..{MAX_GAMMA} (default "
                             f"{SPECULATIVE.gamma}); larger batches draft fewer")
    ahead = server.add_argument_group("lookahead in the batch (alone: no prompt lookup, Medusa or draft)")
    ahead.add_argument("--lookahead", action="store_true",
                       help="give each request a Jacobi window and n-gram pools (corpus, prompt, window, output); "
                            "verify the pools' candidates for it, with the window's rows beside them, in the "
                            "batch's forward where they pay for the extra rows: the same tokens as without")
    ahead.add_argument("--window", type=int, default=None,
                       help=f"Jacobi window width W, 1..16 (default {LOOKAHEAD.window})")
    ahead.add_argument("--ngram", type=int, default=None,
                       help="n-gram size N (window of N - 1 rows), 2..8 (default: as generate's)")
    ahead.add_argument("--guesses", type=int, default=None,
                       help="n-grams kept per key and verified per request and step G, 1..16 (default: as "
                            "generate's)")
    add_model_args(server)
    server.set_defaults(func=cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run_cli(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
