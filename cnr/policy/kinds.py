"""Checkpoint policy: full or incremental next, and the bit-width from the expected failures.

Pure functions of their inputs (no storage, no collectives), so they are tested directly.

Kinds (Check-N-Run §4.1, §4.1.1): ``full`` takes a full checkpoint every time; ``one_shot``
takes one full baseline, then increments of the rows touched since it; ``consecutive`` takes
increments of the rows touched since the previous checkpoint (restore replays the chain);
``intermittent`` is one-shot with the history predictor choosing when to take a new baseline.
A chain cap (``max_chain_ratio``) bounds the bytes a restore reads, as a multiple of its
baseline: intermittent and consecutive take a new baseline when the next chain is predicted to
exceed it (storage held per kept checkpoint, traded against write bandwidth).

Bit-width (§5.2.1): expected failures = failure rate per node-hour x nodes x expected hours; the
smallest bit-width whose tolerated restore count covers them is chosen, else 8 bits. The same
budget chooses how fused optimizer state is stored when ``optimizer_bits`` is 0: 8 bits (the
row-wise Adagrad sum on cnr.codec.log8's grid) while the expected failures stay within the
restores log8 is known to tolerate, else fp32. Once more failures are observed than expected,
every later checkpoint uses 8-bit rows and fp32 optimizer state.
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence

from cnr.errors import ConfigError
from cnr.types import CAPPED_POLICIES, POLICIES, BitPolicy, CheckpointKind

FALLBACK_BITS = 8


def intermittent_wants_full(chain_bytes: Sequence[int]) -> bool:
    """The history predictor: should the next checkpoint be a new full baseline?

    ``chain_bytes``: bytes written by the last full checkpoint, then by each of the ``i``
    incrementals after it. With sizes as fractions of the full one (S0 = 1), take a full
    checkpoint iff ``1 + S1 + ... + Si <= (i + 1) * Si``. Right after a full (i = 0) the answer
    is no: one increment is needed before there is a history to predict from.
    """
    if not chain_bytes:
        return True
    i = len(chain_bytes) - 1
    if i == 0:
        return False
    base = float(chain_bytes[0])
    if base <= 0:
        return True
    sizes = [b / base for b in chain_bytes]
    return sum(sizes) <= (i + 1) * sizes[-1]



def predicted_chain_ratio(policy: str, chain_bytes: Sequence[int]) -> float:
    """The bytes a restore of the next increment would read, as a multiple of the baseline's.

    ``chain_bytes`` as in ``intermittent_wants_full`` (sizes S_i as fractions of the baseline,
    S_0 = 0 for the baseline itself). One-shot increments hold every row touched since the
    baseline, so they grow; the next is extrapolated linearly, S_i + (S_i - S_{i-1}), which
    over-predicts a touched set that saturates. A consecutive restore reads every link, and the
    next link is predicted as large as the last: 1 + S_1 + ... + S_i + S_i. With no increment
    yet there is nothing to extrapolate from, and the answer is 1.
    """
    if len(chain_bytes) < 2 or chain_bytes[0] <= 0:
        return 1.0
    sizes = [0.0] + [b / float(chain_bytes[0]) for b in chain_bytes[1:]]
    if policy == "consecutive":
        return 1.0 + sum(sizes) + sizes[-1]
    return 1.0 + sizes[-1] + max(0.0, sizes[-1] - sizes[-2])


def next_kind(policy: str, chain_bytes: Sequence[int], have_base: bool,
              max_chain_ratio: float = 0.0) -> CheckpointKind:
    """Kind of the next checkpoint under ``policy`` (one of POLICIES).

    ``have_base``: a committed full baseline exists for this job (else the next one is full);
    ``chain_bytes``: bytes of that baseline and of every committed increment since it;
    ``max_chain_ratio``: with intermittent or consecutive, a new baseline once the next chain
    is predicted to read more than this many baselines' bytes (0: no cap).
    """
    if policy not in POLICIES:
        raise ConfigError(f"checkpoint policy {policy!r} is not allowed; allowed: {', '.join(POLICIES)}")
    if policy == "full" or not have_base:
        return CheckpointKind.FULL
    if policy == "intermittent" and intermittent_wants_full(chain_bytes):
        return CheckpointKind.FULL
    if max_chain_ratio > 0 and policy in CAPPED_POLICIES \
            and predicted_chain_ratio(policy, chain_bytes) > max_chain_ratio:
        return CheckpointKind.FULL
    return CheckpointKind.INCREMENTAL


def compaction_due(chain_bytes: Sequence[int], increments: int, at_ratio: float, every: int = 0) -> bool:
    """Whether a consecutive chain should be merged into a new baseline now (cnr.write.merge).

    ``chain_bytes``: stored bytes of the newest full checkpoint, then of each committed one since
    (as recorded in manifests); ``increments``: committed increments since the newest full *or
    merged* baseline, the newest of ``chain_bytes``. Due when ``at_ratio`` > 0 and those increments
    store at least ``at_ratio`` times the full checkpoint's bytes (a merged baseline stores the
    same rows in the same forms, so about as many bytes), or when ``every`` > 0 and at least
    ``every`` increments followed. Never with no increment.
    """
    if increments <= 0:
        return False
    if every > 0 and increments >= every:
        return True
    if at_ratio <= 0 or not chain_bytes or chain_bytes[0] <= 0:
        return False
    since = chain_bytes[1:][-increments:]
    return sum(since) >= at_ratio * chain_bytes[0]


# ---- bit-width from expected failures --------------------------------------------------------

def expected_failures(rate_per_node_hour: float, nodes: int, hours: float) -> float:
    """Expected node failures over a job: rate (per node-hour) x nodes x hours."""
    return rate_per_node_hour * nodes * hours


def choose_bits(expected: float, tolerated_restores: Mapping[int, int]) -> int:
    """The smallest bit-width whose tolerated restore count is >= ``expected``; else 8.

    ``tolerated_restores`` maps a bit-width (2, 3 or 4) to the most restores from checkpoints
    at that width the accuracy budget allows.
    """
    for bits in sorted(tolerated_restores):
        if expected <= tolerated_restores[bits]:
            return bits
    return FALLBACK_BITS


def _parse_timestamp(text: str, where: str) -> float:
    try:
        return float(text)
    except ValueError:
        pass
    try:
        stamp = _dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError as e:
        raise ConfigError(f"{where}: {text!r} is neither unix seconds nor an ISO-8601 time") from e
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=_dt.timezone.utc)
    return stamp.timestamp()


def read_failure_log(path: str) -> List[float]:
    """Failure times (unix seconds, sorted) from a plain file: one timestamp per line, either
    unix seconds or ISO-8601; blank lines and ``#`` comments are ignored."""
    try:
        with open(path, "r", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ConfigError(f"cannot read failure log {path!r}: {e.strerror or e}") from e
    times = []
    for n, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if text:
            times.append(_parse_timestamp(text, f"failure log {path!r} line {n}"))
    return sorted(times)


def rate_from_failure_log(times: Sequence[float], log_nodes: int) -> float:
    """Failures per node-hour observed in a log of ``log_nodes`` nodes: the ``n - 1`` intervals
    between the first and last of ``n`` failures, over that span (the maximum-likelihood rate of
    a Poisson process observed from one failure to another)."""
    if len(times) < 2:
        raise ConfigError(f"a failure log needs at least 2 timestamps to give a rate, it has {len(times)}")
    span_hours = (times[-1] - times[0]) / 3600.0
    if span_hours <= 0 or log_nodes < 1:
        raise ConfigError(f"a failure log must span a positive time over >= 1 node (span {span_hours} h, nodes {log_nodes})")
    return (len(times) - 1) / (span_hours * log_nodes)


@dataclass(frozen=True)
class BitDecision:
    """The bit-width of a job's checkpoints and why; stored in every manifest ("bit_width").

    ``mode``: "fixed" (checkpoint.bits) or "failures" (from the expected failures).
    ``expected_failures`` = ``rate_per_node_hour`` x ``nodes`` x ``expected_hours``, where
    ``expected_hours`` = ``steps`` x ``step_seconds`` / 3600. ``observed_failures``: restores so far.
    ``fallback``: more failures were observed than expected, so 8 bits from then on.
    ``optimizer_bits``: how fused optimizer state is stored when the job leaves it to the budget
    (``optimizer_bits`` 0): 8 or 32. Decisions recorded before it existed read as 32.
    """

    mode: str
    bits: int
    reason: str
    expected_failures: float = 0.0
    observed_failures: int = 0
    rate_per_node_hour: float = 0.0
    nodes: int = 0
    expected_hours: float = 0.0
    steps: int = 0
    step_seconds: float = 0.0
    fallback: bool = False
    optimizer_bits: int = 32

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(obj: Mapping[str, Any]) -> "BitDecision":
        """Inverse of to_dict; raises ValueError on a field that is unknown or missing (fields
        added later, ``LATER_FIELDS``, may be missing: they take their defaults)."""
        names = set(BitDecision.__dataclass_fields__)
        if not names - LATER_FIELDS <= set(obj) <= names:
            raise ValueError(f"bit_width fields {sorted(obj)} differ from {sorted(names)}")
        return BitDecision(**dict(obj))


LATER_FIELDS = frozenset({"optimizer_bits"})  # absent from decisions recorded before #14


def choose_optimizer_bits(expected: float, log8_tolerated: int) -> int:
    """8 (log8 row-wise Adagrad sums) when ``expected`` failures are within the restores log8
    is measured to tolerate, else 32."""
    return 8 if expected <= log8_tolerated else 32


def decide_bits(rate_per_node_hour: float, nodes: int, steps: int, step_seconds: float,
                tolerated_restores: Mapping[int, int], observed_failures: int,
                log8_tolerated: int = -1) -> BitDecision:
    """A fresh decision from the failure inputs (mode "failures"). ``log8_tolerated``: the most
    restores log8 optimizer state tolerates (-1: never chosen, the state stays fp32)."""
    hours = steps * step_seconds / 3600.0
    expected = expected_failures(rate_per_node_hour, nodes, hours)
    bits = choose_bits(expected, tolerated_restores)
    table = ", ".join(f"{b}-bit <= {tolerated_restores[b]}" for b in sorted(tolerated_restores))
    reason = (f"expected failures {expected:.3g} = {rate_per_node_hour:.3g}/node-hour x {nodes} nodes x "
              f"{hours:.3g} h ({steps} steps x {step_seconds:.3g} s); tolerated restores: {table}; "
              f"{bits} bits is the smallest width that covers it" if bits != FALLBACK_BITS else
              f"expected failures {expected:.3g} exceed every tolerance ({table}): 8 bits")
    optimizer_bits = choose_optimizer_bits(expected, log8_tolerated)
    if log8_tolerated >= 0:
        reason += (f"; optimizer state {'log8' if optimizer_bits == 8 else 'fp32'} "
                   f"(log8 tolerates <= {log8_tolerated} restores)")
    decision = BitDecision("failures", bits, reason, expected, observed_failures, rate_per_node_hour, nodes,
                           hours, steps, step_seconds, optimizer_bits=optimizer_bits)
    return apply_observed(decision, observed_failures)


def apply_observed(decision: BitDecision, observed_failures: int) -> BitDecision:
    """``decision`` updated with the failures observed so far: once they exceed the estimate,
    8-bit rows and fp32 optimizer state for every later checkpoint (sticky: a decision that fell
    back stays there)."""
    if decision.mode != "failures":
        return decision
    if decision.fallback or observed_failures > decision.expected_failures:
        reason = decision.reason if decision.fallback else (
            f"{observed_failures} failures observed exceed the {decision.expected_failures:.3g} expected: "
            f"falling back from {decision.bits} to {FALLBACK_BITS} bits for every later checkpoint "
            "(optimizer state left to the budget: fp32)")
        return BitDecision(**{**decision.to_dict(), "bits": max(decision.bits, FALLBACK_BITS), "reason": reason,
                              "observed_failures": observed_failures, "fallback": True, "optimizer_bits": 32})
    return BitDecision(**{**decision.to_dict(), "observed_failures": observed_failures})


def stored_optimizer_bits(configured: int, decision: BitDecision) -> int:
    """How fused optimizer state is stored: ``checkpoint.optimizer_bits`` (8 or 32), or the
    decision's choice when it is 0 (left to the failure budget)."""
    return configured or decision.optimizer_bits


def table_widths_in_force(table_bits: Mapping[str, int], decision: BitDecision, plan_width: int = 0) -> Dict[str, int]:
    """A per-table plan (table -> width) as the decision allows it. ``plan_width``: the uniform
    width the plan stands in for (0: any); a decision for another width (more failures
    expected, or the fallback) stores every table at that width instead. After the fallback
    no table goes below 8 bits."""
    if plan_width and decision.bits != plan_width:
        return {}
    if not decision.fallback:
        return dict(table_bits)
    return {t: max(b, FALLBACK_BITS) for t, b in table_bits.items()}


def fixed_bits(bits: int) -> BitDecision:
    return BitDecision("fixed", bits, f"checkpoint.bits = {bits}")


def previous_decision(obj: Optional[Mapping[str, Any]]) -> Optional[BitDecision]:
    """The decision a manifest recorded (None for none)."""
    return BitDecision.from_dict(obj) if obj else None


def failure_rate(options) -> float:
    """Failures per node-hour for the bit-width policy of ``options`` (a CheckpointOptions or a
    config's checkpoint section): configured, or from the failure log; 0 for fixed bits."""
    f = options.failures
    if options.bit_policy != BitPolicy.FAILURES:
        return 0.0
    if f.log:
        return rate_from_failure_log(read_failure_log(f.log), f.log_nodes)
    return f.rate_per_node_hour
