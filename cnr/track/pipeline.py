"""The data position under a torchrec train pipeline: the batch last *trained*, not last pulled.

torchrec's train pipelines (``TrainPipelineSparseDist``, ``TrainPipelineSemiSync``,
``PrefetchTrainPipelineSparseDist``, ...) pull batches ahead of the one they train, to overlap
the input AlltoAll (and prefetch) with compute. A data loader's own ``state_dict()`` is then one
to three batches ahead of the model, and a resume from it skips those batches. Every
``progress()`` call trains exactly one batch, the oldest pulled one, so ``PipelineFeed`` records
the loader's state after each batch it hands out and moves its stored position on by one batch
per ``progress()``:

```python
feed = cnr.PipelineFeed(loader)     # any Stateful iterable: torchdata's StatefulDataLoader, ...
app_state = {"model": dmp, "optim": optimizer, "loader": feed}
ckpt = cnr.Checkpointer(uri, app_state, options)
ckpt.restore()                      # the loader resumes after the last trained batch
for step in ...:
    feed.progress(pipeline)         # pipeline.progress(iter over the feed); StopIteration at the end
    if step % 100 == 0:
        ckpt.save(step)             # between progress() calls
```

A loader put straight into ``app_state`` of a model that a pipeline drives is refused at
``save()`` (``check_loaders``), as is a feed whose batches were trained without ``progress``.
"""

from __future__ import annotations

import collections
import copy
from typing import Any, Deque, Dict, Iterator, List, Optional

import torch

# torchrec's pipelines keep at most this many batches pulled and not yet trained (the prefetch
# pipeline three); more means progress() ran on the feed without feed.progress
_MAX_IN_FLIGHT = 4


class PipelineFeed:
    """A Stateful wrapper of ``loader`` whose state is the loader's after the last trained batch.

    ``loader``: an iterable with ``state_dict()`` / ``load_state_dict()`` whose state after
    yielding batch k resumes at batch k + 1 (torchdata's StatefulDataLoader, cnr's readers).
    """

    def __init__(self, loader: Any) -> None:
        if not (callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))
                and hasattr(loader, "__iter__")):
            raise TypeError(f"cnr.PipelineFeed needs an iterable with state_dict() and load_state_dict(), "
                            f"got a {type(loader).__name__}")
        self.loader = loader
        self._trained_state: Dict[str, Any] = copy.deepcopy(loader.state_dict())
        self._pulled: Deque[Dict[str, Any]] = collections.deque()  # states after batches pulled, not trained
        self._iterator: Optional[Iterator[Any]] = None
        self._restored = False  # load_state_dict ran: the next iterator is made without drawing from the RNG
        self.trained_batches = 0

    def __iter__(self) -> "PipelineFeed":
        return self

    def __next__(self) -> Any:
        if self._iterator is None:
            if self._restored:
                # a loader draws its base seed from the global RNG when its iterator is made; the
                # job that saved drew it before the RNG state cnr restored, so drawing it again here
                # would shift every random number the resumed job draws from then on
                with torch.random.fork_rng(devices=[]):
                    self._iterator = iter(self.loader)
            else:
                self._iterator = iter(self.loader)
        batch = next(self._iterator)
        self._pulled.append(copy.deepcopy(self.loader.state_dict()))
        return batch

    @property
    def in_flight(self) -> int:
        """Batches pulled by the pipeline and not trained yet."""
        return len(self._pulled)

    def progress(self, pipeline: Any) -> Any:
        """``pipeline.progress`` over this feed (it trains the oldest pulled batch); returns its
        output. StopIteration passes through when the data and the pipeline are drained."""
        out = pipeline.progress(self)
        self.trained()
        return out

    def trained(self) -> None:
        """Record that the pipeline trained the oldest batch pulled (``progress`` calls this)."""
        if not self._pulled:
            raise RuntimeError("PipelineFeed.trained(): no batch was pulled from the feed since the last trained one")
        self._trained_state = self._pulled.popleft()
        self.trained_batches += 1

    def state_dict(self) -> Dict[str, Any]:
        return self._trained_state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Reopen the loader after the last trained batch; a fresh pipeline pulls from there."""
        self.loader.load_state_dict(state)
        self._trained_state = copy.deepcopy(state)
        self._pulled.clear()
        self._iterator = None
        self._restored = True


def pipelined(module: torch.nn.Module) -> bool:
    """Whether a torchrec train pipeline drives ``module`` (it swaps sharded modules' forward
    for one of its pipelined forwards when it attaches)."""
    from torchrec.distributed.train_pipeline.runtime_forwards import BaseForward

    return any(isinstance(m.__dict__.get("forward"), BaseForward) for m in module.modules())


def looks_ahead(module: torch.nn.Module) -> bool:
    """Whether a torchrec train pipeline that looks up the next batch's embeddings inside
    ``progress``, before that batch's turn to train (TrainPipelineSemiSync), drives ``module``.
    The trackers then count those rows in the interval that is ending while the next interval
    updates them, so an increment would leave them out."""
    from torchrec.distributed.train_pipeline.runtime_forwards import (EmbeddingPipelinedForward,
                                                                      InSyncEmbeddingPipelinedForward)

    return any(isinstance(f, EmbeddingPipelinedForward) and not isinstance(f, InSyncEmbeddingPipelinedForward)
               for f in (m.__dict__.get("forward") for m in module.modules()))


def check_lookahead(objects: Dict[str, Any], kinds: Dict[str, str]) -> None:
    """Refuse (ValueError naming the key) an incremental checkpoint of a module driven by a
    pipeline that ``looks_ahead``: its increments would miss rows. A full policy stores every row."""
    keys = [k for k, v in objects.items() if kinds[k] == "module" and looks_ahead(v)]
    if keys:
        raise ValueError(f"app_state[{keys[0]!r}] is driven by a torchrec train pipeline that looks up the next "
                         "batch's embeddings before that batch trains (TrainPipelineSemiSync): the rows it looks up "
                         "ahead are updated in the next checkpoint interval unseen, so an increment would miss them. "
                         "Use policy='full', or TrainPipelineSparseDist")


def check_loaders(objects: Dict[str, Any], kinds: Dict[str, str]) -> None:
    """Refuse (ValueError naming the key) a data position that would skip batches at a resume:
    a loader in app_state beside a pipelined model, or a PipelineFeed trained without progress."""
    modules = [v for k, v in objects.items() if kinds[k] == "module"]
    if not any(pipelined(m) for m in modules):
        return
    problems: List[str] = []
    for key, value in objects.items():
        if isinstance(value, PipelineFeed):
            # batches pulled but none ever recorded as trained: the pipeline was driven directly
            if value.in_flight > _MAX_IN_FLIGHT or (value.in_flight and not value.trained_batches):
                problems.append(f"app_state[{key!r}] has {value.in_flight} batches pulled and not recorded as "
                                "trained: call feed.progress(pipeline) instead of pipeline.progress(...), so the "
                                "feed knows which batch was trained")
        elif kinds[key] == "stateful" and hasattr(value, "__iter__"):
            problems.append(f"app_state[{key!r}] is a {type(value).__name__} read by a torchrec train pipeline, which "
                            "pulls batches ahead of the one it trains: its own position is ahead of the model's, and "
                            f"a resume would skip those batches. Put cnr.PipelineFeed({key}) in app_state and call "
                            "feed.progress(pipeline)")
    if problems:
        raise ValueError("; ".join(problems))
