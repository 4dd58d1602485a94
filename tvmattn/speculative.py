"""Speculative decoding (greedy): draft token trees, verify them in one model step, accept the
longest path the model agrees with.

A verify step of one sequence feeds a token tree through the library's `batch_verify`:

- node 0, the root, is the *pending* token: the last token chosen (it is part of the answer)
  but not yet in the KV cache (plain decoding feeds it in the next `decode` step);
- the other nodes are draft tokens, each a guess of the token that follows its parent's path;
  `parents[i]` is node i's parent (-1 for the root), always an earlier node, and siblings hold
  different tokens. The cache's `begin_forward` gets these parents as `token_tree_parent_ptr`.

`batch_verify` returns the logits after every node's root-to-node path. Acceptance
(`accept_greedy`) walks from the root: the model's next token after a node is the argmax of
its logits; when a child of the node holds that token, the child is accepted and the walk goes
on from it, otherwise the walk stops and that argmax is the *bonus* token (the new pending
token). The accepted path's draft tokens and the bonus are exactly the tokens plain greedy
decoding would have produced, one per step; the cache keeps the path
(`commit_accepted_token_tree_nodes(seq_ids, [leaf])`) and drops the other nodes. A step thus
yields 1 + (accepted drafts) tokens.

Drafters (a tree has at most `draft_len` draft nodes besides the root; with `adaptive`, the
default, each sequence drafts at most its own limit, which starts at draft_len and follows its
acceptance: `next_draft_len`):

- `PromptLookup` (no second model): n-gram lookup in the sequence so far (prompt + answer,
  ending with the pending token). For n from `max_ngram` down to `min_ngram`, the last n
  tokens are searched for earlier occurrences, the most recent first; the tokens that followed
  an occurrence are a *continuation*. With `tree_width` W = 1 the first continuation found
  (longest n-gram, most recent occurrence) is a chain of up to draft_len tokens. With W > 1,
  up to W continuations that differ are merged as a trie under the root (shared prefixes share
  nodes), filled breadth first: depth 1 of every continuation, then depth 2, ..., until the
  draft_len budget is spent, so alternatives near the root (where they matter most) come
  before long tails. Node order is that insertion order: parents before children.
- `DraftModel` (in `tvmattn.serve.runner`, as it drives a library): another compiled library
  with the same vocabulary (any size; a model can draft for itself) and its own KV cache
  drafts greedily: with W = 1 a chain of draft_len
  argmax tokens; with W > 1 the top-W tokens after the root as siblings, and the argmax chain
  continued below the first of them (draft_len - W + 1 deep), draft_len nodes in all. After
  each verify step its cache is rolled back (popn) to the longest prefix it shares with the
  accepted sequence; the tokens it lacks are fed before the next draft.

Back-off (`SpeculativeOptions.back_off`, the default): drafts pay only when the tokens a verify
step yields outweigh its cost, and a verify step can cost several plain decode steps (on the
CPU a kept-quantized library decodes one row with GEMV kernels, while verification runs the
GEMM path). So before every step the engine asks `BackOff.plan` which sequences should verify
a draft and how long: from the measured cost of plain steps, verify steps and drafting
(`StepCosts`, kept by the library's session across requests, a linear fit in the nodes fed) and each
sequence's estimated per-token acceptance p (`Acceptance`, recent results weigh most), a draft
`depth` deep is expected to yield 1 + p + ... + p^depth tokens. It speculates only when the
expected tokens per second beat plain decoding's by `BACK_OFF_MARGIN`; otherwise the step is a
plain decode step. Greedy tokens are the same either way. What it learns while backed off:

- prompt lookup keeps drafting (a lookup costs microseconds) and checks each draft against the
  tokens plain decoding then produces (a *shadow* draft, at most one pending per sequence),
  which measures its acceptance for free; it starts sceptical (PROMPT_LOOKUP_PRIOR), so drafts
  are verified only once they have been seen to match;
- a draft model can only learn by drafting: while a sequence decodes plainly its evidence fades
  back toward the prior (IDLE_DECAY per step), which brings a new probe after a while, unless
  even drafts that are always accepted cannot pay (a draft model as slow as the model itself).
Until a cost is measured, a prior stands in (a verify step: VERIFY_PRIOR_CPU or
VERIFY_PRIOR_GPU plain steps; a draft token: a plain step scaled by the draft model's share of
the weights); the first verify step measures it.

Only greedy decoding is speculative here (temperature 0); sampling would need speculative
sampling (rejection against the draft distribution), which is not implemented, and the
engine drafts for greedy requests only. This module holds the pure logic (numpy only, no TVM import); the loop
that drives a library lives in the serving engine (`tvmattn.serve.engine`).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Sequence

import numpy as np

MODES = ("prompt-lookup", "draft-model")
MAX_DRAFT_LEN = 255  # draft nodes per tree (the root makes 256)
DEFAULT_DRAFT_LEN = 8
DEFAULT_MAX_NGRAM = 4


_CODE = """import math

