"""Prompts for a trace's rows: one deterministic text block per hash_id, so the trace's prefix sharing reaches
the server's prefix cache as it did in production.

How (as AIPerf's `mooncake_trace` loader and the Dynamo data generator synthesise them): a hash_id is a
block of `block_tokens` tokens; its text is drawn from a word list with a generator seeded by the id alone, so
equal ids give byte-identical text in every row, process and run, and two rows that share leading ids share
a token prefix. The last block is cut to the row's remainder (input_length - (n - 1) x block_tokens), a prefix
of the same id's full text. Every block starts with a space and ends in a word, so the words tokenize the same
alone as inside the prompt (a BPE pre-tokenizer splits before each space; the sim's tokenizer too).

Sized through the server's own tokenizer (`/tokenize` with `prompt`, which vLLM and the sim serve), in a
bounded number of calls whatever the trace's size: the tokens per word are measured on CALIBRATE_BLOCKS
blocks, then VERIFY_BLOCKS other blocks are counted and the spread of their tokens is kept as evidence
(`TokenFit`). Without a tokenizer the sizing assumes one token per word (an estimate, and said so).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

# Short, common English words (6 letters at most): one token each with their leading space in BPE vocabularies
# and in the sim's.
WORDS = tuple(w for w in (
    "the of and to in is it you that he was for on are as with his they at be this have from or one had by "
    "word but not what all were we when your can said there use an each which she do how their if will up "
    "other about out many then them these so some her would make like him into time has look two more write "
    "go see number no way could people my than first water been call who oil its now find long down day did "
    "get come made may part over new sound take only little work know place year live me back give most very "
    "after thing our just name good man think say great where help through much before line right too mean "
    "old any same tell boy follow came want show also around form three small set put end does another well "
    "large must big even such because turn here why ask went men read need land different home us move try "
    "kind hand picture again change off play spell air away animal house point page letter mother answer "
    "found study still learn should world high every near add food between own below country plant last "
    "school father keep tree never start city earth eye light thought head under story saw left few while "
    "along might close seem next hard open example begin life always those both paper together got group "
    "often run important until children side feet car mile night walk white sea began grow took river four "
    "carry state once book hear stop without second later miss idea enough eat face watch far really almost"
).split() if len(w) <= 6)
CALIBRATE_BLOCKS = 3  # /tokenize calls that measure the tokens per word
VERIFY_BLOCKS = 8  # /tokenize calls that check the sizing on other blocks
CACHE_BLOCKS = 4096  # block texts kept (a long trace's shared heads are reused many times)


@dataclass
class TokenFit:
    """How the blocks were sized: `tokenizer` "server /tokenize" or "estimate (1 token a word)", the measured
    tokens per word, and the token counts of the verified blocks (each meant to be `block_tokens`)."""

    tokenizer: str
    tokens_per_word: float
    block_tokens: int
    verified_tokens: list[int] = field(default_factory=list)
    calls: int = 0

    def as_dict(self) -> dict[str, object]:
        checked = self.verified_tokens
        return {"tokenizer": self.tokenizer, "tokens_per_word": round(self.tokens_per_word, 4),
                "block_tokens": self.block_tokens, "blocks_verified": len(checked),
                "verified_tokens_min": min(checked, default=None), "verified_tokens_max": max(checked, default=None),
                "tokenize_calls": self.calls}


def block_words(hash_id: int, count: int) -> list[str]:
    """The first `count` words of block `hash_id`'s text: the same for the same id, whatever `count`."""
    rng = random.Random(f"k3load-trace-block:{hash_id}")
    return [rng.choice(WORDS) for _ in range(count)]


def words_text(words: list[str]) -> str:
    return "".join(" " + w for w in words)


class BlockTexts:
    """The text of each block, sized to `block_tokens` tokens of the server's tokenizer (`count`: text ->
    tokens, raising OSError or ValueError when the server cannot say; None: estimated)."""

    def __init__(self, block_tokens: int, count: Callable[[str], int] | None = None,
                 sample_ids: list[int] | None = None) -> None:
        self.block_tokens = block_tokens
        self._cache: OrderedDict[tuple[int, int], str] = OrderedDict()
        self.fit = self._calibrate(count, sample_ids or list(range(CALIBRATE_BLOCKS + VERIFY_BLOCKS)))

    def _calibrate(self, count: Callable[[str], int] | None, sample_ids: list[int]) -> TokenFit:
        estimate = TokenFit("estimate (1 token a word)", 1.0, self.block_tokens)
        if count is None:
            return estimate
        ids = sample_ids[: CALIBRATE_BLOCKS + VERIFY_BLOCKS]
        try:
            measured = [(len(w), count(words_text(w))) for w in (block_words(i, self.block_tokens)
                                                               for i in ids[:CALIBRATE_BLOCKS])]
        except (OSError, ValueError):
            return estimate
        per_word = sum(t for _, t in measured) / max(sum(n for n, _ in measured), 1)
        fit = TokenFit("server /tokenize", per_word if per_word > 0 else 1.0, self.block_tokens,
                       calls=len(measured))
        for hash_id in ids[CALIBRATE_BLOCKS:]:
            try:
                fit.verified_tokens.append(count(self.text(hash_id, fit=fit)))
                fit.calls += 1
            except (OSError, ValueError):
                break
        return fit

    def words_for(self, tokens: int, fit: TokenFit | None = None) -> int:
        per_word = (fit or self.fit).tokens_per_word
        return max(1, round(tokens / per_word))

    def text(self, hash_id: int, tokens: int | None = None, fit: TokenFit | None = None) -> str:
        """Block `hash_id`'s text of `tokens` tokens (default: a whole block)."""
        words = self.words_for(self.block_tokens if tokens is None else tokens, fit)
        key = (hash_id, words)
        found = self._cache.get(key)
        if found is None:
            found = self._cache[key] = words_text(block_words(hash_id, words))
            if len(self._cache) > CACHE_BLOCKS:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return found

    def forget(self) -> None:
        """The texts let go (their stage ended); asked again, they are made again, the same."""
        self._cache.clear()

    def __len__(self) -> int:
        return len(self._cache)

    def prompt(self, hash_ids: tuple[int, ...], input_tokens: int) -> str:
        """The prompt of a row of `input_tokens` tokens over `hash_ids` (a row cut to fit the server's context
        keeps its leading blocks, the last one cut)."""
        parts, left = [], input_tokens
        for hash_id in hash_ids:
            if left <= 0:
                break
            parts.append(self.text(hash_id, min(left, self.block_tokens)))
            left -= self.block_tokens
        return "".join(parts)
