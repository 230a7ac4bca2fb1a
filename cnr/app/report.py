"""``python -m cnr report URI``: checkpoint sizes, storage used and reductions, from manifests alone.

Reads what ``inspect`` reads (every manifest, via ``scan_checkpoints``) plus the sizes of the
manifest and rank-index objects; never a chunk. Writes ``report.md`` and three PNGs after the
paper's Figures 8, 9 and 11 (``cnr.app.report_plots``).

Every figure counts the committed checkpoints present in storage, in step order; failed and
uncommitted ones are listed as excluded. For checkpoint i (all sizes in stored bytes):

- ``written_i``: its chunks (bytes recorded in the manifest) plus its metadata (manifest and
  rank-index JSON): the same sum as ``bytes_written`` in the train summary.
- ``fp32_i``: the full fp32 size of the training state it covers (``Manifest.full_fp32_bytes``):
  what the baseline, a full fp32 checkpoint at every interval, writes at that interval. A merged
  baseline (cnr.write.merge) is no interval: its bytes count as written, the baseline writes nothing
  for it, and the per-interval averages leave it out of the count.
- ``held_i``: storage held once i committed: ``written_j`` summed over present checkpoints with
  ``step_j <= step_i``. Assumption: nothing that was present then has been deleted since. A
  checkpoint deleted by retention is absent from every figure, so after retention ``held``
  under-counts the past and the written totals cover only the checkpoints that survive.
- ``needed_i``: bytes of the chain that restores i (i, its base, the base's base, ...): the
  storage a retention that keeps only the newest valid chain needs (the paper's Figure 9).
  None when part of the chain is no longer present.
- bandwidth reduction after i: ``sum(fp32_j) / sum(written_j)`` over j <= i (the ratio of the
  average bytes per interval).
- capacity reduction after i: ``max(fp32_j) / max(needed_j)`` over j <= i: the baseline keeps
  only its newest checkpoint (one full fp32 size), as the paper's default retention does.
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass
from typing import Dict, List, Optional

from cnr.app.console import moving
from cnr.errors import CheckpointError, ConfigError, KeyNotFoundError
from cnr.app.report_points import Entry, Point
from cnr.format.manifest import MERGED_SUFFIX, Manifest, chain_links, manifest_key, rank_index_key
from cnr.format.catalog import scan_checkpoints
from cnr.storage import open_storage
from cnr.storage.base import Storage
from cnr.types import CheckpointInfo

logger = logging.getLogger(__name__)

MARKDOWN = "report.md"
FIGURES = {"sizes": "checkpoint_sizes.png", "storage": "storage.png", "reduction": "reduction.png"}


@dataclass(frozen=True)
class ReportData:
    """Everything the markdown and the figures show: points in step order, exclusions."""

    uri: str
    points: List[Point]
    excluded: List[CheckpointInfo]

    def totals(self) -> Dict[str, float]:
        """Run-level figures; ratios are the last point's (cumulative) values."""
        pts = self.points
        needed = [p.needed for p in pts if p.needed is not None]
        last = pts[-1]
        intervals = max(1, sum(1 for p in pts if p.entry.interval))
        return {
            "checkpoints": len(pts),
            "full": sum(1 for p in pts if p.entry.kind == "full" and p.entry.interval),
            "incremental": sum(1 for p in pts if p.entry.kind != "full"),
            "merged": sum(1 for p in pts if not p.entry.interval),
            "written_bytes": last.cum_written,
            "full_fp32_bytes": last.cum_fp32,
            "avg_written_per_interval": last.cum_written / intervals,
            "avg_fp32_per_interval": last.cum_fp32 / intervals,
            "bw_reduction": last.bw_reduction,
            "peak_held_bytes": max(p.held for p in pts),
            "peak_needed_bytes": max(needed) if needed else None,
            "peak_fp32_bytes": max(p.entry.full_fp32_bytes for p in pts),
            "capacity_reduction": last.capacity_reduction,
        }


def _chain_bytes(entry: Entry, by_id: Dict[str, Entry], bases: Dict[str, Optional[str]]) -> Optional[int]:
    """Written bytes of what restoring ``entry`` reads (cnr.format.manifest.chain_links over ``bases``,
    id -> base of every entry); None if part of its chain is absent."""
    links, complete = chain_links(entry.id, bases)
    return sum(by_id[i].written for i in links) if complete else None


