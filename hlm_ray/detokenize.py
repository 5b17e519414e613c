"""Token ids back to text, a few tokens at a time: incremental decoding for streaming, the
string of each token and where it starts in the text (for OpenAI's `logprobs`). No Ray.

    text = IncrementalText(decode)           # decode: list[int] -> str, skipping special tokens
    for token in ids:
        print(text.push(token), end="")      # only text that can no longer change
    print(text.flush())                      # the rest; text.text == decode(ids)
    token_strings(tokenizer, ids)            # [" The", " cat", "bytes:\\xe6\\x9d", ...]
    text_offsets(decode, ids)                # where each token's text starts in decode(ids)

Incremental decoding follows Hugging Face's `TextStreamer` and text-generation-inference: each
step decodes only the tokens since the last emitted piece plus the piece before it (a few tokens:
the held-back window), and emits the difference once it no longer ends in a partial character
(U+FFFD). Decoding the window with its left context keeps merges that depend on the previous
token (SentencePiece's leading space) right; for byte-level BPE the pieces concatenate to
exactly the full decode.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cache

REPLACEMENT = "\ufffd"  # what a partial UTF-8 character decodes to


class IncrementalText:
    """One sequence's text, decoded as its tokens arrive."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.ids: list[int] = []
        self.text = ""
        """The text emitted so far (ends on a whole character)."""
        # ids[prefix:read] is the last emitted piece (the left context of the next decode);
        # ids[read:] is not emitted yet.
        self._prefix = 0
        self._read = 0

    def push(self, token: int) -> str:
        """Add a token; returns the text it completes ("" while a character is partial)."""
        self.ids.append(token)
        context = self.decode(self.ids[self._prefix : self._read])
        window = self.decode(self.ids[self._prefix :])
        if len(window) <= len(context) or window.endswith(REPLACEMENT):
            return ""
        piece = window[len(context) :]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += piece
        return piece

    def flush(self) -> str:
        """The text of the tokens not emitted yet, as a full decode gives it (a partial
        character at the very end decodes to U+FFFD, as it does in `decode(ids)`)."""
        context = self.decode(self.ids[self._prefix : self._read])
        piece = self.decode(self.ids[self._prefix :])[len(context) :]
        self._prefix = self._read = len(self.ids)
        self.text += piece
        return piece


def text_offsets(decode: Callable[[list[int]], str], ids: Sequence[int]) -> tuple[list[int], str]:
    """Where each token's text starts in the decoded text (a token that begins inside a
    character counts from that character's start), and that text."""
    text = IncrementalText(decode)
    offsets = []
    for token in ids:
        offsets.append(len(text.text))
        text.push(token)
    text.flush()
    return offsets, text.text


def is_byte_level(tokenizer) -> bool:
    """Whether the tokenizer's decoder is byte-level BPE (GPT-2's, ours)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return type(getattr(backend, "decoder", None)).__name__ == "ByteLevel"


@cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the byte each printable character stands for
    (printable Latin-1 bytes stand for themselves, the other 68 for chr(256), chr(257), ...)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    kept += range(ord("®"), ord("ÿ") + 1)
    others = [b for b in range(256) if b not in kept]
    table = {chr(b): b for b in kept}
    table.update({chr(256 + n): b for n, b in enumerate(others)})
    return table


def token_strings(tokenizer, ids: Sequence[int]) -> list[str]:
    """Each token as text, as OpenAI's `logprobs.tokens` show it: " cat", "<|endoftext|>" for a
    special token, and "bytes:\\xe6\\x9d" for a token that is only part of a UTF-8 character.
    Non-byte-level tokenizers give `decode([id])`."""
    if not is_byte_level(tokenizer):
        return [tokenizer.decode([i], clean_up_tokenization_spaces=False) for i in ids]
    table = _byte_decoder()
    out = []
    for piece in tokenizer.convert_ids_to_tokens(list(ids)):
        if piece is None or any(c not in table for c in piece):
            out.append(piece or "")  # an added or special token: its own content
            continue
        raw = bytes(table[c] for c in piece)
        try:
            out.append(raw.decode("utf-8"))
        except UnicodeDecodeError:
            out.append("bytes:" + "".join(f"\\x{b:02x}" for b in raw))
    return out
