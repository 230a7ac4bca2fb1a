"""``python -m cnr bench tables``: per-table bit-widths from measured sensitivity, against one
width for every table (cnr.policy.table_plan).

Trains ``--config`` (default configs/accuracy.yaml, where ``bench accuracy`` checks the plan)
for its ``train.steps`` at world size 1, counting every lookup of every row. Then, for every
table and candidate width (2, 3, 4, 8), it quantizes the table's rows (adaptive row-wise, as a
checkpoint stores them) and measures the impact (lookup-weighted squared error, normalised by
all lookups of the run) and the bytes of a full checkpoint's rows. ``--bits B``: the width the
failure budget chose; the plan is the cheapest set of widths whose total impact is at most
``--impact-fraction`` (default 1) of that of B for every table. Prints the plan as ``table_bits`` (for ``--set
checkpoint.table_bits=...``, with ``checkpoint.table_plan_width=B``: under the failure policy it
applies while the budget chooses B), its bytes and impact against every uniform width, and per table
its rows, share of lookups, impact per width and chosen width.
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch

from cnr.bench.common import ROOT, argv_list, base_parser, number_arg, table_rows
from cnr.app.config import Config, load_config
from cnr.app.data import make_reader, to_device
from cnr.errors import ConfigError
from cnr.app.launch import launch
from cnr.app.parallel import build_sharded_model, train_step
from cnr.codec.quant.quantize import dequantize_rows, quantize_rows
from cnr.policy.table_plan import TableCosts, plan_for_width, totals, uniform

WIDTHS = (2, 3, 4, 8)
ACCURACY_CONFIG = f"{ROOT}/configs/accuracy.yaml"


def _measure(rank: int, world_size: int, arg: Dict[str, Any]) -> Dict[str, Any]:
    """Train, counting lookups; then per table and width: (impact numerator, bytes)."""
    config: Config = arg["config"]
    sharded = build_sharded_model(config, torch.device("cpu"))
    reader = make_reader(config, rank, world_size, None, split="train")
    table_of = {f: t.name for t in config.model.tables for f in t.features}
    counts = {t.name: torch.zeros(t.rows, dtype=torch.float64) for t in config.model.tables}
    for _ in range(config.train.steps):
        batch = reader.next_batch()
        for feature, jagged in batch.sparse.to_dict().items():
            ids = jagged.values().long()
            counts[table_of[feature]].index_add_(0, ids, torch.ones(ids.numel(), dtype=torch.float64))
        train_step(sharded, to_device(batch, torch.device("cpu")))
    lookups = float(sum(c.sum() for c in counts.values()))
    out: Dict[str, Any] = {}
    for t in config.model.tables:
        rows = table_rows(sharded, t.name)
        impact, nbytes = {}, {}
        for bits in arg["widths"]:
            q = quantize_rows(rows, bits, "adaptive", name=f"table {t.name}")
            squared = (rows.double() - dequantize_rows(q).double()).square().sum(1)
            impact[bits] = float((counts[t.name] * squared).sum()) / lookups
            nbytes[bits] = int(q.nbytes)
        out[t.name] = {"rows": t.rows, "lookup_share": float(counts[t.name].sum()) / lookups,
                       "impact": impact, "nbytes": nbytes}
    return out


def summarize(measured: Dict[str, Dict[str, Any]], bits: int, fraction: float = 1.0) -> Dict[str, Any]:
    """The plan at ``fraction`` of ``bits``' impact and how it compares with every uniform width (pure)."""
    # widths arrive as JSON keys (strings) from the rank
    tables = {n: TableCosts({int(b): v for b, v in m["impact"].items()}, {int(b): v for b, v in m["nbytes"].items()})
              for n, m in measured.items()}
    widths = sorted(next(iter(tables.values())).impact)
    plan = plan_for_width(tables, widths, bits, fraction)
    got, same = totals(tables, plan), uniform(tables, bits)
    return {
        "bits": bits,
        "impact_fraction": fraction,
        "table_bits": plan,
        "plan_bytes": int(got["nbytes"]), "plan_impact": got["impact"],
        "uniform": {str(b): {"bytes": int(uniform(tables, b)["nbytes"]), "impact": uniform(tables, b)["impact"]}
                    for b in widths},
        "bytes_saved_vs_uniform": round(1 - got["nbytes"] / same["nbytes"], 4),
        "impact_over_uniform": round(got["impact"] / same["impact"], 4) if same["impact"] else None,
        "widths_used": {str(b): sum(1 for v in plan.values() if v == b) for b in widths},
    }


def run(argv: List[str]) -> Dict[str, Any]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.set_defaults(config=ACCURACY_CONFIG)
    parser.add_argument("--bits", type=int, default=3, help="the uniform width to match (2, 3, 4, 8)")
    parser.add_argument("--impact-fraction", type=number_arg("bench tables: --impact-fraction", 0.0, 1.0), default=1.0,
                        help="the plan's budget: this fraction (0, 1] of the uniform width's impact")
    args = parser.parse_args(argv_list(argv))
    if args.bits not in WIDTHS:
        raise ConfigError(f"bench tables: --bits {args.bits} is not allowed; allowed: 2, 3, 4, 8")
    config = load_config(args.config, args.set)
    measured = launch(_measure, 1, {"config": config, "widths": list(WIDTHS)})
    summary = summarize(measured, args.bits, args.impact_fraction)
    for name, m in measured.items():
        m["chosen"] = summary["table_bits"][name]
    plan = "{" + ", ".join(f"{n}: {b}" for n, b in summary["table_bits"].items()) + "}"
    return {"bench": "tables", "config": args.config.rsplit("/", 1)[-1], "steps": config.train.steps,
            **summary, "set_table_bits": f"checkpoint.table_bits={plan}",
            "set_table_plan_width": f"checkpoint.table_plan_width={args.bits}", "tables": measured}