def compute(entries: List[Entry]) -> List[Point]:
    """The per-checkpoint figures of ``entries`` (committed, present), in step order."""
    entries = sorted(entries, key=lambda e: (e.step, e.id))
    by_id = {e.id: e for e in entries}
    bases = {e.id: e.base for e in entries}
    points: List[Point] = []
    cum_written = cum_fp32 = held = peak_fp32 = 0
    peak_needed: Optional[int] = None
    for e in entries:
        cum_written += e.written
        cum_fp32 += e.full_fp32_bytes if e.interval else 0
        held += e.written  # entries are in step order, so this sums every present one up to e
        peak_fp32 = max(peak_fp32, e.full_fp32_bytes)
        needed = _chain_bytes(e, by_id, bases)
        if needed is not None:
            peak_needed = needed if peak_needed is None else max(peak_needed, needed)
        points.append(Point(
            entry=e, cum_written=cum_written, cum_fp32=cum_fp32, held=held, needed=needed,
            bw_reduction=cum_fp32 / cum_written if cum_written else None,
            capacity_reduction=peak_fp32 / peak_needed if peak_needed else None,
        ))
    return points


def _meta_bytes(storage: Storage, m: Manifest) -> int:
    """Stored size of the manifest and every rank's index (sizes only, nothing is read). A merged
    baseline (cnr.write.merge) is written by one process, with no rank indexes."""
    ranks = 0 if m.id.endswith(MERGED_SUFFIX) else m.world_size
    keys = [manifest_key(m.id)] + [rank_index_key(m.id, r, m.version) for r in range(ranks)]
    total = 0
    for key in keys:
        try:
            total += storage.size(key)
        except KeyNotFoundError:  # deleted after the listing: count what is present
            logger.warning("%s/%s vanished while the report was being made", storage.uri, key)
    return total


def collect(storage: Storage) -> ReportData:
    """Scan ``storage``; raise CheckpointError when no committed checkpoint is present."""
    entries: List[Entry] = []
    excluded: List[CheckpointInfo] = []
    for info, m in scan_checkpoints(storage):
        if m is None:
            excluded.append(info)
            continue
        entries.append(Entry(id=info.id, step=info.step, kind=info.kind.value, bits=info.bits, method=info.method,
                             base=info.base, data_bytes=info.bytes, meta_bytes=_meta_bytes(storage, m),
                             full_fp32_bytes=m.full_fp32_bytes))
    if not entries:
        what = f" ({len(excluded)} failed or uncommitted)" if excluded else ""
        raise CheckpointError(f"no committed checkpoint under {storage.uri}{what}: nothing to report")
    return ReportData(storage.uri, compute(entries), excluded)


# ---- markdown ------------------------------------------------------------------------------

def _n(value: Optional[float]) -> str:
    return "—" if value is None else f"{int(value):,}"


def _x(ratio: Optional[float]) -> str:
    return "—" if ratio is None else f"{ratio:.2f}×"


def _bits(bits: int) -> str:
    return "fp32" if bits >= 32 else str(bits)


def _table(points: List[Point]) -> List[str]:
    lines = ["| step | id | kind | bits | chunk bytes | metadata bytes | bytes written | cumulative written "
             "| full fp32 bytes | held after commit | needed to restore | bandwidth reduction | capacity reduction |",
             "|---:|---|---|---:|" + "---:|" * 9]
    for p in points:
        e = p.entry
        lines.append(f"| {e.step} | `{e.id}` | {e.kind} | {_bits(e.bits)} | {_n(e.data_bytes)} | {_n(e.meta_bytes)} "
                     f"| {_n(e.written)} | {_n(p.cum_written)} | {_n(e.full_fp32_bytes)} | {_n(p.held)} "
                     f"| {_n(p.needed)} | {_x(p.bw_reduction)} | {_x(p.capacity_reduction)} |")
    return lines


