"""The function each launched rank of ``cnr train`` runs (cnr.app.launch spawns it by reference).

Its own module, above both: cnr.app.job prepares a job without loading the training stack, and
cnr.app.train (which imports cnr.app.job) is loaded only here, inside the rank.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from cnr.app.job import TrainJob


def run_job_rank(rank: int, world_size: int, job: TrainJob) -> Optional[Dict[str, Any]]:
    """A rank of ``job`` (see cnr.app.train.run_rank); the training stack is loaded here, in the rank."""
    from cnr.app.train import run_rank

    return run_rank(rank, world_size, job)
