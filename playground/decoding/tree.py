"""Candidate trees for Medusa decoding, described as in the Medusa paper: a list of paths of top-k ranks.

Path (i0, i1, ..., id) is the node reached by taking rank i0 of head 0's top-k after the root (the last
committed token), then rank i1 of head 1's top-k, and so on; its depth is its length. The buffers are built once
per tree: node order, parents, the attention mask among the new tokens, position offsets and the
root-to-leaf paths used to pick the accepted one. Node 0 is the root; nodes 1..n follow in (depth, path) order.
The dynamic tree (`best_first`) is chosen anew at every step from the heads' own probabilities.
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import ConfigError

MAX_TREE_NODES = 128
MAX_TREE_DEPTH = 16
COPY_PRIOR = 0.8  # the probability the dynamic tree's ranking gives each token a copy proposes (docs/defaults.md)


@dataclass(frozen=True)
class TreeBuffers:
    paths: tuple[tuple[int, ...], ...]  # head node i + 1 -> its path of ranks (the root has none)
    parents: tuple[int, ...]  # node -> parent node; the root's is -1
    depths: tuple[int, ...]  # node -> depth (root 0): its position offset from the root's position
    children: tuple[tuple[int, ...], ...]  # node -> its children, by rank (a grafted chain's node last)
    mask: torch.Tensor  # (n + 1, n + 1) bool: node i sees node j iff j is i or one of its ancestors
    retrieve: tuple[tuple[int, ...], ...]  # every root-to-leaf path as node indices, root first

    @property
    def num_nodes(self) -> int:
        """Tree nodes, root excluded: the tokens proposed per step (the heads' and any grafted chain's)."""
        return len(self.parents) - 1

    @property
    def depth(self) -> int:
        return max(self.depths)

    def top_k(self) -> list[int]:
        """How many top-k candidates each head must supply: head d needs 1 + the largest rank at depth d + 1."""
        need = [0] * max(len(path) for path in self.paths)
        for path in self.paths:
            need[len(path) - 1] = max(need[len(path) - 1], path[-1] + 1)
        return need


def ancestor_mask(parents: list[int] | tuple[int, ...]) -> torch.Tensor:
    """(N, N) bool: node i sees itself and its ancestors; parents[i] is i's parent, -1 for a root (each parent
    numbered before its children)."""
    size = len(parents)
    rows: list[list[bool]] = []  # a node's row is its parent's with itself added: built in Python, one tensor
    for node, parent in enumerate(parents):
        row = list(rows[parent]) if parent >= 0 else [False] * size
        row[node] = True
        rows.append(row)
    return torch.tensor(rows, dtype=torch.bool).reshape(size, size)


def _buffers(paths: tuple[tuple[int, ...], ...], parents: tuple[int, ...]) -> TreeBuffers:
    """Buffers for nodes given by their parents, each parent before its children (node 0, the root, first)."""
    size = len(parents)
    depths = [0] * size
    children: list[list[int]] = [[] for _ in range(size)]
    for node in range(1, size):
        depths[node] = depths[parents[node]] + 1
        children[parents[node]].append(node)
    mask = ancestor_mask(parents)
    retrieve = []
    for leaf in (n for n in range(size) if not children[n]):
        chain = [leaf]
        while chain[-1] != 0:
            chain.append(parents[chain[-1]])
        retrieve.append(tuple(reversed(chain)))
    return TreeBuffers(paths, parents, tuple(depths), tuple(tuple(c) for c in children), mask, tuple(retrieve))


def build_tree(paths: list[list[int]] | list[tuple[int, ...]]) -> TreeBuffers:
    """Buffers for a tree given by its paths; every prefix of a path must be a path too (a tree, not a forest)."""
    if not isinstance(paths, (list, tuple)) or not paths:
        raise ConfigError("tree: a non-empty list of paths (lists of top-k ranks) is required")
    if len(paths) > MAX_TREE_NODES:
        raise ConfigError(f"tree: at most {MAX_TREE_NODES} nodes, got {len(paths)}")
    nodes: set[tuple[int, ...]] = set()
    for i, path in enumerate(paths):
        if (not isinstance(path, (list, tuple)) or not 1 <= len(path) <= MAX_TREE_DEPTH
                or not all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r < 64 for r in path)):
            raise ConfigError(f"tree: path {i} must be a list of 1..{MAX_TREE_DEPTH} ranks in [0, 63], got {path!r}")
        if tuple(path) in nodes:
            raise ConfigError(f"tree: path {list(path)} appears twice")
        nodes.add(tuple(path))
    for node in nodes:
        if len(node) > 1 and node[:-1] not in nodes:
            raise ConfigError(f"tree: path {list(node)} needs its parent {list(node[:-1])} in the tree")
    ordered = tuple(sorted(nodes, key=lambda p: (len(p), p)))
    index = {path: i + 1 for i, path in enumerate(ordered)}
    parents = (-1, *(index[p[:-1]] if len(p) > 1 else 0 for p in ordered))
    return _buffers(ordered, parents)


def best_first(logp: list[list[float]], tokens: list[list[int]], copy: list[int], nodes: int,
               copy_prior: float = COPY_PRIOR, chained: bool = False) -> tuple[tuple[tuple[int, ...], ...], int]:
    """The dynamic tree: the `nodes` candidates with the highest estimated probability of being accepted.

    logp[d][r], tokens[d][r] (D, k): head d's log-probability and token at rank r, best first; copy: the tokens a
    copy of earlier text proposes after the root (empty: none). A candidate's estimate is the product of its
    heads' probabilities along its path (the heads guess independently of one another), with `copy_prior` for a
    token the copy proposes at that place when that is higher. Every ancestor of a chosen node outranks it, so
    the choice is a tree. Where the copy's token is not among its head's top k (or lies past the heads' depth) the
    copy goes on as a chain of its own nodes below the deepest head node it runs through, with nothing else below
    it (docs/defaults.md says why). With `chained`, the guesses are a draft model's: its guess at depth d + 1 was
    drawn after its top guess at depth d, so only the top-ranked path has guesses below it (a runner-up is a leaf,
    the copy's own nodes aside).
    Returns the chosen heads' paths of ranks and how many of the copy's own nodes hang below."""
    prior, depth_limit, order = math.log(copy_prior), len(logp), itertools.count()
    # (-estimate, tie order, path of ranks or None for the copy's next own node, on the copy's path, and for a head
    # node in its parent's ranked run: (the parent's estimate, the rank the copy took out of that run, or -1))
    frontier: list[tuple[float, int, tuple[int, ...] | None, bool, tuple[float, int] | None]] = []

    def next_in_run(parent: tuple[int, ...], score: float, rank: int, skip: int) -> None:
        """Put the child of `parent` at `rank` (past `skip`, the copy's child, taken out of the run) on the
        frontier. A head's ranks are best first, so a child is never worth more than the one before it: its next
        sibling joins only when it is taken, and a step pushes O(nodes) candidates instead of O(nodes x k)."""
        rank += rank == skip
        row = logp[len(parent)]
        if rank < len(row):
            heapq.heappush(frontier, (-(score + row[rank]), next(order), parent + (rank,), False, (score, skip)))

    def offer(path: tuple[int, ...], score: float, on_copy: bool) -> None:
        """Put the best children of the head node `path` (the root: ()) on the frontier: its heads' top-ranked
        candidate, and the copy's token there, worth at least `copy_prior`."""
        depth = len(path)
        copied = copy[depth] if on_copy and depth < len(copy) else None
        skip = -1
        if depth < depth_limit and not (chained and any(path)):
            if copied is not None and copied in tokens[depth]:
                skip = tokens[depth].index(copied)
                lp = max(logp[depth][skip], prior)
                heapq.heappush(frontier, (-(score + lp), next(order), path + (skip,), True, None))
            next_in_run(path, score, 0, skip)
        if copied is not None and skip < 0:
            heapq.heappush(frontier, (-(score + prior), next(order), None, True, None))

    chosen: list[tuple[int, ...]] = []
    chain, copy_depth = 0, 0  # copy-only nodes taken, and the depth of the copy's deepest head node
    offer((), 0.0, True)
    while frontier and len(chosen) + chain < nodes:
        estimate, _, path, on_copy, run = heapq.heappop(frontier)
        if path is None:
            chain += 1
            if copy_depth + chain < len(copy):
                heapq.heappush(frontier, (estimate - prior, next(order), None, True, None))
            continue
        chosen.append(path)
        if run is not None:
            next_in_run(path[:-1], run[0], path[-1] + 1, run[1])
        if on_copy:
            copy_depth = len(path)
        offer(path, -estimate, on_copy)
    return tuple(chosen), chain


# Named trees, for teaching and for comparison with the dynamic tree (best_first, the default), which commits more
# than any of them at the same width; "wide" suits where a wider forward is nearly free.
DYNAMIC_TREE = "dynamic"  # Medusa's tree chosen at every step
TREES: dict[str, list[tuple[int, ...]]] = {
    "chain": [(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)],
    "small": [(0,), (1,), (0, 0), (0, 0, 0), (0, 0, 0, 0)],
    "medium": [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0)],
    "wide": [(0,), (1,), (2,), (3,), (4,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (3, 0), (0, 0, 0),
             (0, 0, 1), (0, 1, 0), (1, 0, 0), (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (1, 0, 0, 0)],
}


def load_tree(spec: str) -> TreeBuffers:
    """A named tree (see TREES) or a JSON file holding a list of paths (the dynamic tree has no fixed buffers)."""
    if spec in TREES:
        return build_tree(TREES[spec])
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ConfigError(f"tree must be one of {', '.join((DYNAMIC_TREE, *TREES))} or a JSON file of paths, got "
                          f"{spec!r}")
    try:
        paths = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"tree: {path} is not a JSON list of paths ({exc})") from exc
    return build_tree(paths)
