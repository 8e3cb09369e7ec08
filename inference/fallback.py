"""Fall back to plain decoding while drafting does not pay on this sequence, and probe it again now and then.

A drafted step verifies several tokens and may accept several; a plain step verifies one and commits one.
Which is faster depends on the hardware, the dtype and how often this head is right on this text, so the
loop measures it: the wall time of whole steps (draft, verify, accept, observe) and the tokens each one
committed (not the first drafted step after a hold, which also feeds the drafter what the hold committed, nor the
step after a prompt joins, which hands the drafter that prompt).
`price` plain steps early on price plain decoding (one for a single sequence, whose call is short; a batch
takes two, as a step's time is noisy and the batch runs long). While the recent drafted steps (at least `judge`
of them: acceptance comes in bursts, and a few unlucky steps say little, unless they lose clearly) commit fewer
tokens per second than plain steps, the loop decodes plainly for `hold` steps (four times longer each time drafting
loses again, up to `max_hold`), then drafts to look again.

A look after a hold is a probe, and probes are what a losing drafter costs (a drafter slower than plain decoding
spends nearly all its drafted steps in probes). So drafting that loses by more than `PROBE_MARGIN` after `PROBE`
timed steps stops there, the first look as a probe (plain decoding is priced after `PROBE` drafted steps for that);
a hold is at least long enough that the next probe, priced at the loss measured last (the plain steps its drafted
steps cost more than the tokens they committed), costs at most `PROBE_SHARE` of the hold's tokens; and a call
whose drafter was losing when its last call ended (`last_ratio`: its drafted steps' tokens per second over plain
steps', kept per heads by the caller) starts with such a hold: it prices plain decoding first, then probes.
"""

from __future__ import annotations

import math
from collections import deque

JUDGE = 8  # drafted steps timed before drafting is judged (a batch's step counts for each of its rows)
PROBE = 3  # a probe is judged after this many timed steps already when it loses clearly:
PROBE_MARGIN = 0.8  # ... at under this share of plain decoding's tokens per second
PROBE_SHARE = 0.05  # a hold lasts long enough that the next probe, priced at the last one's loss, costs at most this


class Fallback:
    def __init__(
        self,
        enabled: bool = True,
        window: int = 16,
        judge: int = JUDGE,
        hold: int = 8,
        max_hold: int = 64,
        price: int = 1,
        last_ratio: float | None = None,
    ):
        self.enabled, self.judge, self.first_hold, self.max_hold, self.price = enabled, judge, hold, max_hold, price
        self.hold = hold
        self.drafted: deque[tuple[float, float]] = deque(maxlen=window)  # (tokens, seconds) of recent steps
        self.plain: deque[tuple[float, float]] = deque(maxlen=window)
        lost_before = last_ratio is not None and last_ratio < 1
        self.plain_left = self.hold_for(last_ratio) if lost_before else 0  # plain steps to take before drafting again
        self.ratio: float | None = None  # the last judgement: drafted steps' tokens per second over plain steps'
        self.lost = False  # whether the last judgement went to plain decoding
        self.warm = False  # the first drafted step also feeds the drafter the whole prompt: not timed
        self.joined = False  # a prompt joined since the last step, whose drafter work that step also did: not timed

    def use_drafter(self) -> bool:
        if not self.enabled:
            return True
        if self.plain_left == 0 and len(self.plain) < self.price and len(self.drafted) >= min(PROBE, self.judge):
            self.plain_left = self.price - len(self.plain)  # price plain decoding
        return self.plain_left == 0

    def prompt_joined(self) -> None:
        """A prompt joined the batch: the next step, plain or drafted, also hands the drafter that prompt's hidden
        states, and the next drafted step feeds the drafter that whole prompt, so neither is timed (a plain step
        timed there made plain decoding look three times slower than it was, for a whole call: experiments X31)."""
        self.warm, self.joined = False, True

    def record(self, drafted: bool, tokens: float, seconds: float) -> None:
        if not self.enabled:
            return
        if not drafted:
            self.plain_left = max(self.plain_left - 1, 0)
        untimed = self.joined or (drafted and not self.warm)
        self.joined, self.warm = False, self.warm or drafted
        if untimed:
            return
        (self.drafted if drafted else self.plain).append((tokens, seconds))
        if len(self.plain) < self.price:
            return
        clearly_losing = len(self.drafted) >= PROBE and rate(self.drafted) < PROBE_MARGIN * rate(self.plain)
        if len(self.drafted) < self.judge and not clearly_losing:
            return
        self.ratio = rate(self.drafted) / max(rate(self.plain), 1e-12)
        self.lost = self.ratio < 1
        if self.lost:
            self.plain_left = max(self.hold, self.hold_for(self.ratio, tokens_per_step(self.drafted)))
            self.hold = min(4 * self.hold, self.max_hold)
            self.drafted.clear()  # after the hold, drafting is judged afresh
            # and its first step is not timed: it also feeds the drafter what the hold committed, a cost of
            # switching that grows with the hold; timing it would hold off drafting longer each time
            self.warm = False
        else:
            self.hold = self.first_hold

    def hold_for(self, ratio: float, tokens: float = 1.0) -> int:
        """Plain steps after which a probe (PROBE timed steps and an untimed one), whose drafted steps commit `tokens`
        each at `ratio` of plain decoding's tokens per second, costs at most PROBE_SHARE of them: such a step takes
        tokens / ratio plain steps' time for its tokens."""
        loss = (PROBE + 1) * tokens * (1 / max(ratio, 1e-3) - 1)
        return min(self.max_hold, math.ceil(loss / PROBE_SHARE))


def tokens_per_step(steps) -> float:
    return sum(t for t, _ in steps) / max(len(steps), 1)


def rate(steps) -> float:
    """Tokens per second over `steps` of (tokens, seconds)."""
    return sum(t for t, _ in steps) / max(sum(s for _, s in steps), 1e-12)
