"""The benchmark's report: what each algorithm's runs cost, the copy bound beside prompt lookup, the markdown tables
and the environment they were measured in."""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .suite import GROUNDED

REACHED = 0.9  # of the speedup its own steps predict on this machine's curve: below, the bench says where it went
GOALS_FILE = Path(__file__).with_name("goals.toml")


@functools.cache
def goals() -> dict[str, dict[str, str]]:
    """The goals the report shows beside each summary figure, per contender and for `every` one: key -> ">= x" or
    "<= x" (`goals.toml`, the project's own targets; data, not code)."""
    with GOALS_FILE.open("rb") as file:
        return tomllib.load(file)


@dataclass
class Costs:
    """What one algorithm's steps cost over the suite, read from its traces: the wall time of every verifying
    target forward (with its width) and of every draft forward, each with the prompt it ran on. Priced against plain
    decoding's forwards on the same prompt in the same run, these are what the runs actually paid, unlike a forward
    timed apart, at that prompt's context and at the moments that prompt ran."""

    verify: list[tuple[int, int, float]] = field(default_factory=list)  # (prompt, tokens, seconds) per forward
    draft: list[tuple[int, float]] = field(default_factory=list)  # (prompt, seconds) per draft forward

    def add(self, trace: Any, prompt: int) -> None:
        from ..trace import DraftEvent, VerifyEvent

        for event in trace.events:
            if isinstance(event, VerifyEvent) and event.target_forwards == 1:
                self.verify.append((prompt, event.num_tokens, event.wall_s))
            elif isinstance(event, DraftEvent) and event.draft_forwards:
                self.draft.append((prompt, event.wall_s / event.draft_forwards))

    def ratios(self, plain: Costs) -> dict[str, float]:
        """Median costs in plain decode forwards (`plain`'s median forward on the same prompt): of a verifying
        forward over more than one token (and their median width), and of one draft forward, where the algorithm
        had any on a prompt plain decoding ran."""
        unit: dict[int, list[float]] = {}
        for prompt, _, wall in plain.verify:
            unit.setdefault(prompt, []).append(wall)
        one = {prompt: statistics.median(walls) for prompt, walls in unit.items()}
        wide = [(tokens, wall / one[prompt]) for prompt, tokens, wall in self.verify if tokens > 1 and prompt in one]
        drafts = [wall / one[prompt] for prompt, wall in self.draft if prompt in one]
        out: dict[str, float] = {}
        if wide:
            out["verify_cost_ratio"] = statistics.median(ratio for _, ratio in wide)
            out["verify_tokens"] = statistics.median(tokens for tokens, _ in wide)
        if drafts:
            out["draft_cost_ratio"] = statistics.median(drafts)
        return out


PLAN_WORDS = {"measured": "each step verifies only guesses that should save time on this machine's measured costs",
              "as-set": "each step verifies all its algorithm's settings ask for, whatever it costs here"}


