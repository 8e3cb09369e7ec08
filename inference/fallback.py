"""Fall back to plain decoding while drafting does not pay on this sequence, and probe it again now and then.

A drafted step verifies several tokens and may accept several; a plain step verifies one and commits one.
Which is faster depends on the hardware, the dtype and how often this head is right on this text, so the
loop measures it: the wall time of whole steps (draft, verify, accept, observe) and the tokens each one
committed (not the first drafted step after a hold, which also feeds the drafter what the hold committed).
`price` plain steps early on price plain decoding (one for a single sequence, whose call is short; a batch
takes two, as a step's time is noisy and the batch runs long). While the recent drafted steps (at least `judge`
of them: acceptance comes in bursts, and a few unlucky steps say little) commit fewer tokens per second than
plain steps, the loop decodes plainly for `hold` steps (doubling each time drafting loses again, up to
`max_hold`), then drafts `judge` steps to look again.
"""

from __future__ import annotations

from collections import deque

JUDGE = 8  # drafted steps timed before drafting is judged (a batch's step counts for each of its rows)


class Fallback:
    def __init__(
        self,
        enabled: bool = True,
        window: int = 16,
        judge: int = JUDGE,
        hold: int = 8,
        max_hold: int = 64,
        price: int = 1,
    ):
        self.enabled, self.judge, self.first_hold, self.max_hold, self.price = enabled, judge, hold, max_hold, price
        self.hold = hold
        self.drafted: deque[tuple[float, float]] = deque(maxlen=window)  # (tokens, seconds) of recent steps
        self.plain: deque[tuple[float, float]] = deque(maxlen=window)
        self.plain_left = 0  # plain steps still to take before drafting again
        self.warm = False  # the first drafted step also feeds the drafter the whole prompt: not timed

    def use_drafter(self) -> bool:
        if not self.enabled:
            return True
        if self.plain_left == 0 and len(self.plain) < self.price and len(self.drafted) >= self.judge:
            self.plain_left = self.price - len(self.plain)  # price plain decoding
        return self.plain_left == 0

    def prompt_joined(self) -> None:
        """A prompt joined the batch: the next drafted step also feeds the drafter that whole prompt, so it is not
        timed."""
        self.warm = False

    def record(self, drafted: bool, tokens: float, seconds: float) -> None:
        if not self.enabled:
            return
        if not drafted:
            self.plain.append((tokens, seconds))
            self.plain_left = max(self.plain_left - 1, 0)
        elif not self.warm:
            self.warm = True
            return
        else:
            self.drafted.append((tokens, seconds))
        if len(self.plain) < self.price or len(self.drafted) < self.judge:
            return
        if rate(self.drafted) < rate(self.plain):
            self.plain_left, self.hold = self.hold, min(2 * self.hold, self.max_hold)
            self.drafted.clear()  # after the hold, drafting is judged afresh
            # and its first step is not timed: it also feeds the drafter what the hold committed, a cost of
            # switching that grows with the hold; timing it would hold off drafting longer each time
            self.warm = False
        else:
            self.hold = self.first_hold


def rate(steps) -> float:
    """Tokens per second over `steps` of (tokens, seconds)."""
    return sum(t for t, _ in steps) / max(sum(s for _, s in steps), 1e-12)
