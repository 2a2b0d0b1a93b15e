"""`python -m playground.train corpus`: the target's own answers at scale, the data every proposer learns from.

The prompts are written here, never taken from the benchmark, the notebooks or Spec-Bench: task templates, format
templates (JSON, tables, letters, lists) and code tasks in eight languages, crossed with several hundred topics,
plus seeded arithmetic problems. A second turn builds on each shard's answers: a summary, a rewrite or a
translation of an answer (input-grounded tasks, whose answers copy from a long prompt), or a follow-up question in
the same conversation (multi-turn). Half the prompts are answered greedily, half sampled (temperature 0.7, a seed per
prompt), by the batched engine on the model's own weights (the GGUF blocks' integer products by default).

The corpus is a folder of shards, each a safetensors file of token ids written once and never rewritten, so a run
that stops resumes where it left off. A prompt's group (its topic, its code task, its problem) decides whether it is
held out, so no held-out answer shares a topic with a training one: the held-out shards measure what a proposer
learned, not what it saw.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ..config import WEIGHTS, ConfigError, EngineParams, GenerationParams, ModelSpec, SamplingParams, check_int
from ..decoding.base import chat_ids
from . import log
from .draft import TOP_K, Corpus
from .prompts import (
    EXTRA_TEMPLATES,
    HELD_OUT_TOPICS,
    TABLES,
    TEMPLATES,
    TRAIN_TOPICS,
    WIDE_TOPICS,
    grounded_task,
    word_problem,
)

KINDS = ("task", "format", "code", "maths", "grounded", "follow-up")
HELD_OUT_EVERY = 25  # one group in this many is held out (and every held-out topic of the older trainers)
MATHS_PROBLEMS = 4000  # seeded word problems drawn for the stream (those that repeat, once)
SAMPLED_TEMPERATURE = 0.7
SECOND_TURN_EVERY = 2  # every other first-stage answer gets a second turn: grounded, then follow-up, alternately
FORMAT = "1"  # the shard layout; a folder made with another is refused
CORPUS = Path(__file__).resolve().parents[2] / "data" / "corpus"  # the repository's own, grown run by run


@dataclass(frozen=True, slots=True)
class Ask:
    """A first-stage prompt: what kind of task it is and the group (topic, code task, problem) that decides its
    split."""

    kind: str
    group: str
    text: str


def _stable(text: str) -> int:
    return zlib.crc32(text.encode())


def held_out(group: str) -> bool:
    return group in HELD_OUT_TOPICS or _stable(group) % HELD_OUT_EVERY == 0


def asks(seed: int) -> tuple[list[Ask], list[Ask]]:
    """Every first-stage prompt, shuffled by `seed`: (training, held out)."""
    topics = TRAIN_TOPICS + WIDE_TOPICS + HELD_OUT_TOPICS
    items = [Ask("task", topic, t.format(topic=topic)) for topic in topics for t in TEMPLATES + EXTRA_TEMPLATES]
    items += [Ask("format", topic, t.format(topic=topic)) for topic in topics for t in TABLES["format_templates"]]
    items += [Ask("code", task, t.format(language=language, task=task)) for task in TABLES["code_tasks"]
              for language in TABLES["code_languages"] for t in TABLES["code_templates_first"]]
    problems = dict.fromkeys(word_problem(1000 + i, i) for i in range(MATHS_PROBLEMS))  # a few repeat: once each
    items += [Ask("maths", problem, problem) for problem in problems]
    generator = torch.Generator().manual_seed(seed)
    items = [items[i] for i in torch.randperm(len(items), generator=generator).tolist()]
    return [a for a in items if not held_out(a.group)], [a for a in items if held_out(a.group)]


def sampling_for(text: str, seed: int) -> SamplingParams:
    """Greedy for half the prompts, sampled for the other half with a seed of the prompt's own: the same answers on
    a rerun."""
    key = _stable(f"{seed}\0{text}")
    return SamplingParams(temperature=SAMPLED_TEMPERATURE, seed=key) if key % 2 else SamplingParams()


def second_turn(index: int, ask: Ask, answer: str, follow_ups: list[str]) -> tuple[str, list[dict[str, str]]] | None:
    """The second-stage conversation built on first-stage answer `index` (None for most): a grounded task on the
    answer's text, or the same conversation with a follow-up question."""
    if index % SECOND_TURN_EVERY or not answer.strip():
        return None
    if (index // SECOND_TURN_EVERY) % 2 == 0:
        grounded = grounded_task(index // (2 * SECOND_TURN_EVERY), ask.text, answer)
        return ("grounded", [{"role": "user", "content": grounded}]) if grounded is not None else None
    follow_up = follow_ups[_stable(ask.text) % len(follow_ups)]
    return "follow-up", [{"role": "user", "content": ask.text}, {"role": "assistant", "content": answer},
                         {"role": "user", "content": follow_up}]


class Writer:
    """Answers prompts with the batched engine and writes each shard."""

    def __init__(self, target: Any, args: argparse.Namespace) -> None:
        from ..engine.engine import Engine

        self.target, self.args = target, args
        self.generation = GenerationParams(max_new_tokens=args.answer_tokens)
        blocks = args.batch * (2 * args.answer_tokens + 1024) // 8 + 64  # a long grounded prompt and its answer each
        self.engine = Engine(target, EngineParams(max_running=args.batch, num_blocks=blocks, max_batch_tokens=1024),
                             record_blocks=False)

    def answer(self, conversations: list[list[dict[str, str]]], keys: list[str]) -> list[tuple[int, list[int]] | None]:
        """Each conversation's (prompt length, prompt ids followed by the answer's), None where the prompt and its
        longest answer would not fit; `keys` seed the sampled answers."""
        limit = min(self.target.model.config.max_position_embeddings - self.args.answer_tokens, 1024)
        requests: dict[int, int] = {}
        prompts: list[list[int]] = []
        for i, (messages, key) in enumerate(zip(conversations, keys)):
            if self.target.chat:
                ids = chat_ids(self.target.tokenizer, messages)
            else:
                ids = list(self.target.tokenizer("\n\n".join(m["content"] for m in messages)).input_ids)
            prompts.append(ids)
            if len(ids) <= limit:
                requests[self.engine.add_request(ids, sampling_for(key, self.args.seed), self.generation)] = i
        found: list[tuple[int, list[int]] | None] = [None] * len(conversations)
        for rid, output in self.engine.run_all().items():
            i = requests[rid]
            found[i] = (len(prompts[i]), prompts[i] + list(output.token_ids))
            self.engine.forget(rid)
        self.engine.take_events()  # each step's memory record: not kept over millions of tokens
        return found

    def shard(self, items: list[Ask]) -> dict[str, torch.Tensor]:
        """The sequences of one shard: its prompts' answers, then the second turns built on them."""
        first = self.answer([[{"role": "user", "content": a.text}] for a in items], [a.text for a in items])
        turns = []
        for i, (ask, done) in enumerate(zip(items, first)):
            text = "" if done is None else self.target.tokenizer.decode(done[1][done[0]:], skip_special_tokens=True)
            turn = second_turn(i, ask, text, TABLES["follow_ups"])
            if turn is not None:
                turns.append(turn)
        second = self.answer([m for _, m in turns], [m[-1]["content"] + m[0]["content"] for _, m in turns])
        kinds = [a.kind for a in items] + [k for k, _ in turns]
        rows = [(done, kind) for done, kind in zip(first + second, kinds) if done is not None]
        small = self.target.model.config.vocab_size <= 1 << 16  # ids fit 16 bits: half the bytes on disk
        return {"tokens": torch.tensor([t for (_, seq), _ in rows for t in seq], dtype=torch.int32).to(
                    torch.uint16 if small else torch.int32),
                "lengths": torch.tensor([len(seq) for (_, seq), _ in rows], dtype=torch.int32),
                "answer_starts": torch.tensor([start for (start, _), _ in rows], dtype=torch.int32),
                "kinds": torch.tensor([KINDS.index(kind) for _, kind in rows], dtype=torch.int8)}


def answer_tokens(shard: dict[str, torch.Tensor]) -> int:
    return int((shard["lengths"] - shard["answer_starts"]).sum())


def settings(args: argparse.Namespace) -> dict[str, str]:
    """What decides a corpus's shards: a folder holds one corpus, made with one set of these."""
    return {"format": FORMAT, "model": args.model, "weights": args.weights, "answer_tokens": str(args.answer_tokens),
            "shard_prompts": str(args.shard_prompts), "seed": str(args.seed), "kinds": ",".join(KINDS)}


def noted(path: Path) -> dict[str, str]:
    """A shard's metadata: the settings that made it (`settings`), its answer tokens and the seconds it took."""
    with safe_open(str(path), "pt") as handle:
        return dict(handle.metadata() or {})


def stored_settings(path: Path) -> dict[str, str]:
    return {k: v for k, v in noted(path).items() if k not in ("generation_s", "answer_tokens_written")}


def shard_path(out: Path, split: str, index: int) -> Path:
    return out / f"{split}-{index:05d}.safetensors"


def written(out: Path, split: str) -> list[Path]:
    return sorted(out.glob(f"{split}-*.safetensors"))


def shards(folder: Path, split: str) -> list[Path]:
    """The `split` shards a trainer's `--corpus-dir` holds; a folder with none is refused in one line."""
    paths = written(folder, split)
    if not paths:
        raise ConfigError(f"corpus_dir: {folder} holds no {split} shards; write them with python -m playground.train "
                          "corpus")
    return paths


def plan(train: int, held: int) -> list[tuple[str, int]]:
    """The order shards are written in: training shards until `--tokens`, a held-out shard after every
    HELD_OUT_EVERY of them (so a corpus cut short still has its held-out share), as far as the prompts go."""
    order = []
    for index in range(train):
        order.append(("train", index))
        if index % HELD_OUT_EVERY == 0 and index // HELD_OUT_EVERY < held:
            order.append(("held-out", index // HELD_OUT_EVERY))
    return order


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="embedded", help="target model spec (default: embedded)")
    parser.add_argument("--weights", choices=WEIGHTS, default="auto",
                        help="how the target's matrix products read its weights (default auto: a GGUF file's blocks "
                             "in integer products where this CPU can)")
    parser.add_argument("--out", default=str(CORPUS), help="the corpus folder (default: data/corpus, kept in the "
                                                           "repository so that a later run resumes it)")
    parser.add_argument("--tokens", type=int, default=5_000_000,
                        help="answer tokens in the training shards to stop at, 1000..100000000 (default 5000000)")
    parser.add_argument("--answer-tokens", type=int, default=384, help="most tokens per answer, 8..1024 (default 384)")
    parser.add_argument("--shard-prompts", type=int, default=256,
                        help="first-stage prompts per shard, 8..4096 (default 256)")
    parser.add_argument("--batch", type=int, default=32, help="requests the engine decodes together, 1..256 "
                                                              "(default 32)")
    parser.add_argument("--seed", type=int, default=0, help="shuffles the prompts and seeds the sampled answers")


def main(args: argparse.Namespace) -> int:
    from ..models import load_model

    check_int("tokens", args.tokens, 1000, 100_000_000)
    check_int("answer_tokens", args.answer_tokens, 8, 1024)
    check_int("shard_prompts", args.shard_prompts, 8, 4096)
    check_int("batch", args.batch, 1, 256)
    check_int("seed", args.seed, 0, 2**31 - 1)
    out = Path(args.out)
    wanted = settings(args)
    for path in written(out, "train") + written(out, "held-out"):
        if (stored := stored_settings(path)) != wanted:
            raise ConfigError(f"out: {path} was made with {stored}, not {wanted}; pass another --out")
    train, held = asks(args.seed)
    size = args.shard_prompts
    order = plan(-(-len(train) // size), -(-len(held) // size))
    done = sum(answer_tokens_of(p) for p in written(out, "train"))
    log("corpus", f"{len(train)} training and {len(held)} held-out prompts, {size} a shard; {done} of {args.tokens} "
                  f"answer tokens already written in {out}")
    if done >= args.tokens:
        return report(out, args)
    target = load_model(ModelSpec(source=args.model, weights=args.weights))
    writer = Writer(target, args)
    out.mkdir(parents=True, exist_ok=True)
    start, made = time.perf_counter(), 0
    for split, index in order:
        path = shard_path(out, split, index)
        if path.exists():
            continue
        if split == "train" and done >= args.tokens:
            break
        items = (train if split == "train" else held)[index * size : (index + 1) * size]
        begun = time.perf_counter()
        shard = writer.shard(items)
        seconds = time.perf_counter() - begun
        count = answer_tokens(shard)
        partial = path.with_suffix(".partial")
        save_file(shard, str(partial), metadata={**wanted, "generation_s": f"{seconds:.1f}",
                                                 "answer_tokens_written": str(count)})
        partial.rename(path)  # whole or absent: a run stopped mid-shard redoes that shard only
        made += count
        if split == "train":
            done += count
        rate = made / (time.perf_counter() - start)
        left = max(args.tokens - done, 0) / rate / 60
        log("corpus", f"{path.name}: {len(shard['lengths'])} answers, {count} tokens in {seconds:.0f} s "
                      f"({count / seconds:.0f} tokens/s); {done}/{args.tokens} training tokens, "
                      f"about {left:.0f} min left")
    return report(out, args)


def read(folder: Path, split: str = "train", tokens: int | None = None, skip: int = 0) -> tuple[Corpus, float]:
    """A corpus folder's `split` as a trainer's Corpus, shard by shard in order until it holds `tokens` answer tokens
    (None: every shard), after the first shards holding `skip` answer tokens, and the seconds its shards took to
    write. The corpus keeps token ids only: a trainer that needs the target's distributions computes them from the
    sequences."""
    paths = shards(folder, split)
    sequences: list[list[int]] = []
    starts: list[int] = []
    seconds, held, skipped = 0.0, 0, 0
    for path in paths:
        if tokens is not None and held >= tokens:
            break
        if skipped < skip:
            skipped += answer_tokens_of(path)
            continue
        shard = load_file(str(path))
        ids, first = shard["tokens"].to(torch.int64).tolist(), 0
        for length, start in zip(shard["lengths"].tolist(), shard["answer_starts"].tolist()):
            sequences.append(ids[first : first + length])
            starts.append(start)
            first += length
        held += answer_tokens(shard)
        seconds += float(noted(path)["generation_s"])
    none = torch.zeros(0, TOP_K, dtype=torch.int64)
    return Corpus(sequences, starts, none, none.float()), seconds


FEATURES = "features.json"  # in a features folder: what its files hold, and where each sequence's rows are
FEATURE_ROWS = 1 << 18  # most positions a features file holds (1.2 GB at 4 x 576 bfloat16 columns)


class StoredStates(Sequence[torch.Tensor]):
    """Each sequence's states (T_i, F) as `target_pass` returns them, read from the files it wrote into a folder.
    The files are memory-mapped, so the system keeps in memory what fits: a corpus's features may exceed it."""

    def __init__(self, folder: Path, files: list[str], spans: list[tuple[int, int, int]]) -> None:
        self.handles = [safe_open(str(folder / name), "pt") for name in files]
        self.spans = spans  # per sequence: (file, first row, rows)

    def __len__(self) -> int:
        return len(self.spans)

    @overload
    def __getitem__(self, i: int) -> torch.Tensor: ...

    @overload
    def __getitem__(self, i: slice) -> list[torch.Tensor]: ...

    def __getitem__(self, i: int | slice) -> torch.Tensor | list[torch.Tensor]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        file, first, rows = self.spans[i]
        return self.handles[file].get_slice("states")[first : first + rows]  # (T_i, F)


def features_key(target: Any, corpus: Corpus, taps: tuple[int, ...], keep: torch.dtype) -> str:
    """What decides a pass's features: the model and its weights, the taps, the dtype kept and every token."""
    digest = hashlib.sha256(json.dumps([target.name, target.spec.weights, list(taps), str(keep),
                                        corpus.answer_starts]).encode())
    for sequence in corpus.sequences:
        digest.update(torch.tensor(sequence, dtype=torch.int32).numpy().tobytes())
        digest.update(b"|")
    return digest.hexdigest()[:24]


def stored_index(folder: Path, key: str) -> dict[str, Any] | None:
    """What a pass with this key wrote into `folder` before: its files, the spans of the sequences they hold and
    whether it finished (an interrupted pass resumes after its last file); None where nothing of it is there."""
    try:
        index = json.loads((folder / FEATURES).read_text())
    except (OSError, ValueError):
        return None
    if index.get("key") != key or not all((folder / name).is_file() for name in index["files"]):
        return None
    return dict(index)


def stored_states(folder: Path, key: str) -> StoredStates | None:
    """The features a finished pass with this key wrote into `folder` before, or None."""
    index = stored_index(folder, key)
    if index is None or not index.get("complete", True):
        return None
    return StoredStates(folder, index["files"], [tuple(span) for span in index["spans"]])


def target_pass(target: Any, corpus: Corpus, taps: tuple[int, ...] = (), labels: bool = False,
                keep: torch.dtype = torch.bfloat16,
                store: Path | None = None) -> tuple[Sequence[torch.Tensor], Corpus]:
    """One teacher-forced pass of the target's own forward over every sequence: the forward the engine runs (on a
    GGUF file, its blocks in integer products), so a proposer learns what it reads beside that target. One sequence
    a forward: its rows already fill the products.

    Returns each sequence's final-norm hidden states (T_i, E) as `keep`, with `taps` the inputs of those layers
    after them, (T_i, (1 + len(taps)) E); and the corpus, with `labels` its soft labels filled in: the target's
    top-TOP_K log-probabilities at every position that predicts an answer token, in corpus order. With `store`, the
    states go to files in that folder instead of memory (`StoredStates`), and a later pass with the same model,
    taps and corpus and no labels reads them back instead of running the target again; a pass that was stopped
    goes on after the last file it wrote."""
    from ..decoding.base import new_cache

    key = features_key(target, corpus, taps, keep) if store is not None else ""
    if store is not None and not labels and (found := stored_states(store, key)) is not None:
        log("corpus", f"the target's features for these {len(corpus.sequences)} sequences, from {store}")
        return found, corpus
    model, start = target.model, time.perf_counter()
    states: list[torch.Tensor] = []
    top_ids, top_logprobs = [], []
    files: list[str] = []
    spans: list[tuple[int, int, int]] = []
    buffered = 0  # rows in `states` not yet in a file

    def flush(complete: bool = False) -> None:
        """The buffered states (if any) into a file, then the index: what a later pass reads or resumes from."""
        nonlocal buffered
        assert store is not None
        if states:
            name = f"features-{len(files):05d}.safetensors"
            save_file({"states": torch.cat(states)}, str(store / name))
            files.append(name)
            states.clear()
            buffered = 0
        (store / FEATURES).write_text(json.dumps({"key": key, "files": files, "spans": spans, "complete": complete}))

    done = 0  # sequences already in files
    if store is not None:
        store.mkdir(parents=True, exist_ok=True)
        begun = None if labels else stored_index(store, key)
        if begun is not None:  # an earlier pass with this key stopped after writing these
            files, spans = list(begun["files"]), [tuple(span) for span in begun["spans"]]
            done = len(spans)
            log("corpus", f"the target's features: going on after {done} sequences already in {store}")
        else:
            (store / FEATURES).unlink(missing_ok=True)  # the folder's old index no longer holds
    with torch.inference_mode():
        for i, (sequence, answer) in enumerate(zip(corpus.sequences, corpus.answer_starts)):
            if i < done:
                continue
            cache = new_cache(model, len(sequence), GenerationParams())
            ids = torch.tensor([sequence], device=model.device)  # (1, T)
            positions = torch.arange(len(sequence), device=model.device).unsqueeze(0)  # (1, T)
            # the positions answer - 1 .. T - 2 predict the answer's tokens; the last one predicts past the end
            scored = len(sequence) - answer + 1 if labels else 0
            logits, hidden = model(ids, positions, cache, (0,), num_logits=scored, taps=taps)  # (1, n, V), (1, T, E')
            states.append(hidden[0].to("cpu", keep))
            if store is not None:
                spans.append((len(files), buffered, len(sequence)))
                buffered += len(sequence)
                if buffered >= FEATURE_ROWS:
                    flush()
            if labels:
                top = torch.topk(logits[0, :-1].float().log_softmax(-1), TOP_K)  # (T - answer, K)
                top_ids.append(top.indices.cpu())
                top_logprobs.append(top.values.cpu())
            if i % 500 == 0 or i + 1 == len(corpus.sequences):
                log("corpus", f"the target's forward: {i + 1}/{len(corpus.sequences)} sequences "
                              f"({time.perf_counter() - start:.0f} s)")
    if labels:
        corpus = Corpus(corpus.sequences, corpus.answer_starts, torch.cat(top_ids), torch.cat(top_logprobs))
    if store is None:
        return states, corpus
    flush(complete=True)
    return StoredStates(store, files, spans), corpus


def answer_tokens_of(path: Path) -> int:
    return int(noted(path)["answer_tokens_written"])


def report(out: Path, args: argparse.Namespace) -> int:
    """corpus.json: what the folder holds, per split, with the time its shards took."""
    summary: dict[str, Any] = {"settings": settings(args)}
    for split in ("train", "held-out"):
        paths = written(out, split)
        summary[split] = {"shards": len(paths), "answer_tokens": sum(answer_tokens_of(p) for p in paths),
                          "generation_s": round(sum(float(noted(p)["generation_s"]) for p in paths), 1)}
    (out / "corpus.json").write_text(json.dumps(summary, indent=2) + "\n")
    log("corpus", json.dumps(summary))
    return 0