def render_markdown(data: ReportData) -> str:
    """report.md: totals, reductions, the per-checkpoint table, the figures, the definitions."""
    t = data.totals()
    lines = [
        "# Check-N-Run checkpoint report", "",
        f"Storage: `{data.uri}`. Computed from manifests alone (chunk data is never read).", "",
        "## Totals", "",
        "| figure | value |", "|---|---:|",
        f"| committed checkpoints present | {t['checkpoints']} ({t['full']} full, {t['incremental']} incremental, "
        f"{t['merged']} merged baselines) |",
        f"| bytes written | {_n(t['written_bytes'])} |",
        f"| full fp32 every interval would write | {_n(t['full_fp32_bytes'])} |",
        f"| average bytes written per interval | {_n(t['avg_written_per_interval'])} |",
        f"| average full fp32 bytes per interval | {_n(t['avg_fp32_per_interval'])} |",
        f"| **write-bandwidth reduction** (average per interval, fp32 ÷ actual) | **{_x(t['bw_reduction'])}** |",
        f"| peak storage needed to restore (newest chain) | {_n(t['peak_needed_bytes'])} |",
        f"| peak storage of the fp32 baseline (its newest full checkpoint) | {_n(t['peak_fp32_bytes'])} |",
        f"| **capacity reduction** (peak fp32 ÷ peak needed) | **{_x(t['capacity_reduction'])}** |",
        f"| peak storage held (every present checkpoint) | {_n(t['peak_held_bytes'])} |",
        "",
    ]
    if data.excluded:
        lines += ["Excluded (not committed, never used for restore): "
                  + ", ".join(f"`{i.id}` ({i.status.value})" for i in data.excluded) + ".", ""]
    lines += ["## Per checkpoint", ""] + _table(data.points) + [""]
    lines += [
        "## Figures", "",
        f"![Checkpoint size per interval]({FIGURES['sizes']})", "",
        f"![Storage used after each commit]({FIGURES['storage']})", "",
        f"![Reduction against full fp32 checkpoints every interval]({FIGURES['reduction']})", "",
        "## Definitions", "",
        "- *bytes written*: the checkpoint's chunks plus its manifest and rank indexes.",
        "- *full fp32 bytes*: all training state as raw fp32, what the baseline (a full fp32 checkpoint "
        "every interval) writes per interval.",
        "- *held after commit*: every committed checkpoint present now with a step up to this one. "
        "Checkpoints deleted by retention are absent, so this under-counts past storage after retention "
        "has run, and totals cover only the checkpoints still present.",
        "- *needed to restore*: this checkpoint and the baselines its restore reads (a merged baseline "
        "in place of the chain it stands for).",
        "- *merged baseline*: a merge of consecutive increments into a full checkpoint, written beside "
        "the intervals: its bytes count as written; the fp32 baseline writes nothing for it.",
        "- *bandwidth reduction*: cumulative full fp32 bytes ÷ cumulative bytes written.",
        "- *capacity reduction*: peak full fp32 size so far (the baseline keeps only its newest "
        "checkpoint) ÷ peak storage needed to restore so far.",
        "",
    ]
    return "\n".join(lines)


# ---- output --------------------------------------------------------------------------------

def _prepare_out_dir(out_dir: str) -> str:
    """Create ``out_dir`` and prove it writable; ConfigError naming it otherwise."""
    path = os.path.abspath(out_dir)
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise ConfigError(f"report directory {out_dir!r} is not writable: {e.strerror or e}") from e
    return path


def write_report(uri: str, out_dir: str) -> Dict[str, object]:
    """Write report.md and the PNGs for the checkpoints under ``uri``; return a JSON-able summary."""
    from cnr.app.report_plots import plot_reduction, plot_sizes, plot_storage  # matplotlib only when reporting

    path = _prepare_out_dir(out_dir)
    storage = open_storage(uri)
    try:
        with moving(storage, "report") as read:  # a bar of the manifest bytes read
            data = collect(read)
    finally:
        storage.close()
    files = {name: os.path.join(path, file) for name, file in FIGURES.items()}
    files["markdown"] = os.path.join(path, MARKDOWN)
    try:
        plot_sizes(data.points, files["sizes"], [i.step for i in data.excluded if i.step >= 0])
        plot_storage(data.points, files["storage"])
        plot_reduction(data.points, files["reduction"])
        with open(files["markdown"], "w", encoding="utf-8") as f:
            f.write(render_markdown(data))
    except OSError as e:
        raise ConfigError(f"cannot write the report under {out_dir!r}: {e.strerror or e}") from e
    t = data.totals()
    logger.info("report on %d checkpoints of %s written to %s", t["checkpoints"], data.uri, path)
    return {"uri": data.uri, "out": path, "files": files, "checkpoints": t["checkpoints"],
            "excluded": len(data.excluded), "bw_reduction": t["bw_reduction"],
            "capacity_reduction": t["capacity_reduction"]}
