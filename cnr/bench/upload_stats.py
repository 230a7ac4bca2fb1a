"""How much of a checkpoint write was pipelined, from the writer's per-object timeline.

A timeline row is ``(key, nbytes, encode_start, encode_end, put_start, put_end, encodes)`` in
wall-clock seconds (cnr.write.puts.ObjectTimes as a tuple): one stored object, a chunk or small chunks
packed; ``encodes`` lists each of its chunks' own (start, end) encoding.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

Interval = Tuple[float, float]


def _union(intervals: List[Interval]) -> List[Interval]:
    """Disjoint, sorted intervals covering the same time as ``intervals``."""
    merged: List[Interval] = []
    for lo, hi in sorted(intervals):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def _overlap(interval: Interval, disjoint: List[Interval]) -> float:
    lo, hi = interval
    return sum(max(0.0, min(hi, b) - max(lo, a)) for a, b in disjoint)


def pipeline_stats(timeline: Sequence[Sequence[Any]]) -> Dict[str, Any]:
    """Seconds spent encoding and uploading, and how far they overlapped.

    ``overlap_fraction``: share of the encoding time during which at least one earlier object was
    being uploaded (0: strictly one after the other). ``objects_stored_while_encoding``: objects
    whose upload had finished before the last object's encoding did -- uploads done while later
    chunks were still being encoded.
    """
    if not timeline:
        return {"objects": 0, "encode_s": 0.0, "upload_busy_s": 0.0, "pipeline_s": 0.0,
                "overlap_fraction": 0.0, "objects_stored_while_encoding": 0}
    # per chunk: a packed object's span from its first chunk to its last also covers other
    # objects' encoding and the writer's waits for an upload slot
    encodes = [(float(lo), float(hi)) for r in timeline for lo, hi in r[6]]
    puts = _union([(float(r[4]), float(r[5])) for r in timeline if r[5] > 0])
    encode_s = sum(hi - lo for lo, hi in encodes)
    overlapped = sum(_overlap(e, puts) for e in encodes)
    last_encode_end = max(hi for _lo, hi in encodes)
    return {
        "objects": len(timeline),
        "encode_s": encode_s,
        "upload_busy_s": sum(hi - lo for lo, hi in puts),
        "pipeline_s": max([hi for _lo, hi in puts] + [last_encode_end]) - min(lo for lo, _hi in encodes),
        "overlap_fraction": overlapped / encode_s if encode_s > 0 else 0.0,
        "objects_stored_while_encoding": sum(1 for r in timeline if 0 < r[5] < last_encode_end),
    }
