"""A small character-level corpus that ships with Python: no downloads.

The text is CPython's own documentation of the language (``pydoc_data.topics``: about 465,000
characters, the reference pages ``help("if")`` shows), joined in sorted topic order, so it is
the same on every machine with the same Python. Characters outside printable ASCII are mapped
to ``?`` to keep the vocabulary small (96 symbols).

Guarantees: `load_corpus` is deterministic; `CharCorpus.encode`/`decode` round-trip the text;
`CharCorpus.batch` draws the same (inputs, targets) windows for the same generator state on
every rank, targets being the inputs shifted by one character.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["CharCorpus", "load_corpus"]

_UNKNOWN = "?"
_ALPHABET = "\n\t" + "".join(chr(c) for c in range(32, 127))  # 97 printable ASCII symbols


@dataclass(frozen=True, slots=True)
class CharCorpus:
    """Text as character ids, with a fixed alphabet."""

    text: str
    alphabet: str
    tokens: torch.Tensor  # (num_chars,) int64

    @property
    def vocab_size(self) -> int:
        return len(self.alphabet)

    def encode(self, text: str) -> torch.Tensor:
        index = {ch: i for i, ch in enumerate(self.alphabet)}
        unknown = index[_UNKNOWN]
        return torch.tensor([index.get(ch, unknown) for ch in text], dtype=torch.long)

    def decode(self, ids: torch.Tensor) -> str:
        return "".join(self.alphabet[int(i)] for i in ids.flatten())

    def batch(
        self, batch_size: int, seq_len: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Random windows: inputs (batch_size, seq_len) and next-character targets."""
        if len(self.tokens) <= seq_len + 1:
            raise ValueError(f"corpus of {len(self.tokens)} characters is too short for {seq_len}")
        starts = torch.randint(
            0, len(self.tokens) - seq_len - 1, (batch_size,), generator=generator
        )
        windows = torch.stack([self.tokens[s : s + seq_len + 1] for s in starts.tolist()])
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def load_corpus(max_chars: int | None = None) -> CharCorpus:
    """CPython's bundled language reference as a character corpus (first ``max_chars``)."""
    from pydoc_data.topics import topics  # ships with CPython

    text = "\n\n".join(topics[name] for name in sorted(topics))
    text = "".join(ch if ch in _ALPHABET else _UNKNOWN for ch in text)
    if max_chars is not None:
        text = text[:max_chars]
    alphabet = _ALPHABET
    index = {ch: i for i, ch in enumerate(alphabet)}
    tokens = torch.tensor([index[ch] for ch in text], dtype=torch.long)
    return CharCorpus(text=text, alphabet=alphabet, tokens=tokens)
