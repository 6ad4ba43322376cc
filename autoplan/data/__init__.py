"""A small character-level corpus that ships with Python: no downloads.

The text is CPython's own documentation of the language (``pydoc_data.topics``: about 465,000
characters, the reference pages ``help("if")`` shows), joined in sorted topic order, so it is
the same on every machine with the same Python. Characters outside printable ASCII are mapped
to ``?`` to keep the vocabulary small (96 symbols).

Guarantees: `load_corpus` is deterministic; `CharCorpus.encode`/`decode` round-trip the text;
`CharCorpus.batch` draws the same (inputs, targets) windows for the same generator state on
every rank, targets being the inputs shifted by one character; `Batches.config` names what
makes its stream (a resumed job compares it with the checkpoint's).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Batches", "CharCorpus", "load_corpus"]

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


class Batches:
    """The corpus's random windows as an endless iterator with a position: the same batches on
    every rank (one seeded generator), and a ``state_dict`` a checkpoint saves, so a resumed
    job draws exactly the batches the uninterrupted one would have."""

    def __init__(self, corpus: CharCorpus, batch_size: int, seq_len: int, seed: int = 0) -> None:
        self.corpus = corpus
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)
        self.drawn = 0  # batches drawn so far

    def __iter__(self) -> Batches:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.drawn += 1
        return self.corpus.batch(self.batch_size, self.seq_len, self.generator)

    def config(self) -> dict[str, Any]:
        """The settings that make this stream (JSON-able): another corpus, seed or sequence
        length is another stream, in which a saved position means nothing."""
        return {
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "seed": self.seed,
            "corpus": f"{len(self.corpus.text):,} characters, sha256 "
            + hashlib.sha256(self.corpus.text.encode()).hexdigest()[:16],
        }

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state(), "drawn": self.drawn}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])
        self.drawn = int(state["drawn"])


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
