"""Token types: a coarse lexical class for every vocabulary id, one of the predictor's features.

Attention patterns depend on what a token is: special tokens and separators attract attention
(sinks), digits are what retrieval tasks ask for, function words rarely matter. The table is
built once per tokenizer and looked up by id at runtime (`table[token_ids]`).

Types are read from the token's text as the tokenizer's own decoder renders it, so byte-level
markers ("Ġ" for a space, "Ċ" for a newline), SentencePiece's "▁" and byte-fallback tokens
("<0x0A>") become the characters they stand for. Choice beyond the proposal's list: line breaks
are split from other whitespace, because newlines delimit lines and paragraphs and draw
attention like separators, while runs of spaces (indentation) do not. Letters without case
(CJK, Devanagari, ...), superscript digits, mixed tokens ("x2", "'s") and undecodable byte fragments are "other".
"""

import torch

TOKEN_TYPES = ("special", "numeric", "punctuation", "capitalised", "lowercase", "whitespace", "newline", "other")
_INDEX = {name: i for i, name in enumerate(TOKEN_TYPES)}


def token_type_table(tokenizer, vocab_size: int | None = None) -> torch.Tensor:
    """The type index (into `TOKEN_TYPES`) of every id, `[max(len(tokenizer), vocab_size)]` int8.

    `vocab_size` covers models whose embedding has more rows than the tokenizer has tokens
    (padded vocabularies); ids without a token are "other".
    """
    size = max(len(tokenizer), vocab_size or 0)
    special = set(tokenizer.all_special_ids)
    special.update(i for i, added in tokenizer.added_tokens_decoder.items() if added.special)
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = backend.decoder if backend is not None else None
    types = [_INDEX["other"]] * size
    for i, piece in enumerate(pieces):
        if i in special:
            types[i] = _INDEX["special"]
        elif piece is not None:
            text = decoder.decode([piece]) if decoder is not None else tokenizer.convert_tokens_to_string([piece])
            # A Metaspace decoder drops the leading space of a lone "▁": read the marker instead.
            types[i] = _INDEX[_classify(text or piece.replace("▁", " "))]
    return torch.tensor(types, dtype=torch.int8)


def _classify(text: str) -> str:
    stripped = text.strip()
    if not text or "\ufffd" in text:
        return "other"
    if not stripped:
        return "newline" if "\n" in text or "\r" in text else "whitespace"
    if stripped.isdecimal():  # digits, not superscripts ("²") or circled numbers
        return "numeric"
    if not any(c.isalnum() for c in stripped):
        return "punctuation"
    if stripped.isalpha() and stripped[0].isupper():
        return "capitalised"
    if stripped.isalpha() and stripped[0].islower():
        return "lowercase"
    return "other"
