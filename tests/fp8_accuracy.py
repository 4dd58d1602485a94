"""The accuracy of an FP8 KV cache on a real model (SmolLM2-135M-Instruct), against the same
library with unquantized K/V: greedy tokens, logits and perplexity. Used by
tests/test_fp8_smollm2.py and runnable as a script to print the figures."""

from __future__ import annotations

from pathlib import Path

import numpy as np

PASSAGE = Path(__file__).parent / "data" / "python-license.txt"
PROMPTS = ["What is the capital of France?", "Write a short poem about the sea.",
           "Explain in two sentences why the sky is blue."]
# Tokens per step when scoring the passage: the history comes from the pages (FP8), only the
# step's own tokens are attended unquantized (ragged prefill), as in a decode-heavy run.
SCORE_CHUNK = 16


def greedy_tokens(generator, prompts=PROMPTS, steps: int = 64) -> list[list[int]]:
    """Greedy tokens of each prompt (one at a time: a stop token ends it early)."""
    return [generator.generate_tokens([generator.encode(p)], max_new_tokens=steps).tokens[0] for p in prompts]


def fresh_session(generator, tokens: int):
    """The generator's ModelSession with a new one-sequence cache of `tokens` tokens (at its
    kv_scales); the generator makes a cache of its own again on its next call."""
    session = generator.session
    generator.runner = None
    page = session.settings["page_size"]
    session.create_cache(1, -(-tokens // page) * page + page)
    return session


def forced_logits(generator, prompt: list[int], continuation: list[int]) -> np.ndarray:
    """float32 [len(continuation) + 1, vocab]: teacher forcing, as generation runs its steps (the
    prompt prefilled, then one decode step per token of `continuation`); row t is the logits the
    token after prompt + continuation[:t] is chosen from."""
    session = fresh_session(generator, len(prompt) + len(continuation) + 1)
    session.add_sequence(0)
    try:
        rows = [session.prefill([0], [prompt])[0]]
        for token in continuation:
            rows.append(session.decode_step([0], [token])[0])
    finally:
        session.remove_sequence(0)
    return np.stack(rows)


def token_match(reference, fp8, prompts=PROMPTS, steps: int = 64) -> dict:
    """Greedy agreement with teacher forcing: both generators are fed each prompt followed by the
    reference's own greedy tokens, and at every position (each of the reference's tokens, plus
    its stop token where it stopped early) their argmaxes are compared. Comparing free-running
    sequences instead would count every position after a first divergence as a miss although
    the two then continue different texts; `first_divergence` gives that position per prompt."""
    ref_tokens, fp8_tokens = greedy_tokens(reference, prompts, steps), greedy_tokens(fp8, prompts, steps)
    same = total = 0
    for prompt, continuation in zip(prompts, ref_tokens):
        ids = reference.encode(prompt) if isinstance(prompt, str) else list(prompt)
        forced = continuation if len(continuation) < steps else continuation[:-1]
        a = forced_logits(reference, ids, forced).argmax(axis=1)
        b = forced_logits(fp8, ids, forced).argmax(axis=1)
        same += int((a == b).sum())
        total += len(a)
    first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
             for a, b in zip(ref_tokens, fp8_tokens)]
    return {"token_match": same / total, "tokens_compared": total, "first_divergence": first,
            "reference_tokens": ref_tokens, "fp8_tokens": fp8_tokens}


def passage_logits(generator, tokens: list[int], chunk: int = SCORE_CHUNK) -> np.ndarray:
    """float32 [len(tokens), vocab]: the logits after each token of the passage (one sequence,
    fed `chunk` tokens a step through batch_prefill with every position scored)."""
    import tvm

    session = fresh_session(generator, len(tokens))
    session.add_sequence(0)
    rows = []
    try:
        for begin in range(0, len(tokens), chunk):
            piece = tokens[begin:begin + chunk]
            positions = tvm.runtime.tensor(np.arange(len(piece), dtype=np.int32), device=session.device)
            if len(piece) == 1:
                rows.append(session.forward("batch_decode", [0], [1], session.embed(piece)[None])[0])
            else:
                rows.append(session.forward("batch_prefill", [0], [len(piece)], session.embed(piece)[None],
                                            positions)[0])
    finally:
        session.remove_sequence(0)
    return np.concatenate(rows)


def perplexity(logits: np.ndarray, tokens: list[int]) -> float:
    """exp(mean negative log-likelihood of tokens[1:] under logits[:-1]) in float64."""
    z = logits[:-1].astype(np.float64)
    z = z - z.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return float(np.exp(-logp[np.arange(len(tokens) - 1), tokens[1:]].mean()))


def compare(reference, fp8, passage_tokens: int | None = None) -> dict:
    """The figures: token match (token_match: teacher-forced greedy agreement over PROMPTS' 64
    tokens), passage logits' relative error (whole: ||d|| / ||ref||; worst position),
    perplexities."""
    matched = token_match(reference, fp8)
    text = PASSAGE.read_text()
    tokens = reference.encode(text, chat=False)
    if passage_tokens:
        tokens = tokens[:passage_tokens]
    ref_logits, fp8_logits = passage_logits(reference, tokens), passage_logits(fp8, tokens)
    diff = fp8_logits.astype(np.float64) - ref_logits
    per_row = np.linalg.norm(diff, axis=1) / np.linalg.norm(ref_logits.astype(np.float64), axis=1)
    ppl_ref, ppl_fp8 = perplexity(ref_logits, tokens), perplexity(fp8_logits, tokens)
    return {**matched, "passage_tokens": len(tokens),
            "logits_rel_error": float(np.linalg.norm(diff) / np.linalg.norm(ref_logits)),
            "logits_rel_error_worst_position": float(per_row.max()),
            "perplexity_reference": ppl_ref, "perplexity_fp8": ppl_fp8,
            "perplexity_rel_change": abs(ppl_fp8 - ppl_ref) / ppl_ref}


if __name__ == "__main__":
    import json
    import sys

    from tvmattn.calibrate import calibrate_kv_scales
    from tvmattn.generate import Generator

    reference, fp8 = Generator(sys.argv[1]), Generator(sys.argv[2])
    results = {"scale-1.0": compare(reference, fp8)}
    fp8.kv_scales = calibrate_kv_scales(reference, PROMPTS, fp8.metadata["kv_cache"]["kv_dtype"], headroom=4.0)
    results["calibrated"] = compare(reference, fp8)
    for name, figures in results.items():
        print(name, json.dumps({k: v for k, v in figures.items() if not k.endswith("_tokens") or k == "passage_tokens"}))
