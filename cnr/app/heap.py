"""Keeping Python's full garbage collections cheap in a trainer process.

A torchrec model, its optimizers and readers leave hundreds of thousands of Python objects that
live as long as the job (bench.yaml's model: about 340k). Each full collection of the cyclic
garbage collector walks all of them: 0.17 s on this 2-core machine, at moments set by allocation
counts, so now and then inside a training step, a checkpoint's stall or a restore (``bench
restore --run`` caught one inside a restore: 0.18 s of a 0.43 s restore). Frozen after the model
is built (``gc.freeze``: CPython's permanent generation, which collections skip), the same
collection takes under a millisecond. ``cnr train`` does this; a trainer of its own can do the same.
"""

from __future__ import annotations

import gc


class HeapFreeze:
    """``freeze()`` collects once, then moves every object alive into the permanent generation;
    ``thaw()`` gives them back to the collector, unless something else had frozen objects before
    (``gc.unfreeze`` cannot tell whose they are: they all stay frozen then, which only spares the
    collector work). Each may be called any number of times; only the first ``freeze()`` acts.

    Some environments freeze at start-up already (the GPU machine's Python 3.12 had 375 objects
    frozen once torch was imported), so an earlier freeze does not stop this one."""

    def __init__(self) -> None:
        self.frozen = False
        self._before = 0  # objects frozen by others when this froze

    def freeze(self) -> None:
        if self.frozen:
            return
        self._before = gc.get_freeze_count()
        gc.collect()  # setup's cyclic garbage goes now, or it would stay frozen for the job's life
        gc.freeze()
        self.frozen = True

    def thaw(self) -> None:
        if self.frozen and not self._before:
            gc.unfreeze()
        self.frozen = False
