"""The rules across CheckpointOptions' and PublishOptions' settings (a value's type is
cnr.options.fields'): each check takes the settings as attributes of any object (the library's
options, or an application's config section holding the same fields) and a ``Naming``, and
raises ``names.error`` naming the setting, its value and what is allowed.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from cnr.options.naming import Naming, shown
from cnr.types import CAPPED_POLICIES, BitPolicy, Compaction, Policy

TABLE_WIDTHS = (2, 3, 4, 8, 32)  # what a table's rows may be stored at
PUBLISH_BITS = (4, 8, 32)
# most threads of one kind a rank may run (puts, encodes, restore workers): a restore decodes up to
# twice its workers' objects ahead, so a typo'd count would hold a whole chain in memory at once
MAX_THREADS = 256
# most checkpoints keep_last / local_keep_last may name, and the largest chunk_bytes: C int32's
# bound (fbgemm's row indexes are held to it too). Far past any real store's count or chunk, so a
# typo'd 99999999999999999999 is refused by name rather than silently taken as "keep everything".
MAX_KEEP_LAST = 2**31 - 1
MAX_CHUNK_BYTES = 2**31 - 1
# The chain-bytes trigger's default (CheckpointOptions.compact_at_chain_ratio): merge once the increments since the
# newest baseline hold a quarter of its bytes. A restore of the newest checkpoint reads about 1 + r + s * (1 + M)
# baselines' bytes (s: one increment's bytes over the baseline's, M: intervals a merge takes while increments
# land); with s = 0.25 (bench.yaml: a quarter of the rows touched per interval) and s = 0.30 (tiny.yaml at
# interval 10) this fires at the first increment after a merge, keeping the chain at about 0.5-0.6 baselines
# while merges finish within an interval: under the ~0.7 that restores within 2x of a baseline.
DEFAULT_COMPACT_RATIO = 0.25



def check_failures(f: FailureBudget, bit_policy: str, names: Naming) -> None:
    """The failure budget's rules (``names`` names ``failures.<field>``)."""
    k = "failures."
    names.require(math.isfinite(f.rate_per_node_hour) and f.rate_per_node_hour >= 0,
                  f"{names.subject(k + 'rate_per_node_hour')} = {f.rate_per_node_hour!r} is not allowed; it must be >= 0")
    for name in ("log_nodes", "nodes"):
        names.require(getattr(f, name) >= 0, f"{names.subject(k + name)} = {getattr(f, name)} is not allowed; "
                                             "it must be >= 0")
    names.require(math.isfinite(f.step_seconds) and f.step_seconds >= 0, f"{names.subject(k + 'step_seconds')} = "
                  f"{f.step_seconds!r} is not allowed; it must be >= 0 (0: measured)")
    names.require(isinstance(f.tolerated_restores, dict) and bool(f.tolerated_restores)
                  and all(b in (2, 3, 4) and isinstance(n, int) and n >= 0 for b, n in f.tolerated_restores.items()),
                  f"{names.subject(k + 'tolerated_restores')} = {shown(f.tolerated_restores)} is not allowed; it maps "
                  "bit-widths 2, 3, 4 to restore counts >= 0, e.g. {2: 1, 3: 3, 4: 20}")
    names.require(f.log8_tolerated_restores >= 0, f"{names.subject(k + 'log8_tolerated_restores')} = "
                  f"{f.log8_tolerated_restores} is not allowed; it must be >= 0")
    if bit_policy == BitPolicy.FAILURES:
        names.require((f.rate_per_node_hour > 0) != bool(f.log),
                      f"{names.ref('bit_policy')} 'failures' needs exactly one of '{names.ref(k + 'rate_per_node_hour')}' "
                      f"(> 0) or '{names.ref(k + 'log')}', got rate {f.rate_per_node_hour!r} and log {f.log!r}")
        names.require(not f.log or f.log_nodes >= 1, f"{names.subject(k + 'log_nodes')} = {f.log_nodes} is not "
                      "allowed with a failure log; it must be the number of nodes (>= 1) the log covers")


