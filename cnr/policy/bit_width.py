"""The job's checkpoint bit-width, decided once and shared by every rank (cnr.policy.kinds's rules).

``checkpoint.bit_policy: fixed`` uses ``checkpoint.bits``. ``failures`` estimates the expected
failures of the whole job (``train.steps`` x seconds per step): the seconds per step are
configured, or measured by rank 0 over the steps before the first checkpoint. A resumed job
keeps the estimate its checkpoint recorded and counts the restore as an observed failure; once
the failures observed exceed the estimate, 8 bits from then on (cnr.policy.kinds.apply_observed).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Mapping, Optional

from cnr.options import CheckpointOptions
from cnr.track import agreement
from cnr.types import BitPolicy
from cnr.policy.kinds import BitDecision, apply_observed, decide_bits, fixed_bits, previous_decision

logger = logging.getLogger(__name__)


class BitWidthPlanner:
    """Holds the decision; ``for_checkpoint`` is collective (every rank calls it at a boundary)."""

    def __init__(self, options: CheckpointOptions, failure_rate: float, world_size: int, restores: int,
                 recorded: Optional[Mapping[str, Any]], rank: int, start_step: int = 0) -> None:
        """``restores``: failures observed so far in this job; ``recorded``: the decision the
        restored checkpoint's manifest holds (None when starting fresh); ``start_step``: the
        step training (re)started from, for the seconds per step measured at the first save."""
        self.options = options
        self.rate = failure_rate
        self.nodes = options.failures.nodes or world_size
        self.start_step = start_step
        self.restores = restores
        self.rank = rank
        self.decision: Optional[BitDecision] = self._initial(previous_decision(recorded))
        self._created = time.perf_counter()
        if self.decision is not None:
            self._log("checkpoint bit-width %d (%s): %s")
        elif rank == 0:
            logger.info("checkpoint bit-width: from expected failures (rate %.3g/node-hour, %d nodes, %d steps); "
                        "seconds per step measured over the first interval", self.rate, self.nodes, options.expected_steps)

    def _initial(self, previous: Optional[BitDecision]) -> Optional[BitDecision]:
        c = self.options
        if c.bit_policy == BitPolicy.FIXED:
            return fixed_bits(c.bits)
        if previous is not None and previous.mode == "failures":
            return apply_observed(previous, self.restores)
        if c.failures.step_seconds > 0:
            return self._decide(c.failures.step_seconds)
        return None

    def _decide(self, step_seconds: float) -> BitDecision:
        f = self.options.failures
        # optimizer_bits 0 leaves the optimizer state's width to the same budget
        log8 = f.log8_tolerated_restores if self.options.optimizer_bits == 0 else -1
        return decide_bits(self.rate, self.nodes, self.options.expected_steps, step_seconds,
                           f.tolerated_restores, self.restores, log8)

    def _log(self, fmt: str) -> None:
        if self.rank == 0 and self.decision is not None:
            logger.info(fmt, self.decision.bits, self.decision.mode, self.decision.reason)

    def for_checkpoint(self, step: int) -> BitDecision:
        """The decision for the checkpoint about to be taken at ``step`` (collective the first
        time when the step time is measured: rank 0's measurement, from the start to this first
        save, is every rank's)."""
        if self.decision is None:
            seconds = (time.perf_counter() - self._created) / max(1, step - self.start_step)
            seconds = agreement.rank0_decides("save: rank 0's step time for the bit-width", lambda: seconds)
            self.decision = self._decide(float(seconds))
            self._log("checkpoint bit-width %d (%s): %s")
        return self.decision
