"""Placing trainer ranks and inference servers on a cluster engine (``launcher=ray``: ``ray_cluster``).

The errors live here, free of Ray imports, so ``relayrl train`` can catch them without Ray installed.
"""

from __future__ import annotations


class LaunchError(RuntimeError):
    """A launched run could not start or stopped; its message is one line, ``exit_code`` the CLI's."""

    exit_code = 2


class RayLaunchError(LaunchError):
    """The run could not start on Ray: an unreachable cluster, resources it lacks."""


class TrainerRankDied(LaunchError):
    """A trainer rank's actor died mid-run; the run's checkpoints are intact (``recover=auto`` resumes)."""

    exit_code = 1