def check_compaction(c: Any, names: Naming) -> None:
    """The rules of ``compaction``, ``compact_at_chain_ratio`` and ``merge_every``. The ratio left
    unset (None) is the policy's default (CheckpointOptions.compaction_ratio); a ratio set to
    anything but 0 needs ``policy: consecutive``, 0.25 included."""
    ratio = c.compact_at_chain_ratio
    if ratio is not None:
        names.require(isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and math.isfinite(ratio)
                      and ratio >= 0, f"{names.subject('compact_at_chain_ratio')} = {shown(ratio)} is not allowed; "
                      f"it must be >= 0 (0: no bytes trigger), e.g. {DEFAULT_COMPACT_RATIO}, or unset (the policy's default)")
        names.require(ratio == 0 or c.policy == Policy.CONSECUTIVE,
                      f"{names.subject('compact_at_chain_ratio')} = {ratio!r} needs {names.ref('policy')} 'consecutive', "
                      f"not {shown(c.policy)}: only consecutive increments form chains to merge")
    names.require(c.compaction == Compaction.JOB or c.policy == Policy.CONSECUTIVE,
                  f"{names.subject('compaction')} = {shown(c.compaction)} needs {names.ref('policy')} 'consecutive', not "
                  f"{shown(c.policy)}: only consecutive increments form chains to compact")
    names.require(c.merge_every >= 0, f"{names.subject('merge_every')} = {c.merge_every} is not allowed; it must be "
                  ">= 0 (0 never merges)")
    names.require(c.merge_every == 0 or c.policy == Policy.CONSECUTIVE,
                  f"{names.subject('merge_every')} = {c.merge_every} needs {names.ref('policy')} 'consecutive', not "
                  f"{shown(c.policy)}: only consecutive increments form chains to merge")
    names.require(c.merge_every == 0 or c.compaction == Compaction.JOB,
                  f"{names.subject('merge_every')} = {c.merge_every} is not allowed with {names.ref('compaction')} "
                  "'external': that job runs no merges (`cnr compact` does); set it to 0")


