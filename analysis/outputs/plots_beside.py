"""The report's plots drawn in a child process while the run is judged (`k3load analyze`).

Why: the judgment is Python under one GIL, so the machine's second core has little to do but hash the
manifest's inputs; matplotlib's import (0.4 s) and the PNGs (half a second at an hour's soak) are drawn
there instead. The child is forked before the run is loaded and before any thread starts, so it shares
the imports, holds none of the run, and inherits no lock another thread held. It imports matplotlib,
waits for the plot inputs on a pipe (analysis/outputs/plot_inputs.py: plain numbers), draws them with the same
code and sends the PNG bytes back. Whatever goes wrong in it (an exception, a killed child), the
parent draws the same inputs itself: the same bytes either way. Linux only (fork), and only from a
process with one thread and no gevent patching (`forkable`); elsewhere (a Locust run judging its own
directory, a test process) the plots are drawn in the judging process.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import sys
import threading

from k3load.analysis.outputs.plot_inputs import PlotInputs


def forkable() -> bool:
    """Linux, one thread, no gevent patching: a fork copies the calling thread only, so a lock another
    thread (or gevent's hub) held would stay held in the child forever."""
    if not sys.platform.startswith("linux") or threading.active_count() > 1:
        return False
    monkey = sys.modules.get("gevent.monkey")
    return monkey is None or not monkey.is_anything_patched()


class PlotsBeside:
    """One child drawing one judgment's plots: `submit` the inputs, then `result`; `close` always."""

    def __init__(self) -> None:
        self._pid: int | None = None
        self._to: int | None = None  # inputs, parent -> child
        self._back: int | None = None  # PNGs, child -> parent
        self._inputs: PlotInputs | None = None
        if not forkable():
            return
        to_read, to_write = os.pipe()
        back_read, back_write = os.pipe()
        pid = os.fork()
        if pid == 0:
            _child(to_read, back_write, (to_write, back_read))  # never returns
        os.close(to_read)
        os.close(back_write)
        self._pid, self._to, self._back = pid, to_write, back_read

    def submit(self, inputs: PlotInputs) -> None:
        self._inputs = inputs
        if self._to is None:
            return
        fd, self._to = self._to, None
        try:
            with os.fdopen(fd, "wb") as pipe:  # closed: the child reads to the end of it
                pickle.dump(inputs, pipe, protocol=pickle.HIGHEST_PROTOCOL)
        except OSError:
            pass  # the child is gone: `result` draws them here

    def result(self) -> dict[str, bytes] | None:
        """The PNGs by name, from the child or drawn here; None when nothing was submitted."""
        pngs = None
        if self._back is not None and self._inputs is not None:
            fd, self._back = self._back, None
            with os.fdopen(fd, "rb") as pipe:
                data = pipe.read()
            try:
                pngs = pickle.loads(data) if data else None
            except Exception:  # a child cut mid-write: its bytes are not the plots
                pngs = None
            self._reap(kill=False)
        if pngs is None and self._inputs is not None:
            from k3load.analysis.outputs import plots

            pngs = plots.draw(self._inputs)
        return pngs

    def close(self) -> None:
        """Ends the child (at once when its plots were never collected: an analysis that failed)."""
        for fd in (self._to, self._back):
            if fd is not None:
                os.close(fd)
        self._to = self._back = None
        self._reap(kill=True)

    def _reap(self, kill: bool) -> None:
        if self._pid is None:
            return
        pid, self._pid = self._pid, None
        if kill:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def _child(inputs_fd: int, pngs_fd: int, parents: tuple[int, int]) -> None:
    code = 1
    try:
        for fd in parents:
            os.close(fd)
        from k3load.analysis.outputs import plots  # imported while the parent loads and judges the run

        with os.fdopen(inputs_fd, "rb") as pipe:
            data = pipe.read()
        if data:
            pngs = plots.draw(pickle.loads(data))
            with os.fdopen(pngs_fd, "wb") as pipe:
                pickle.dump(pngs, pipe, protocol=pickle.HIGHEST_PROTOCOL)
        code = 0
    except BaseException:  # the parent draws the plots itself when none come back
        code = 1
    finally:
        os._exit(code)
