"""Whether a timing can be trusted: other processes busy while it ran, its repeated rounds disagreeing, or costs that
cannot be right. Calibration (inference.calibrate) measures again, then keeps nothing, when one is doubtful."""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path

from .tree_size import PassCost

# A measurement is doubtful when other processes kept more than this share of a core busy while it ran, or when the
# medians of its odd and even rounds differ by more than DISAGREEMENT for a one-token pass or the widest one
BUSY_ELSEWHERE = 0.25
DISAGREEMENT = 0.15
# A step's own work (the loop's Python, besides its pass and levels) takes a few milliseconds whatever the model: at
# three one-token passes or more and past MOST_STEP_SECONDS it is noise; on a tiny model it is simply what it costs
MOST_STEP_COST, MOST_STEP_SECONDS = 3.0, 0.01


@dataclass
class Measurement:
    """A calibration's costs, the seconds of its one-token pass, and how far the medians of its odd and even rounds
    disagree (relatively; the larger of its narrowest and widest pass)."""

    cost: PassCost
    one_pass: float
    disagreement: float


def doubt_about(measured: Measurement, drafts: bool, busy: float) -> str | None:
    """Why `measured` cannot be trusted, or None: other processes busy meanwhile, its rounds disagreeing, or a cost
    that cannot be right."""
    cost = measured.cost
    if busy > BUSY_ELSEWHERE:
        return f"other processes kept {busy:.2f} of a core busy meanwhile"
    if measured.disagreement > DISAGREEMENT:
        return f"its rounds disagreed by {measured.disagreement:.0%}"
    if drafts and cost.draft_level <= 0:
        return "a draft level measured as free"
    if drafts and cost.draft_step >= MOST_STEP_COST and cost.draft_step * measured.one_pass > MOST_STEP_SECONDS:
        return f"a step's own work measured at {cost.draft_step:.1f} one-token passes"
    return None


def busy_elsewhere_since():
    """A function giving the share of a core that other processes (and the hypervisor, as stolen time) kept busy
    since this call, where /proc/stat tells (elsewhere 0)."""
    start, started = _cpu_seconds(), time.perf_counter()
    if start is None:
        return lambda: 0.0

    def share() -> float:
        end = _cpu_seconds()
        others = (end[0] - start[0]) - (end[1] - start[1])
        return max(others, 0.0) / max(time.perf_counter() - started, 1e-9)

    return share


def _cpu_seconds() -> tuple[float, float] | None:
    """(seconds all cores spent busy or stolen, seconds this process spent) so far."""
    try:
        fields = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    own = resource.getrusage(resource.RUSAGE_SELF)
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK"), own.ru_utime + own.ru_stime