def check_checkpoint(c: Any, names: Naming) -> None:
    """The rules of CheckpointOptions' fields, on ``c`` (CheckpointOptions, or an application's
    section holding the same fields); raises ``names.error`` naming the setting, its value and
    what is allowed."""
    for name in ("upload_threads", "encode_threads", "restore_threads"):
        value = getattr(c, name)
        names.require(0 < value <= MAX_THREADS, f"{names.subject(name)} = {value!r} is not allowed; allowed: 1.."
                      f"{MAX_THREADS}")
    names.require(0 < c.commit_timeout_s < math.inf, f"{names.subject('commit_timeout_s')} = {c.commit_timeout_s!r} is "
                  "not allowed; it must be a number of seconds > 0 (an endless wait would hang every later save "
                  "behind a checkpoint a dead rank never finishes)")
    names.require(c.bits in TABLE_WIDTHS, f"{names.subject('bits')} = {c.bits} is not allowed; allowed: 2, 3, 4, 8, 32")
    names.require(c.optimizer_bits in (0, 8, 32), f"{names.subject('optimizer_bits')} = {c.optimizer_bits} is not "
                  "allowed; allowed: 8, 32, or 0 (chosen from the failure budget, with bit_policy 'failures')")
    names.require(c.optimizer_bits != 0 or c.bit_policy == BitPolicy.FAILURES, f"{names.subject('optimizer_bits')} = 0 "
                  f"(chosen from the failure budget) needs {names.ref('bit_policy')} 'failures', not {shown(c.bit_policy)}")
    names.require(c.compression_level in range(1, 20), f"{names.subject('compression_level')} = "
                  f"{c.compression_level} is not allowed; allowed: 1..19")
    names.require(c.small_table_rows >= 0, f"{names.subject('small_table_rows')} = {c.small_table_rows} is not "
                  "allowed; it must be >= 0 (0: no table is small)")
    names.require(c.small_table_bits in (3, 4, 8, 32), f"{names.subject('small_table_bits')} = "
                  f"{c.small_table_bits} is not allowed; allowed: 3, 4, 8, 32")
    names.require(isinstance(c.table_bits, dict) and all(isinstance(k, str) and k and v in TABLE_WIDTHS
                                                         and not isinstance(v, bool) for k, v in c.table_bits.items()),
                  f"{names.subject('table_bits')} = {shown(c.table_bits)} is not allowed; it maps table names to "
                  "bit-widths 2, 3, 4, 8 or 32, e.g. {t_0: 4, t_1: 2}")
    names.require(c.table_plan_width in (0, 2, 3, 4, 8), f"{names.subject('table_plan_width')} = "
                  f"{c.table_plan_width} is not allowed; allowed: 0 (the plan applies at any width), 2, 3, 4, 8")
    names.require(0 <= c.keep_last <= MAX_KEEP_LAST, f"{names.subject('keep_last')} = {shown(c.keep_last)} is not "
                  f"allowed; it must be from 0 to {MAX_KEEP_LAST} (0 keeps everything)")
    check_compaction(c, names)
    names.require(c.max_chain_ratio == 0 or c.max_chain_ratio > 1, f"{names.subject('max_chain_ratio')} = "
                  f"{c.max_chain_ratio} is not allowed; it must be 0 (no cap) or > 1 (a chain reads its baseline at least)")
    names.require(c.max_chain_ratio == 0 or c.policy in CAPPED_POLICIES,
                  f"{names.subject('max_chain_ratio')} = {c.max_chain_ratio} needs {names.ref('policy')} "
                  f"{' or '.join(repr(p) for p in CAPPED_POLICIES)}, not {shown(c.policy)}: the others never choose a new baseline")
    check_failures(c.failures, c.bit_policy, names)
    names.require(4096 <= c.chunk_bytes <= MAX_CHUNK_BYTES, f"{names.subject('chunk_bytes')} = {shown(c.chunk_bytes)} "
                  f"is not allowed; it must be from 4096 to {MAX_CHUNK_BYTES}")
    names.require(isinstance(c.local_dir, str) and "://" not in c.local_dir, f"{names.subject('local_dir')} = "
                  f"{shown(c.local_dir)} is not allowed; give a node-local directory path, or '' for none")
    names.require(0 <= c.local_keep_last <= MAX_KEEP_LAST, f"{names.subject('local_keep_last')} = "
                  f"{shown(c.local_keep_last)} is not allowed; it must be from 0 to {MAX_KEEP_LAST} (0 keeps everything)")
    names.require(1.0 <= c.lease_ttl_s <= 86400.0, f"{names.subject('lease_ttl_s')} = {c.lease_ttl_s} is not "
                  "allowed; it must be from 1 to 86400 seconds")



def check_publish(p: Any, names: Naming, interval: Optional[int] = None) -> None:
    """The rules of PublishOptions' fields, on ``p`` (PublishOptions, or an application's section
    holding the same fields). ``interval``: the steps between the caller's publishes, when it
    publishes at fixed boundaries: ``dense_interval`` must then be a multiple of it."""
    if interval is not None:
        names.positive("interval", interval)
    names.positive("full_every", p.full_every)
    if interval is None:
        names.positive("dense_interval", p.dense_interval)
    else:
        names.require(p.dense_interval > 0 and p.dense_interval % interval == 0,
                      f"{names.subject('dense_interval')} = {p.dense_interval} is not allowed; it must be a positive "
                      f"multiple of {names.ref('interval')} = {interval}")
    names.require(p.bits in PUBLISH_BITS, f"{names.subject('bits')} = {p.bits} is not allowed; allowed: "
                  + ", ".join(str(b) for b in PUBLISH_BITS))
    names.require(p.keep_bases >= 0, f"{names.subject('keep_bases')} = {p.keep_bases} is not allowed; "
                  "it must be >= 0 (0 keeps everything)")
    for limit in ("max_rows", "max_bytes"):
        value = getattr(p, limit)
        names.require(value >= 0, f"{names.subject(limit)} = {value} is not allowed; it must be >= 0 (0: no limit)")
    names.require(1 <= p.max_delay <= 255, f"{names.subject('max_delay')} = {p.max_delay} is not allowed; "
                  "it must be 1..255 (publishes within which every touched row is sent)")
