"""Isolation for model-written code (``rollout.tool=python``).

:func:`sandbox_command` wraps a command so that it runs

- in new mount and network namespaces (``unshare``): no network interface but a downed
  loopback, so no socket reaches anything;
- on a filesystem where every mount is read-only, ``/root`` and ``/home`` are hidden
  (empty), and the only writable place is a fresh 16 MiB scratch directory (the cwd, on a
  private ``/tmp``) that disappears with the child;
- as user ``nobody`` with no capabilities and ``no_new_privs`` (``setpriv``), so nothing
  can be remounted, and with the empty environment the caller passes.

The child then sets its own resource limits (see :mod:`relayrl.rollout.tools`). Building
this needs root (in CI and most containers the trainer is root); elsewhere
:func:`sandbox_unavailable` says why and the tool refuses to run rather than running
unisolated. The first use checks that the isolation holds (no environment, no network,
nothing writable outside the scratch directory) and refuses if it does not.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys

# Runs as root inside the new namespaces; $1 = the Python prefix to keep visible, the rest = the command.
_SETUP = r"""
set -e
prefix="$1"; shift
for m in $(awk '{print $5}' /proc/self/mountinfo | sort -u); do
  [ "$m" = / ] || mount -o remount,bind,ro "$m" 2>/dev/null || true
done
mount -o remount,bind,ro /
mount -t tmpfs -o mode=0755,size=16m,nosuid,nodev tmpfs /tmp
mkdir /tmp/.py /tmp/work
mount --bind "$prefix" /tmp/.py
for d in /root /home; do
  [ -d "$d" ] || continue
  mount -t tmpfs -o mode=0755,size=1m,nosuid,nodev tmpfs "$d"
  case "$prefix/" in "$d"/*)
    mkdir -p "$prefix"; mount --bind /tmp/.py "$prefix"; mount -o remount,bind,ro "$prefix";;
  esac
  mount -o remount,ro "$d"
done
umount -l /tmp/.py; rmdir /tmp/.py
chown 65534:65534 /tmp/work; chmod 0700 /tmp/work; cd /tmp/work
exec setpriv --reuid=65534 --regid=65534 --clear-groups --inh-caps=-all --bounding-set=-all --no-new-privs /usr/bin/env -i "$@"
"""

# Run in the sandbox by the first use: each line is a breach that must fail.
_PROBE = r"""
import os, socket, sys
bad = []
seen = sorted(set(os.environ) - {"LC_CTYPE"})  # LC_CTYPE: set by Python itself (PEP 538)
if seen: bad.append(f"environment variables {seen} are visible")
for path in ("/", "/tmp", os.path.dirname(sys.executable), "/dev/shm", "/var/tmp"):
    try:
        open(os.path.join(path, ".relayrl-probe"), "w").close(); bad.append(f"{path} is writable")
    except OSError:
        pass
try:
    socket.create_connection(("127.0.0.1", 1), timeout=2); bad.append("a socket connected")
except OSError as e:
    if "refused" in str(e).lower(): bad.append("the loopback network is reachable")
open("scratch", "w").write("x")
print("; ".join(bad) or "ok", end="")
"""


def sandbox_command(argv: list[str]) -> list[str]:
    """``argv`` (whose first item is this Python) wrapped to run isolated; see the module doc."""
    # the real interpreter and its prefix (a venv's python is a link into it; -I -S needs only the stdlib)
    exe = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    prefix = os.path.realpath(sys.base_prefix)
    unshare = shutil.which("unshare") or "unshare"
    namespaces = ["--mount", "--net", "--pid", "--fork", "--kill-child", "--mount-proc", "--propagation", "private"]
    return [unshare, *namespaces, "--", "/bin/sh", "-c", _SETUP, "sandbox", prefix, exe, *argv[1:]]


@functools.cache
def sandbox_unavailable() -> str | None:
    """None when the sandbox can be built and holds on this machine; else why not (one sentence)."""
    if sys.platform != "linux":
        return f"isolating model-written code needs Linux namespaces, this is {sys.platform}"
    if os.geteuid() != 0:
        return (
            "isolating model-written code needs root (network and mount namespaces, then dropping to "
            "user nobody); run the trainer as root, e.g. in a container, or use rollout.tool=calc"
        )
    missing = [t for t in ("unshare", "setpriv", "mount") if shutil.which(t) is None]
    if missing:
        return f"isolating model-written code needs util-linux's {', '.join(missing)} (not found on PATH)"
    try:
        r = subprocess.run(
            sandbox_command([sys.executable, "-I", "-S", "-c", _PROBE]),
            capture_output=True,
            text=True,
            env={},
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"the isolation check could not run ({e})"
    if r.returncode != 0 or r.stdout != "ok":
        why = r.stdout.strip() or (r.stderr.strip().splitlines() or [f"exit code {r.returncode}"])[-1]
        return f"the isolation check failed: {why[:300]}"
    return None