def area(radius):
    return math.pi * radius * radius

def circumference(radius):
    return 2 * math.pi * radius

print(area(2), circumference(2))"""
# Two prompts the tests and benchmarks share: a repetitive one (the answer copies code from the
# prompt, where prompt lookup drafts well) and a free-form one.
EXAMPLE_PROMPTS = {
    "code-edit": "Rename the function `area` to `circle_area` in this code and show the full code:\n```python\n"
                 + _CODE + "\n```",
    "free-form": "Write a short story about a robot who learns to paint.",
}


@dataclasses.dataclass(frozen=True)
class SpeculativeOptions:
    """mode: "prompt-lookup" or "draft-model"; draft_len: most draft nodes per tree (1..255);
    tree_width: continuations (prompt-lookup) or top-k tokens at the first draft position
    (draft-model); draft_lib: the drafting library (draft-model only); max_ngram / min_ngram:
    the n-gram sizes prompt lookup tries, longest first; adaptive: each sequence's draft length
    follows its acceptance (`next_draft_len`), draft_len is then the most; back_off: a step
    verifies drafts only where they are expected to pay (`BackOff`), else it decodes plainly
    (False: every step verifies whatever was drafted). Raises ValueError."""

    mode: str
    draft_len: int = DEFAULT_DRAFT_LEN
    tree_width: int = 1
    draft_lib: str | None = None
    max_ngram: int = DEFAULT_MAX_NGRAM
    min_ngram: int = 1
    adaptive: bool = True
    back_off: bool = True

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"speculative mode {self.mode!r} is not supported: expected one of {MODES}")
        if not 1 <= self.draft_len <= MAX_DRAFT_LEN:
            raise ValueError(f"draft_len must be from 1 to {MAX_DRAFT_LEN}, got {self.draft_len}")
        if not 1 <= self.tree_width <= self.draft_len:
            raise ValueError(f"tree_width must be from 1 to draft_len ({self.draft_len}), got {self.tree_width}")
        if (self.mode == "draft-model") != (self.draft_lib is not None):
            raise ValueError("draft_lib is needed by mode 'draft-model' and only by it")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")


@dataclasses.dataclass
class DraftTree:
    """A token tree: node 0 is the root (the pending token); parents[i] < i for i > 0."""

    tokens: list[int]
    parents: list[int]

    @classmethod
    def root(cls, token: int) -> "DraftTree":
        return cls([int(token)], [-1])

    @classmethod
    def chain(cls, root: int, drafts: Sequence[int]) -> "DraftTree":
        return cls([int(root), *(int(t) for t in drafts)], list(range(-1, len(drafts))))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_drafts(self) -> int:
        return len(self.tokens) - 1

    def add(self, parent: int, token: int) -> int:
        """Append a node; returns its index."""
        self.tokens.append(int(token))
        self.parents.append(int(parent))
        return len(self.tokens) - 1

    def child(self, node: int, token: int) -> int | None:
        """The child of `node` holding `token`, or None."""
        for index in range(node + 1, len(self.tokens)):
            if self.parents[index] == node and self.tokens[index] == token:
                return index
        return None

    def path(self, node: int) -> list[int]:
        """Node indices from the root to `node`."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def check(self) -> None:
        """ValueError unless this is a well-formed tree (one root, parents first, distinct siblings)."""
        if len(self.tokens) != len(self.parents) or not self.tokens or self.parents[0] != -1:
            raise ValueError("a draft tree needs a root (node 0, parent -1) and one parent per token")
        seen = set()
        for index, parent in enumerate(self.parents[1:], start=1):
            if not 0 <= parent < index:
                raise ValueError(f"node {index}: parent {parent} is not an earlier node")
            if (parent, self.tokens[index]) in seen:
                raise ValueError(f"node {index}: a sibling already holds token {self.tokens[index]}")
            seen.add((parent, self.tokens[index]))


