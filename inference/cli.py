"""Command lines end in one line that says what is wrong and what to do, not in a traceback."""

from __future__ import annotations

import contextlib
import os
import signal
import sys

# what the project raises for bad input (HeadConfigError, ConfigError and TreeError are ValueErrors), a missing
# file, or a model the engine refuses; anything else is a bug and keeps its traceback
USER_ERRORS = (ValueError, TypeError, OSError, NotImplementedError)


def run(main, prog: str, argv=None):
    """Call `main(argv)`: a user error prints `prog: error: ...` and exits 2, Ctrl-C exits 130.
    SPECHEADS_TRACEBACK=1 shows the traceback instead."""
    try:
        return main(argv)
    except KeyboardInterrupt:
        # a second Ctrl-C while the interpreter shuts down (seconds with torch loaded) would kill it by the signal
        with contextlib.suppress(ValueError):  # outside the main thread no handler can be set
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        print(f"\n{prog}: interrupted", file=sys.stderr)
        sys.exit(130)
    except USER_ERRORS as error:
        if os.environ.get("SPECHEADS_TRACEBACK"):
            raise
        print(f"{prog}: error: {error}", file=sys.stderr)
        sys.exit(2)
