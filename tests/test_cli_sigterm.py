"""SIGTERM is handled as Ctrl-C in the ctxext process only: a child forked from it (lm-eval's bootstrap Pool workers,
ended by their pool with SIGTERM) ends quietly, as under Python's default."""

from __future__ import annotations

import subprocess
import sys

CHILDREN = """
import multiprocessing, os, signal, time
from ctxext import cli
cli._HANDLER_PID = os.getpid()
signal.signal(signal.SIGTERM, cli._raise_terminated)  # as `ctxext COMMAND` installs it
with multiprocessing.get_context("fork").Pool(2) as pool:
    assert pool.map(abs, [-1, -2]) == [1, 2]
    time.sleep(0.2)
# leaving the block terminates the workers with SIGTERM
print("parent done")
"""


def test_forked_children_end_on_sigterm_without_a_traceback():
    proc = subprocess.run([sys.executable, "-c", CHILDREN], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "parent done" in proc.stdout
    assert "Terminated" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