def build_trie(root: int, continuations: Sequence[Sequence[int]], budget: int) -> DraftTree:
    """Merge continuations (each a guess of the tokens after the root) into a trie of at most
    `budget` draft nodes, breadth first: depth d of every continuation (in their order) before
    depth d + 1. Shared prefixes share nodes."""
    tree = DraftTree.root(root)
    at = [0] * len(continuations)  # the node each continuation has reached; None: stopped
    for depth in range(max((len(c) for c in continuations), default=0)):
        for index, continuation in enumerate(continuations):
            if at[index] is None or depth >= len(continuation):
                continue
            node = tree.child(at[index], continuation[depth])
            if node is None:
                if tree.num_drafts >= budget:
                    at[index] = None
                    continue
                node = tree.add(at[index], continuation[depth])
            at[index] = node
    return tree


def ngram_continuations(context: Sequence[int], length: int, count: int = 1, max_ngram: int = DEFAULT_MAX_NGRAM,
                        min_ngram: int = 1) -> list[list[int]]:
    """Up to `count` different continuations of up to `length` tokens for `context`: for n
    from max_ngram down to min_ngram, each earlier occurrence of the last n tokens (most recent
    first) gives the tokens that followed it. A continuation equal to a prefix of one already
    found is skipped (it would add no node to a trie)."""
    found: list[list[int]] = []
    if length < 1 or count < 1:
        return found
    tokens = np.asarray(context, dtype=np.int64)
    size = len(tokens)
    for n in range(min(max_ngram, size - 1), min_ngram - 1, -1):
        pattern = tokens[size - n:]
        # occurrences starting at i with i + n < size (at least one token follows), latest first
        starts = np.flatnonzero(tokens[: size - n] == pattern[0])
        for i in starts[::-1]:
            if n > 1 and not np.array_equal(tokens[i:i + n], pattern):
                continue
            continuation = tokens[i + n:i + n + length].tolist()
            if any(c[:len(continuation)] == continuation for c in found):
                continue
            found.append(continuation)
            if len(found) == count:
                return found
    return found


class PromptLookup:
    """Drafts from n-gram matches in the sequence so far (module docstring)."""

    def __init__(self, draft_len: int, tree_width: int = 1, max_ngram: int = DEFAULT_MAX_NGRAM, min_ngram: int = 1):
        self.draft_len, self.tree_width = draft_len, tree_width
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def draft(self, context: Sequence[int], budget: int | None = None) -> DraftTree:
        """The tree for a sequence whose tokens so far are `context` (its last one is the
        pending token, the root), with at most min(budget, draft_len) draft nodes."""
        budget = self.draft_len if budget is None else min(budget, self.draft_len)
        if budget < 1:
            return DraftTree.root(context[-1])
        continuations = ngram_continuations(context, budget, self.tree_width, self.max_ngram, self.min_ngram)
        return build_trie(context[-1], continuations, budget)


def accept_greedy(tree: DraftTree, logits: np.ndarray) -> tuple[list[int], int]:
    """(accepted path: node indices from the root, bonus token) for a tree and the logits
    [len(tree), vocab] after each node: a child is accepted when it holds the argmax of its
    parent's logits; the bonus is the argmax after the last accepted node."""
    return accept_argmax(tree, lambda node: int(np.argmax(logits[node])))


def accept_argmax(tree: DraftTree, best_after: Callable[[int], int]) -> tuple[list[int], int]:
    """accept_greedy from the argmax after each node, best_after(node) (e.g. the device
    sampler's greedy ids: the lowest id among equal maxima, as np.argmax)."""
    node, path = 0, [0]
    while True:
        best = best_after(node)
        child = tree.child(node, best)
        if child is None:
            return path, best
        node = child
        path.append(node)