OTHER_ARITHMETIC = "no (other arithmetic: not required)"  # tokens that may part: 8-bit against float activations


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [
        f"# Benchmark: {report['model']} ({env['device']}, {env['dtype']}, batch 1, greedy, "
        f"{report['max_new_tokens']} new tokens)",
        "",
        f"torch {env['torch']}, {env['threads']} threads, {env['machine']}; native CPU kernels: "
        f"{env['native_kernel']}. Per prompt, plain decoding and every algorithm ran interleaved, "
        f"{report['rounds']} round(s); each row shows the median round, each speedup the median of the rounds' ratios "
        "(a sampled variant's over plain decoding sampled alike, which ran in the same rounds).",
        "",
        f"Weights: {env.get('weights', 'float32')}. Decode forwards: {env.get('forwards', 'eager')}. Plan: "
        f"{report.get('plan', 'measured')} ({PLAN_WORDS[report.get('plan', 'measured')]}).",
        "",
        "| # | category | prompt tokens | new tokens | ours tok/s | transformers tok/s | ours / transformers | "
        "same tokens | llama.cpp tok/s | ours / llama.cpp |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    # the 8-bit activations are other arithmetic than float32's: equal tokens are not required of them
    differ = OTHER_ARITHMETIC if "8-bit activations" in env.get("weights", "") else "NO"
    for row in report["prompts"]:
        hf, llama = row.get("hf"), row.get("llama_cpp")
        peer = (f"{hf['tokens_per_s']:.1f} | {row['ratio_vs_hf']:.2f}x | {'yes' if row['same_tokens'] else differ}"
                if hf else "- | - | -")
        peer += f" | {llama['tokens_per_s']:.1f} | {row['ratio_vs_llama_cpp']:.2f}x" if llama else " | - | -"
        lines.append(f"| {row['index']} | {row['category']} | {row['prompt_tokens']} | {row['ar']['tokens']} | "
                     f"{row['ar']['tokens_per_s']:.1f} | {peer} |")
    s = report["summary"]
    bound = report["bandwidth"]
    lines += ["", f"- ours, plain decoding: median {s['ar_median_tokens_per_s']:.1f} tok/s"]
    if s.get("hf_median_tokens_per_s") is not None:
        lines += [
            f"- transformers `generate`: median {s['hf_median_tokens_per_s']:.1f} tok/s",
            f"- ours / transformers: median {s['median_ratio_vs_hf']:.2f}x (goal >= 1.5x)",
        ]
    float_blocks = s["algos"].get("ar-gguf")
    if float_blocks:  # plain decoding on the same blocks against float32 activations, raced as a contender
        lines.append(f"- ours on the GGUF blocks with 8-bit activations / with float32 activations: median "
                     f"{1 / float_blocks['median_speedup_vs_ar']:.2f}x (goal >= 1.7x); same tokens on every prompt: "
                     f"{'yes' if float_blocks['all_same_tokens_as_ar'] else OTHER_ARITHMETIC}")
    floats = s["algos"].get("ar-float32")
    if floats:  # plain decoding on the float32 weights, raced as a contender
        lines.append(f"- ours on the GGUF blocks / on the float32 weights: median "
                     f"{1 / floats['median_speedup_vs_ar']:.2f}x (goal >= 2.5x), same tokens on every prompt: "
                     f"{'yes' if floats['all_same_tokens_as_ar'] else differ}")
    eager = s["algos"].get("ar-eager")
    if eager:  # plain decoding with eager forwards, raced as a contender
        lines.append(f"- ours with {env['forwards']} forwards / with eager forwards: median "
                     f"{1 / eager['median_speedup_vs_ar']:.2f}x (goal >= 10x with CUDA graphs), same tokens: "
                     f"{'yes' if eager['all_same_tokens_as_ar'] else 'NO'}")
    if s.get("llama_cpp_median_tokens_per_s") is not None:
        lines += [f"- llama.cpp on the same GGUF file: median {s['llama_cpp_median_tokens_per_s']:.1f} tok/s",
                  f"- ours / llama.cpp: median {s['median_ratio_vs_llama_cpp']:.2f}x (goal >= 1.3x)"]
    for label, e in s.get("endpoints", {}).items():
        lines.append(f"- remote endpoint {label}: median {e['median_tokens_per_s']:.1f} tok/s = "
                     f"{e['median_ratio_vs_ar']:.2f}x ours (a remote measurement: see its section)")
    low, high = bound.get("copy_gb_per_s_range", [bound["copy_gb_per_s"]] * 2)
    lines.append(
        f"- memory-bandwidth bound: {bound['copy_gb_per_s']:.1f} GB/s copy (median; {low:.1f}-{high:.1f} GB/s "
        f"measured before each prompt) / {bound['weight_mb_per_token']:.0f} MB of weights per token = "
        f"{bound['bound_tokens_per_s']:.1f} tok/s; ours reaches {100 * s['fraction_of_bound']:.0f}% of it, each "
        "prompt against its own moment's bandwidth (goal >= 60%)"
        + (" — CHECK: above the bound, so the bandwidth was measured while the host was slowed; rerun"
           if s["fraction_of_bound"] > 1 else ""))
    best = s.get("perfect_proposer")
    if best:
        lines.append(f"- this machine's ceiling: a perfect proposer (every token it proposes kept) would reach "
                     f"{best['speedup']:.2f}x plain decoding's decode steps, verifying {best['width']} tokens a "
                     "forward, the best width of the measured curve (a projection from the curve, not a run)")
    if report.get("algos"):
        lines += ["", "Costs come from the runs themselves, in plain decoding's steps and forwards of this run: step "
                  "cost is an algorithm's mean engine time per decode step over plain decoding's on the same prompt "
                  "(draft + verify + other), so its speedup is about tokens per target forward / step cost, diluted by "
                  "the prefill both pay; verify cost ratio is the median wall time of its verifying forwards over more "
                  "than one token (their median width: verify tokens), each over plain decoding's median decode "
                  "forward on the same prompt; draft cost ratio the same for one draft forward. Draft forward is "
                  "what one forward of the proposer's own (a draft "
                  "model's, the heads') cost in one-token target forwards as its plan measured it (the median over its "
                  "last drafting steps, per prompt: each token after a step's first, or the heads' one forward a "
                  "step), by bytes what the weights it reads predict (their bytes over the target's, at the rows the "
                  "forward runs a request on this machine's curve: EAGLE's head top_k); draft first "
                  "is what a drafting step's first token cost, with reading the tokens kept since the proposer's last "
                  "step and the step's fixed work around its forwards. `check` flags a speedup the measurement cannot "
                  "explain (playground/speedup.py): rerun before quoting it. The predicted speedup is what a run's own "
                  "decode steps (the widths it verified, its proposer's forwards at their measured price) come to on "
                  "this machine's forward-cost curve, diluted by the prefill as the measured one is; its share "
                  "measured falls short where a step costs more than the curve and the price say (host work, a slowed "
                  "forward), and the bench then says where."]
    for name, info in report.get("algos", {}).items():
        lines += markdown_algo(name, info, report["prompts"], s["algos"][name])
    for label, summary in s.get("endpoints", {}).items():
        lines += markdown_endpoint(label, summary, report["prompts"])
    return "\n".join(lines) + "\n"


def markdown_endpoint(label: str, summary: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """A remote lane's section: per prompt its wall-clock figures beside ours, and what they cannot say."""
    counted = {"usage": "the server's usage count", "chunks": "the streamed chunks (the server sent no usage)"}
    lines = ["", f"## remote: {label}", "",
             f"`{summary['url']}`, model `{summary['model']}`: the same prompts as one chat message each, streamed "
             "at temperature 0 and interleaved with the local runs. Wall clock of this process from the request to "
             "the stream's end, so the network, the server's queue and its own chat template are in it; tokens "
             f"counted by {' and '.join(counted[c] for c in summary['counted'])}. A remote measurement: no steps, "
             "no exactness check (its weights and arithmetic are its own).", "",
             "| # | category | tokens | tok/s | ours plain tok/s | remote / ours | first text after (s) |",
             "|---|---|---|---|---|---|---|"]
    for i, row in enumerate(rows):
        e = row["endpoints"][label]
        first = "-" if e["first_token_s"] is None else f"{e['first_token_s']:.3f}"
        lines.append(f"| {i} | {row['category']} | {e['tokens']} | {e['tokens_per_s']:.1f} | "
                     f"{row['ar']['tokens_per_s']:.1f} | {e['ratio_vs_ar']:.2f}x | {first} |")
    first = summary["median_first_token_s"]
    lines += ["", f"- median: {summary['median_tokens_per_s']:.1f} tok/s, {summary['median_ratio_vs_ar']:.2f}x ours "
                  "plain decoding, " + ("no text came" if first is None else f"first text after {first:.3f} s")]
    return lines


def markdown_algo(name: str, info: dict[str, Any], rows: list[dict[str, Any]], summary: dict[str, Any]) -> list[str]:
    peer = info.get("peer")
    lines = ["", f"## {name} ({info['setting']})", "",
             "| # | category | tok/s | speedup vs ours plain | acceptance rate a (accepted / judged; accepted / "
             "drafted) | "
             "tokens per target forward | step cost: draft + verify + other (plain steps) | same tokens as plain |"
             + (f" {peer} tok/s | ours / {peer} |" if peer else "") + " check |",
             "|---|---|---|---|---|---|---|---|" + ("---|---|" if peer else "") + "---|"]
    for i, row in enumerate(rows):
        r = row["algos"][name]
        acceptance = ("-" if r["kept_of_drafted"] is None else
                      f"{r['acceptance_rate'] or 0:.2f}; {r['kept_of_drafted']:.2f}")
        forward = f"{r['mean_accepted_tokens']:.2f}"
        if "predicted_tokens_per_forward" in r:
            forward += f" (theory {r['predicted_tokens_per_forward']:.2f})"
        same = {True: "yes", False: "NO", None: "n/a (sampled)"}[r["same_tokens_as_ar"]]
        split = r["step_split"]
        cost = f"{r['step_cost']:.2f} = {split['draft']:.2f} + {split['verify']:.2f} + {split['other']:.2f}"
        line = (f"| {i} | {row['category']} | {r['tokens_per_s']:.1f} | {r['speedup_vs_ar']:.2f}x | {acceptance} | "
                f"{forward} | {cost} | {same} |")
        if peer:
            line += (f" {r['peer']['tokens_per_s']:.1f} | {r['ratio_vs_peer']:.2f}x |" if "peer" in r else " - | - |")
        lines.append(line + " " + ("; ".join(r["flags"]) or "ok").replace("|", "/") + " |")
    lines.append("")
    targets = {**goals()["every"], **goals().get(name, {})}
    for key, value in summary.items():
        goal = targets.get(key)
        if key == "by_category":
            lines += ["", "| category | prompts | speedup (median) | mean accepted tokens |", "|---|---|---|---|"]
            lines += [f"| {c} | {v['prompts']} | {v['median_speedup']:.2f}x | {v['mean_accepted_tokens']:.2f} |"
                      for c, v in value.items()]
            lines.append("")
            continue
        if key.endswith("_interval"):
            shown = f"{value[0]:.2f}x to {value[1]:.2f}x (90% of bootstrap draws over the prompts and their rounds)"
        elif isinstance(value, list):  # per depth d = 1, 2, ...
            shown = ", ".join(f"{v:.2f}" for v in value) + " (depth 1, 2, ...)"
        else:
            shown = f"{value:.2f}" if isinstance(value, float) else str(value)
        if goal is not None:
            shown += f" (goal {goal})"
        lines.append(f"- {key.replace('_', ' ')}: {shown}")
    for key, value in info.items():
        if key not in ("setting", "peer"):
            lines.append(f"- {key.replace('_', ' ')}: {value:.3f}")
    return lines


def add_copy_bounds(lookup: Any, rows: list[dict[str, Any]], plain_outputs: list[tuple[list[int], list[int]]],
                    entry: dict[str, Any], verify_cost: float) -> None:
    """Put next to prompt lookup's measured figures what the best copy per step could reach on plain decoding's
    output (`copy_bound`): per prompt in `rows`, and as grounded-prompt medians in the summary `entry`.

    verify_cost prices a verifying forward in one-token steps: the caller passes what prompt lookup's own
    verifying forwards cost in the runs (median), so the bound's speedup is an estimate at this machine's prices.
    """
    from ..decoding.copies import copy_bound

    grounded = []
    for row, (prompt_ids, output_ids) in zip(rows, plain_outputs):
        bound = copy_bound(prompt_ids, output_ids, lookup.max_ngram, lookup.num_draft, verify_cost)
        row["algos"]["prompt-lookup"]["copy_bound"] = {"tokens_per_forward": bound.tokens_per_forward,
                                                       "speedup_vs_ar": bound.speedup}
        if row["category"] in GROUNDED:
            grounded.append(bound)
    if grounded:
        entry["copy_bound_median_tokens_per_forward_grounded"] = statistics.median(
            b.tokens_per_forward for b in grounded)
        entry["copy_bound_median_speedup_grounded"] = statistics.median(b.speedup for b in grounded)


def write_report(args: argparse.Namespace, report: dict[str, Any], text: str) -> int:
    for path, content in ((args.json, json.dumps(report, indent=2)), (args.markdown, text)):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(content, encoding="utf-8")
    print(text)
    return 0


def cpu_model() -> str | None:
    """The processor's name as Linux reports it (None elsewhere)."""
    try:
        lines = Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), None)


def environment(model: Any) -> dict[str, Any]:
    from ..models import native

    return {"device": str(model.device), "dtype": str(model.dtype).removeprefix("torch."),
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "machine": f"{platform.machine()} {cpu_model() or platform.processor() or platform.system()}",
            "native_kernel": native.status() if model.device.type == "cpu" else "not used (not a CPU)",
            "weights": model.formats_read()}
