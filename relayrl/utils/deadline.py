"""Deadlines: every wait of a run has a named setting, and one that expires stops the run with one line.

``Stalled`` is that line: what waited, for whom, for how long, and the setting to change. The
executor stops the rollout on it at once (it is not one failed episode among many) and
``relayrl train`` prints it without a traceback. ``docs/reliability.md`` lists every deadline.
"""

from __future__ import annotations


class Stalled(RuntimeError):
    """A wait passed its deadline and the run cannot go on; the message says what waited for whom
    and which setting gives it longer."""