def draft_model_tree(root: int, first_logits: np.ndarray, chain: Sequence[int], width: int) -> DraftTree:
    """The draft model's tree: the top-`width` tokens of first_logits (the draft model's logits
    after the root) as the root's children, best first, and `chain` (the draft model's greedy
    tokens after the best one) below the best child."""
    order = np.argsort(-first_logits, kind="stable")[:width]
    tree = DraftTree.root(root)
    for token in order:
        tree.add(0, int(token))
    parent = 1
    for token in chain:
        parent = tree.add(parent, token)
    return tree


def tree_depth(tree: DraftTree) -> int:
    """Draft tokens on the tree's longest root-to-node path."""
    depth = [0] * len(tree)
    for node in range(1, len(tree)):
        depth[node] = depth[tree.parents[node]] + 1
    return max(depth)


def next_draft_len(current: int, accepted: int, depth: int, most: int) -> int:
    """Adaptive draft length of a sequence after a verify step that accepted `accepted` drafts of
    a tree `depth` deep: doubled (up to `most`) when the whole depth was accepted, else one more
    than what was accepted. Drafts the model rejects cost a verify node each, so a sequence
    whose drafts fail drafts little until they match."""
    return min(most, 2 * current) if accepted >= depth else max(1, accepted + 1)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclasses.dataclass
class SpeculativeStats:
    """Counts of a speculative generation: verify steps (trees verified, one per sequence and
    step), draft nodes fed, draft tokens accepted, and plain steps (per sequence: decode steps
    taken while drafts did not pay, or found nothing)."""

    mode: str
    verify_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    plain_steps: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted(self) -> float:
        """Draft tokens accepted per verify step (each step also yields its bonus token)."""
        return self.accepted / self.verify_steps if self.verify_steps else 0.0


# ---------------------------------------------------------------------- back-off

BACK_OFF_MARGIN = 0.1  # speculate only when expected tokens per second beat plain decoding's by 10%
PROMPT_LOOKUP_PRIOR = (0.5, 2.0)  # (accepted, rejected) pseudo-counts: p = 0.2 before any evidence
DRAFT_MODEL_PRIOR = (1.0, 1.0)  # p = 0.5: a draft model learns only by drafting
ACCEPTANCE_DECAY = 0.8  # per observation: the last few drafts weigh most
IDLE_DECAY = 0.9  # draft model, per plain step: evidence fades toward the prior (a later probe)
# A verify step's cost before one is measured, in plain steps: (fixed, per node beyond one a
# sequence). On the CPU a plain step of one sequence runs single-row GEMV kernels and a verify
# step the GEMM path, dearer; on a GPU a decode step is bound by latency and a few more rows
# cost little. Both lean optimistic: the first verify step measures the truth.
VERIFY_PRIOR_CPU = (2.0, 0.1)
VERIFY_PRIOR_GPU = (1.0, 0.02)
COST_WINDOW = 16  # the most recent steps a cost fit uses
PLAIN_EMA = 0.3  # weight of the newest plain step in its running mean


class Acceptance:
    """A sequence's estimated per-token acceptance p: draft token d + 1 is accepted with
    probability p once token d was (a geometric model). Evidence: (accepted, trials) counts,
    decayed per observation, on top of a prior's pseudo-counts."""

    def __init__(self, prior: tuple[float, float] = DRAFT_MODEL_PRIOR):
        self.prior = prior
        self.accepted = 0.0
        self.trials = 0.0

    def observe(self, accepted: int, depth: int) -> None:
        """A draft `depth` deep of which the first `accepted` tokens were accepted."""
        trials = accepted + (1 if accepted < depth else 0)
        self.accepted = ACCEPTANCE_DECAY * self.accepted + accepted
        self.trials = ACCEPTANCE_DECAY * self.trials + trials

    def fade(self, factor: float = IDLE_DECAY) -> None:
        self.accepted *= factor
        self.trials *= factor

    @property
    def p(self) -> float:
        good, bad = self.prior
        return (self.accepted + good) / (self.trials + good + bad)

    def expected(self, depth: int) -> float:
        """Expected accepted drafts of a draft `depth` deep: p + p^2 + ... + p^depth."""
        p = self.p
        return p * (1 - p ** depth) / (1 - p) if p < 1 else float(depth)


