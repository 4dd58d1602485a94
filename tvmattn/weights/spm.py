"""SentencePiece-style vocabularies of GGUF files (`tokenizer.ggml.model` "llama": Llama-2, Gemma)
as a `tokenizers` BPE model that tokenizes as llama.cpp's SPM tokenizer does.

llama.cpp's SPM tokenizer turns spaces into U+2581, splits the text into characters and merges
neighbours again and again, always the pair whose merged text is a token with the highest score
(the leftmost of equal ones); characters that are no token become their UTF-8 bytes' <0xXX>
tokens. A BPE model whose merges are every split (a, b) of every token into two tokens, ranked by
the merged token's score, makes the same choices; byte fallback covers the rest. Control tokens
(type 3) are special added tokens and user-defined ones (type 4: runs of newlines, tabs,
spaces, HTML tags) added tokens, matched in the raw text before the merges as llama.cpp matches
them first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import tokenizers

SPACE = "\u2581"  # SentencePiece's visible space
TYPE_NORMAL, TYPE_CONTROL, TYPE_USER_DEFINED, TYPE_BYTE = 1, 3, 4, 6


def spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Every (a, b) with a + b a normal token and a, b tokens, best merged score first (ties:
    the merged token's id, then the split's position)."""
    vocab = {token: index for index, token in enumerate(tokens)}
    ranked = []
    for index, (token, kind) in enumerate(zip(tokens, types)):
        if kind != TYPE_NORMAL or len(token) < 2:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[index], index, cut, left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def spm_tokenizer(tokens: list[str], scores: list[float], types: list[int], add_space_prefix: bool,
                  bos: tuple[str, int] | None, unk: str | None) -> tokenizers.Tokenizer:
    """The `tokenizers.Tokenizer` of an SPM vocabulary (tokens, scores, token types as GGUF stores
    them); bos: (token, id) prepended by encode() with add_special_tokens (the default)."""
    import tokenizers
    from tokenizers import decoders, models, normalizers, processors

    vocab = {token: index for index, token in enumerate(tokens)}
    model = models.BPE(vocab=vocab, merges=spm_merges(tokens, scores, types), unk_token=unk,
                       byte_fallback=True, fuse_unk=True)
    tokenizer = tokenizers.Tokenizer(model)
    steps = [normalizers.Replace(" ", SPACE)]
    if add_space_prefix:
        steps.insert(0, normalizers.Prepend(SPACE))
    tokenizer.normalizer = normalizers.Sequence(steps)
    tokenizer.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
                                          + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else []))
    tokenizer.add_special_tokens([tokenizers.AddedToken(token, special=True, normalized=False)
                                  for token, kind in zip(tokens, types) if kind == TYPE_CONTROL])
    tokenizer.add_tokens([tokenizers.AddedToken(token, normalized=False)
                          for token, kind in zip(tokens, types) if kind == TYPE_USER_DEFINED])
    if bos is not None:
        token, index = bos
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{token}:0 $A:0", pair=f"{token}:0 $A:0 $B:1", special_tokens=[(token, index)])
    return tokenizer
