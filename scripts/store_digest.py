"""Digest of what a checkpoint store holds, with the per-run values taken out.

A refactor that must not change what cnr stores (issue #40's "byte-identical") is checked by
running the same deterministic job before and after it and comparing the two digests:

    python scripts/store_digest.py DIR            # one line per object: sha256  normalized key
    python scripts/store_digest.py DIR --total    # one sha256 over all of them

Chunk objects are hashed as stored. JSON objects are hashed after normalizing what differs
between two runs of the same job: the random 8-hex suffix of checkpoint ids, the lineage id,
wall-clock fields, the node-local tier's folder, and the digests that cover those (a manifest's `sha256`, its `indexes`).
Lease records and the lineage record hold only such values and are left out.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
from typing import Any, Iterator, List, Tuple

_ID_SUFFIX = re.compile(r"(\d{10})-[0-9a-f]{8}")
_VOLATILE_KEYS = frozenset({"created_unix", "lineage", "sha256", "indexes", "written_unix", "local_dir",
                            "trigger_unix_us"})
_LEFT_OUT_TOP = ("lease/", "lineage/")


def _normalize(value: Any) -> Any:
    if isinstance(value, dict):
        return {
            _ID_SUFFIX.sub(r"\1-X", k): _normalize(v)
            for k, v in value.items()
            if k not in _VOLATILE_KEYS
        }
    if isinstance(value, list):
        return [_normalize(v) for v in value]
    if isinstance(value, str):
        return _ID_SUFFIX.sub(r"\1-X", value)
    return value


def _objects(root: str) -> Iterator[Tuple[str, str]]:
    for folder, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            yield os.path.relpath(path, root).replace(os.sep, "/"), path


def digest_lines(root: str) -> List[str]:
    """`sha256  key` per stored object, keys normalized, sorted by key."""
    lines = []
    for key, path in _objects(root):
        if key.startswith(_LEFT_OUT_TOP):
            continue
        with open(path, "rb") as f:
            data = f.read()
        if key.endswith(".json"):
            text = json.dumps(_normalize(json.loads(data)), sort_keys=True)
            data = text.encode()
        normalized_key = _ID_SUFFIX.sub(r"\1-X", key)
        lines.append(f"{hashlib.sha256(data).hexdigest()}  {normalized_key}")
    return sorted(lines, key=lambda line: line.split("  ", 1)[1])


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", help="a local checkpoint store (the --storage directory)")
    parser.add_argument("--total", action="store_true", help="print one digest over all objects")
    args = parser.parse_args(argv)
    lines = digest_lines(args.root)
    if not lines:
        print(f"no objects under {args.root!r}", file=sys.stderr)
        return 1
    if args.total:
        print(hashlib.sha256("\n".join(lines).encode()).hexdigest(), len(lines))
    else:
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