def _line_stats(points) -> tuple[int, float, float, float, float, float]:
    """(count, mean x, mean y, variance of x, covariance, range of x) of (x, y) points."""
    xs = np.array([x for x, _ in points], dtype=np.float64)
    ys = np.array([y for _, y in points], dtype=np.float64)
    return (len(points), float(xs.mean()), float(ys.mean()), float(xs.var()),
            float(((xs - xs.mean()) * (ys - ys.mean())).mean()), float(np.ptp(xs)))


def _fit(stats: tuple[int, float, float, float, float, float], prior_slope: float) -> tuple[float, float]:
    """(intercept, slope) of seconds against nodes by least squares, from `_line_stats`; with too
    few or too alike points, the slope is `prior_slope` and the intercept fits the mean."""
    count, mean_x, mean_y, var_x, cov, spread = stats
    slope = max(cov / var_x, 0.0) if count >= 3 and spread >= 2 else prior_slope
    return max(mean_y - slope * mean_x, 0.0), slope


class StepCosts:
    """Measured wall time of a library's steps, kept by its session across requests:
    plain decode steps by batch size (a running mean), verify steps by nodes fed (roots
    included) and draft-model drafting by draft tokens (linear fits over the last COST_WINDOW).
    verify_prior: VERIFY_PRIOR_CPU or VERIFY_PRIOR_GPU, until a verify step is measured."""

    def __init__(self, verify_prior: tuple[float, float] = VERIFY_PRIOR_GPU) -> None:
        self.verify_prior = verify_prior
        self.plain: dict[int, float] = {}
        self.verify: collections.deque = collections.deque(maxlen=COST_WINDOW)
        self.draft: collections.deque = collections.deque(maxlen=COST_WINDOW)
        self._stats: dict[str, tuple] = {}  # `_line_stats` of verify / draft, until the next observation

    def observe_plain(self, batch: int, seconds: float) -> None:
        known = self.plain.get(batch)
        self.plain[batch] = seconds if known is None else (1 - PLAIN_EMA) * known + PLAIN_EMA * seconds

    def observe_verify(self, nodes: int, seconds: float) -> None:
        self.verify.append((nodes, seconds))
        self._stats.pop("verify", None)

    def observe_draft(self, tokens: int, seconds: float) -> None:
        self.draft.append((tokens, seconds))
        self._stats.pop("draft", None)

    def _fit(self, kind: str, prior_slope: float) -> tuple[float, float]:
        if kind not in self._stats:
            self._stats[kind] = _line_stats(self.verify if kind == "verify" else self.draft)
        return _fit(self._stats[kind], prior_slope)

    def plain_time(self, batch: int) -> float | None:
        """Seconds of a plain step of `batch` sequences (the nearest batch size measured), or None."""
        if not self.plain:
            return None
        return self.plain[min(self.plain, key=lambda b: (abs(b - batch), b))]

    def verify_time(self, nodes: int, batch: int) -> float:
        """Seconds of a verify step feeding `nodes` nodes over `batch` sequences (needs a plain time)."""
        plain = self.plain_time(batch)
        fixed, per_node = self.verify_prior
        if not self.verify:
            return plain * (fixed + per_node * max(nodes - batch, 0))
        intercept, slope = self._fit("verify", per_node * plain)
        return intercept + slope * nodes

    def draft_time(self, tokens: int, per_token_prior: float) -> float:
        """Seconds a draft model takes to draft `tokens` tokens over a step."""
        if tokens == 0:
            return 0.0
        if not self.draft:
            return per_token_prior * tokens
        intercept, slope = self._fit("draft", per_token_prior)
        return intercept + slope * tokens


@dataclasses.dataclass(frozen=True)
class DraftOption:
    """One way a sequence may draft this step: `budget` draft nodes, `depth` of them on its
    longest path."""

    budget: int
    depth: int


