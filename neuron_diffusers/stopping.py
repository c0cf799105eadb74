"""Leave soon after a SIGTERM even when the main thread is stuck in a collective with a peer that is gone.

torchrun SIGTERMs the ranks left when one dies, and SIGKILLs them 30 s later. The job turns SIGTERM into
`SystemExit`, so a rank leaves through Python (temporary files and the folder's lock cleaned up); but Python runs a
signal handler only between bytecodes, and a rank blocked inside one call (an NCCL or Neuron collective waiting for
the dead peer, a gloo one waiting for a hung peer) never gets there. CPython's C-level handler still writes the
signal's number to the wakeup fd at once, so a thread reading it can end the process `grace_s` after the SIGTERM if
it is still inside the context (one that got out leaves through Python, as it should). What that skips is safe to
skip: outputs are written atomically, a restart or rerun removes temporary files, and the kernel releases the
folder's lock with the process.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable

#: Seconds a process may take to leave by itself after SIGTERM before it is ended.
GRACE_S = 5.0


class ExitWhenStuck:
    """A context (main thread only, as `signal.set_wakeup_fd`): a SIGTERM that comes inside it ends the process
    `grace_s` later unless the context has been left by then (by the `SystemExit` the job's handler raises, say)."""

    def __init__(self, grace_s: float = GRACE_S, exit_process: Callable[[int], None] = os._exit):
        self.grace_s, self.exit_process = grace_s, exit_process
        self.terminated = threading.Event()
        self._left = threading.Event()
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._thread = threading.Thread(target=self._watch, name="exit-when-stuck", daemon=True)

    def __enter__(self) -> ExitWhenStuck:
        self._previous = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        signal.set_wakeup_fd(self._previous)
        self._left.set()
        os.write(self._write, b"\0")  # wakes the watch if no signal came
        self._thread.join()
        os.close(self._read)
        os.close(self._write)

    def _watch(self) -> None:
        while signal.SIGTERM not in (data := os.read(self._read, 64)):
            if 0 in data:
                return
        self.terminated.set()
        if self._left.wait(self.grace_s):
            return
        print(f"neuron-diffusers: still running {self.grace_s:g} s after SIGTERM (blocked in a collective with a "
              "peer that is gone?): ending now", file=sys.stderr, flush=True)
        self.exit_process(128 + signal.SIGTERM)
