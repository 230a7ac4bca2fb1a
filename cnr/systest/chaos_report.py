"""What ``bench chaos`` reports (cnr.systest.chaos's module docstring lists the figures): the
result of one chaos run against its uninterrupted reference."""

from __future__ import annotations

import argparse
from collections import Counter
from typing import Any, Dict, List, Set

from cnr.app.trace import load_trace
from cnr.systest.chaos_merge import merge_report
from cnr.format.verify import verify_store
from cnr.storage.base import Storage
from cnr.types import CheckpointStatus


def _sample_counts(trace) -> Counter:
    counts: Counter = Counter()
    for _step, _rank, runs in trace:
        for lo, hi in runs:
            counts.update(range(lo, hi))
    return counts


def report(args: argparse.Namespace, chaos: Any, final: Dict[str, Any], reference: Dict[str, Any],
            unrestorable: List[str]) -> Dict[str, Any]:
    status = Counter(s.value for s in chaos.watch.status.values())
    ref_counts, counts = _sample_counts(reference["trace"]), _sample_counts(load_trace(chaos.trace_dir))
    fatal = sum(1 for a in chaos.attempts if a["killed"] or a["rc"] != 0)
    lost_s = sum(a["seconds"] for a in chaos.attempts) - reference["seconds"]
    restores = [a for a in chaos.attempts if a["resumed"]]
    checks = chaos.restorable.results
    by_kind: Dict[str, List[Dict[str, Any]]] = {}
    for e in chaos.fired:
        by_kind.setdefault(e["event"], []).append(e)
    return {
        "ok": True,
        "events": chaos.fired,
        "events_by_kind": dict(Counter(e["event"] for e in chaos.fired)),
        "attempts": chaos.attempts,
        "checkpoints_attempted": len(chaos.watch.status),
        "checkpoints_committed": status.get(CheckpointStatus.COMMITTED.value, 0),
        "checkpoints_failed": len(chaos.watch.status) - status.get(CheckpointStatus.COMMITTED.value, 0),
        "checkpoints_damaged_on_purpose": sorted(chaos.damaged),
        "lost_commits": len(chaos.lost) + len(unrestorable),
        "lost_commit_details": chaos.lost + unrestorable,
        "samples_duplicated": sum(c - 1 for c in counts.values() if c > 1),
        "samples_skipped": sum(1 for s in ref_counts if s not in counts),
        "samples_not_in_reference": sum(1 for s in counts if s not in ref_counts),
        "trace_equals_reference": load_trace(chaos.trace_dir) == reference["trace"],
        "restores": len(restores),
        "fallbacks": sum(1 for a in restores if a["restored"] and a["restored"] != a["newest"]),
        "second_jobs": dict(chaos.second_jobs),
        "restorable_after_every_event": bool(checks) and all(c["ok"] for c in checks),
        "restorable_checks": len(checks),
        "restorable_failures": [c for c in checks if not c["ok"]],
        **merge_report(chaos.fired, chaos.watch.status),
        "damage_resume_crash": [{k: e.get(k) for k in ("variant", "damaged", "restored", "fell_back", "committed_after",
                                                       "crash", "restorable_after_crash", "skipped")}
                                for e in by_kind.get("damage_resume_crash", [])],
        "fresh_races_refused": f"{sum(1 for e in by_kind.get('fresh_race', []) if e.get('ok'))}/"
                               f"{len(by_kind.get('fresh_race', []))}",
        "shared_local_dirs_apart": f"{sum(1 for e in by_kind.get('shared_local_dir', []) if e.get('ok'))}/"
                                   f"{len(by_kind.get('shared_local_dir', []))}",
        "attempts_not_committed": sum(1 for a in chaos.attempts if a.get("not_committed")),
        "proxy_requests": dict(chaos.proxy.counts),
        "failures": fatal,
        "seconds_lost_total": round(lost_s, 1),
        "seconds_lost_per_failure": round(lost_s / fatal, 2) if fatal else 0.0,
        "reference_seconds": round(reference["seconds"], 1),
        "final_state_equal": final["state_sha256"] == reference["summary"]["state_sha256"],
        "final_steps": final["steps"],
        "settings": {k: v for k, v in vars(args).items() if k != "workdir"},
    }


def unrestorable(storage: Storage, damaged: Set[str]) -> List[str]:
    """Committed checkpoints whose chain has no deliberately damaged link but does not restore
    (cnr.format.verify reads back every object)."""
    out = []
    for v in verify_store(storage):
        if not v.restorable and v.id not in damaged and not set(v.chain) & damaged:
            out.append(f"{v.id}: {'; '.join(v.damage) or 'a link of its chain is damaged'}")
    return out