class BackOff:
    """Which sequences verify a draft at a step, and how long (module docstring)."""

    def __init__(self, costs: StepCosts, prior: tuple[float, float], draft_token_prior: float | None = None,
                 margin: float = BACK_OFF_MARGIN):
        """draft_token_prior: for a draft model, the prior seconds per draft token as a fraction
        of a plain step of one sequence (None: drafting costs nothing, prompt lookup)."""
        self.costs, self.prior, self.margin = costs, prior, margin
        self.draft_token_prior = draft_token_prior
        self.acceptance: dict[int, Acceptance] = {}
        # prompt lookup: the draft each sequence made while decoding plainly, checked as tokens come
        self.shadows: dict[int, tuple[int, list[int]]] = {}

    def of(self, seq_id: int) -> Acceptance:
        if seq_id not in self.acceptance:
            self.acceptance[seq_id] = Acceptance(self.prior)
        return self.acceptance[seq_id]

    def _draft_seconds(self, tokens: int) -> float:
        if self.draft_token_prior is None:
            return 0.0
        return self.costs.draft_time(tokens, self.draft_token_prior * self.costs.plain_time(1))

    def plan(self, options: dict[int, list[DraftOption]], batch: int) -> dict[int, int]:
        """seq id -> draft budget for this step (absent: no draft; {}: a plain step) from each
        sequence's options (increasing budgets) among `batch` active sequences. Budgets are
        capped alike (each sequence takes its largest option under the cap); sequences join in
        order of expected accepted drafts per node; the plan with the most expected tokens per
        second wins if it beats a plain step's by the margin."""
        plain = self.costs.plain_time(batch)
        if plain is None or not any(options.values()):
            return {}  # a plain step first: it measures what the drafts must beat
        best_rate, best = batch / plain * (1 + self.margin), {}
        caps = sorted({o.budget for opts in options.values() for o in opts})
        for cap in caps:
            picks = []
            for seq_id, opts in options.items():
                fitting = [o for o in opts if o.budget <= cap]
                if fitting:
                    option = fitting[-1]
                    picks.append((self.of(seq_id).expected(option.depth), option.budget, seq_id))
            picks.sort(key=lambda pick: -pick[0] / pick[1])
            gain = nodes = 0.0
            plan = {}
            for expected, budget, seq_id in picks:
                gain, nodes = gain + expected, nodes + budget
                plan[seq_id] = budget
                seconds = self.costs.verify_time(int(batch + nodes), batch) + self._draft_seconds(int(nodes))
                rate = (batch + gain) / seconds
                if rate > best_rate:
                    best_rate, best = rate, dict(plan)
        return best

    def verified(self, seq_id: int, accepted: int, depth: int) -> None:
        self.of(seq_id).observe(accepted, depth)
        self.shadows.pop(seq_id, None)

    def forget(self, seq_id: int) -> None:
        """Drop what is known of a sequence (it has ended)."""
        self.acceptance.pop(seq_id, None)
        self.shadows.pop(seq_id, None)

    def shadow(self, seq_id: int, position: int, draft: list[int]) -> None:
        """A draft not verified: the tokens it guesses for positions position, position + 1, ...
        of the answer (kept only when none is pending for the sequence)."""
        if draft and seq_id not in self.shadows:
            self.shadows[seq_id] = (position, list(draft))

    def check_shadow(self, seq_id: int, answer: list[int]) -> tuple[int, int] | None:
        """(accepted, depth) of the sequence's pending shadow draft once the answer decides it
        (it is then observed and dropped), else None."""
        if seq_id not in self.shadows:
            return None
        position, draft = self.shadows[seq_id]
        known = answer[position:position + len(draft)]
        accepted = common_prefix(known, draft)
        if accepted == len(known) and len(known) < len(draft):
            return None  # all agree so far: wait for more tokens
        del self.shadows[seq_id]
        self.of(seq_id).observe(accepted, len(draft))
        return accepted, len(draft)


def first_chain(tree: DraftTree) -> list[int]:
    """The draft tokens along the tree's first branch (each node's first child): its best guess."""
    chain, node = [], 0
    for index in range(1, len(tree)):
        if tree.parents[index] == node:
            chain.append(tree.tokens[index])
            node = index
    return chain
