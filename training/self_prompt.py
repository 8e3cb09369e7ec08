"""Self-prompting (the Magpie method, Xu et al. 2024): the target writes the user requests it then answers.

Given its chat template up to where a user's words go (after the template's own system prompt, when it has one),
a chat model samples a plausible user request and closes the turn itself. No dataset is needed, and the requests
are the open-ended kind that narrow prompt files lack. Sampled requests are filtered here (empty, too short, too
long, special tokens inside, exact and near-duplicate repeats); training/distill.py answers them greedily and lets
the target write a second user turn after its own answer the same way.
"""

from __future__ import annotations

import re
from collections import defaultdict

from .config import ConfigError

# Sampling settings of the requests (not of the answers, which are greedy): Magpie samples at temperature 1; a top-p
# below 1 trims the rare tokens that derail a 135M model's requests into noise.
TEMPERATURE = 1.0
TOP_P = 0.95
MIN_WORDS = 3  # "Hi there" is not a request worth an answer
NEAR_DUPLICATE = (
    0.7  # word-bigram Jaccard similarity from which a request repeats an earlier one (one word in 12 changed: 0.72)
)
SENTINEL = "SPECHEADS_USER_TURN_SENTINEL"


def user_turn(tokenizer, history: list[dict]) -> tuple[str, int]:
    """(the template's text up to a user's words after `history`, the token that closes a user turn)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            "self-prompting needs a chat model: its tokenizer has no chat template, so there is no user turn for the "
            "target to write; distill from a prompt file instead (--self_prompts 0)"
        )
    text = tokenizer.apply_chat_template(history + [{"role": "user", "content": SENTINEL}], tokenize=False)
    if text.count(SENTINEL) != 1:
        raise ConfigError(
            "the chat template does not show a user message's text once; self-prompting cannot find where a request "
            "goes"
        )
    opening, closing = text.split(SENTINEL)
    marker = closing.strip().split()[0] if closing.strip() else ""
    close_id = tokenizer.convert_tokens_to_ids(marker) if marker in tokenizer.all_special_tokens else None
    if close_id is None:
        raise ConfigError(
            f"the chat template closes a user turn with {closing!r}, which does not start with a special token; "
            "self-prompting needs the target to end its request with one"
        )
    return opening, close_id


def request_text(tokenizer, row: list[int], close_id: int) -> str | None:
    """A sampled user turn's text, or None when the target did not close the turn (it ran too long) or wrote a special
    token inside it (another turn's markup)."""
    if close_id not in row:
        return None
    words = row[: row.index(close_id)]
    if set(words) & set(tokenizer.all_special_ids):
        return None
    return tokenizer.decode(words).strip()


def normalized_words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


class RequestFilter:
    """Keeps requests that are long enough and repeat no earlier request, exactly or nearly (word bigrams: requests are
    short, and one changed word breaks three trigrams of a dozen).

    Candidates for a near repeat are found through bigrams that few requests share: two near duplicates share most
    bigrams, rare ones included, and a bigram as common as "how do" would make every lookup scan thousands."""

    def __init__(self, min_words: int = MIN_WORDS, threshold: float = NEAR_DUPLICATE, common: int = 200):
        self.min_words, self.threshold, self.common = min_words, threshold, common
        self.shingles: list[set] = []
        self.holders: dict[tuple, list[int]] = defaultdict(list)
        self.exact: set[str] = set()

    @staticmethod
    def bigrams(words: list[str]) -> set:
        return {tuple(words[i : i + 2]) for i in range(max(1, len(words) - 1))}

    def reason(self, text: str | None) -> str | None:
        """Why `text` is refused ('unfinished', 'too short', 'repeat', 'near repeat'), or None to keep it."""
        if text is None:
            return "unfinished"
        words = normalized_words(text)
        if len(words) < self.min_words:
            return "too short"
        if " ".join(words) in self.exact:
            return "repeat"
        mine = self.bigrams(words)
        candidates = {n for b in mine if len(self.holders.get(b, ())) <= self.common for n in self.holders.get(b, ())}
        if any(len(mine & self.shingles[n]) >= self.threshold * len(mine | self.shingles[n]) for n in candidates):
            return "near repeat"
        return None

    def add(self, text: str) -> None:
        words = normalized_words(text)
        self.exact.add(" ".join(words))
        self.shingles.append(self.bigrams(words))
        for b in self.shingles[-1]:
            self.holders[b].append(len(self.shingles) - 1)
