"""Criteo-format TSV reader: ``label \\t I1..I<num_dense> \\t C1..C<num_features>`` per line.

The global sample stream is the lines of ``paths`` in order (files concatenated); see
``cnr.readers.batch`` for how global batches are split over ranks and resumed from a cursor.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Mapping, NoReturn, Optional, Sequence, Tuple

import numpy as np

from cnr.errors import ConfigError
from cnr.readers.batch import (
    Batch,
    DataExhaustedError,
    MalformedDataError,
    check_int,
    cursor_start,
    RawBatch,
    global_batch_index,
    to_batch,
    validate_common,
)
from cnr.readers.lines import LineSource, Position, line_number

ON_MALFORMED = ("reject", "skip")
_HEX = b"0123456789abcdefABCDEF"
_DEC = b"0123456789-"
# Byte-class and digit-value tables for the vectorised parser, indexed by byte value.
_IS_HEX = np.zeros(256, dtype=bool)
_IS_HEX[list(_HEX)] = True
_IS_HEX_OR_SEP = _IS_HEX.copy()
_IS_HEX_OR_SEP[[9, 10]] = True
_IS_DIGIT = np.zeros(256, dtype=bool)
_IS_DIGIT[list(b"0123456789")] = True
_IS_DENSE_OR_SEP = _IS_DIGIT.copy()
_IS_DENSE_OR_SEP[[9, 10, ord("-")]] = True
_IS_LABEL = np.zeros(256, dtype=bool)
_IS_LABEL[list(b"01")] = True
_DIGIT_VALUE = np.zeros(256, dtype=np.float64)
_DIGIT_VALUE[list(b"0123456789")] = np.arange(10)
_HEX_VALUE = np.zeros(256, dtype=np.float64)
_HEX_VALUE[list(b"0123456789abcdef")] = _HEX_VALUE[list(b"0123456789ABCDEF")] = np.arange(16)
# Longer dense values are malformed: this keeps every value (< 10^308) finite in float64.
_MAX_DENSE_CHARS = 308
_POW10 = 10.0 ** np.arange(_MAX_DENSE_CHARS)
_POW16 = np.append(16.0 ** np.arange(14), 0.0)  # the last entry zeroes digits 14+ from the right
_BLOCK = 8192  # lines validated at once in "skip" mode: bounds memory for large W * B


class TsvReader:
    """Finite reader of Criteo TSV files; see the module docstring and ``cnr.readers.batch``.

    Each line has ``1 + num_dense + len(features)`` tab-separated fields:

    - label: exactly ``0`` or ``1`` -> float32 0.0/1.0;
    - ``num_dense`` decimal integers (empty = 0, may be negative, at most 308 characters) ->
      ``log1p(max(x, 0))`` float32;
    - one hex string per feature, in ``features`` order (empty -> id 0) ->
      ``int(hex, 16) % table_rows`` of that feature, int64, one id per sample per feature.

    Lines end with ``\\n`` (a ``\\r`` before it is dropped). A trailing partial global batch is
    dropped; past the end :meth:`next_batch` raises ``DataExhaustedError``.
    Malformed lines (wrong field count, bad label, non-integer dense, non-hex categorical):
    ``on_malformed="reject"`` raises ``MalformedDataError`` naming path, 1-based line and problem;
    ``"skip"`` drops them (counted in :attr:`skipped_lines`) and sample numbering counts only
    valid lines. In "reject" mode lines of other ranks' batches are only counted, not parsed
    (their owner rejects them); in "skip" mode every rank validates every line it passes so
    all ranks agree on the numbering.
    """

    def __init__(
        self,
        paths: Sequence[str],
        features: Sequence[Tuple[str, int]],
        num_dense: int,
        batch_size: int,
        rank: int,
        world_size: int,
        cursor: Optional[Mapping[str, Any]] = None,
        *,
        on_malformed: str = "reject",
    ) -> None:
        self._features = validate_common(features, num_dense, batch_size, rank, world_size)
        if on_malformed not in ON_MALFORMED:
            raise ConfigError(f"on_malformed={on_malformed!r} is not allowed: it must be one of "
                              f"{list(ON_MALFORMED)}")
        if isinstance(paths, (str, bytes)) or not isinstance(paths, Sequence) or not paths:
            raise ConfigError(f"paths={paths!r} is not allowed: it must be a non-empty list of "
                              "TSV file paths")
        try:
            self._paths = [os.fspath(p) for p in paths]
        except TypeError:
            raise ConfigError(f"paths={paths!r} is not allowed: every entry must be a file "
                              "path") from None
        self._sizes: List[int] = []
        for p in self._paths:
            if not os.path.isfile(p):
                raise ConfigError(f"TSV path {p!r} is not allowed: it is not an existing file")
            self._sizes.append(os.path.getsize(p))
        self._pin = [[os.path.basename(p), s] for p, s in zip(self._paths, self._sizes)]
        self._num_dense = int(num_dense)
        self._batch_size = int(batch_size)
        self._rank = int(rank)
        self._world_size = int(world_size)
        self._skip_bad = on_malformed == "skip"
        self._ncols = 1 + self._num_dense + len(self._features)
        self._rows_u64 = np.array([r for _, r in self._features], dtype=np.uint64)[:, None]
        self._start = cursor_start(cursor, "tsv")
        self._group: Position = (0, 0) if cursor is None else self._check_cursor(cursor)
        self._read = 0  # batches this reader has returned
        self._skipped = 0
        self._src: Optional[LineSource] = None  # created on first next_batch

    def _check_cursor(self, cursor: Mapping[str, Any]) -> Position:
        """Validate the TSV-specific cursor keys; return the position it names."""
        missing = [k for k in ("file", "offset", "files") if k not in cursor]
        if missing:
            raise ConfigError(f"tsv cursor {dict(cursor)!r} is not allowed: missing keys {missing}")
        files = cursor["files"]
        if not isinstance(files, list) or len(files) != len(self._pin):
            raise ConfigError(f"tsv cursor files {files!r} are not allowed: this reader has "
                              f"{len(self._pin)} files; resume with the same file list")
        for i, (theirs, ours) in enumerate(zip(files, self._pin)):
            if not isinstance(theirs, (list, tuple)) or list(theirs) != ours:
                raise ConfigError(f"tsv cursor files[{i}]={theirs!r} is not allowed: this reader's "
                                  f"file {i} is {ours} ([basename, bytes]); resume with the same "
                                  "files, unchanged")
        n = len(self._paths)
        file = check_int("cursor['file']", cursor["file"], 0, n)
        size = self._sizes[file] if file < n else 0
        offset = check_int("cursor['offset']", cursor["offset"], 0, size)
        if 0 < offset < size:
            # A cheap check that the offset is a line start, not a position inside a line.
            with open(self._paths[file], "rb") as f:
                f.seek(offset - 1)
                if f.read(1) != b"\n":
                    raise ConfigError(f"cursor['offset']={offset} is not allowed: it is not the "
                                      f"start of a line in {self._paths[file]!r}")
        while file < n and offset >= self._sizes[file]:  # normalise as LineSource does
            file, offset = file + 1, 0
        return file, offset

    @property
    def features(self) -> Tuple[Tuple[str, int], ...]:
        """``(name, table_rows)`` pairs in KJT key order (= categorical column order)."""
        return self._features

    @property
    def skipped_lines(self) -> int:
        """Malformed lines this reader skipped (own and other ranks' batches) in "skip" mode."""
        return self._skipped

    def cursor(self) -> Dict[str, Any]:
        """Global stream position after k reads; no side effects.

        ``{"kind": "tsv", "next_batch": start + k*W, "file": i, "offset": o,
        "files": [[basename, bytes], ...]}``: global batch ``next_batch`` starts at byte ``o`` of
        file ``i`` (``(len(files), 0)`` once all data is scanned); ``files`` pins the file list.
        """
        return {
            "kind": "tsv",
            "next_batch": self._start + self._read * self._world_size,
            "file": self._group[0],
            "offset": self._group[1],
            "files": [list(x) for x in self._pin],
        }

    def close(self) -> None:
        """Close the open file, if any; a later next_batch reopens it."""
        if self._src is not None:
            self._src.close()
            self._src = None

    def __enter__(self) -> "TsvReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def next_batch(self) -> Batch:
        """This rank's next batch: global batch ``start + rank + k*world_size``.

        Raises DataExhaustedError (state unchanged) when that batch is not complete in the
        files, MalformedDataError on a malformed line of it in "reject" mode.
        """
        return to_batch([n for n, _ in self._features], self.next_raw())

    def next_raw(self) -> RawBatch:
        """:meth:`next_batch` as numpy arrays (no torch tensors, no KJT)."""
        g = global_batch_index(self._start, self._rank, self._world_size, self._read)
        b = self._batch_size
        src = self._source()
        skipped_before = self._skipped
        passed, _, _ = self._take(self._rank * b, keep=False)
        lines: List[bytes] = []
        where: List[Position] = []
        if passed == self._rank * b:
            _, lines, where = self._take(b, keep=True)
        if len(lines) < b:
            self._skipped = skipped_before
            self._exhausted(g, passed + len(lines))
        parsed = self._parse(lines)
        if parsed is None:
            self._skipped = skipped_before
            self._raise_first_problem(lines, where)
        # Scan past the other ranks' batches of this group so the cursor names the next group.
        self._take((self._world_size - 1 - self._rank) * b, keep=False)
        self._group = src.position
        self._read += 1
        ids, dense, labels = parsed
        return RawBatch(ids, 1, dense, labels, g)

    def skip_batch(self) -> None:
        """Move the cursor past this rank's next batch without parsing it.

        Another reader process of the same trainer rank reads that batch (``cnr.readers.tier``).
        Raises DataExhaustedError (state unchanged) when the batch is not complete in the files,
        exactly when :meth:`next_batch` would. In "skip" mode the lines are still validated, so
        the numbering of valid lines stays the same in every reader.
        """
        g = global_batch_index(self._start, self._rank, self._world_size, self._read)
        b = self._batch_size
        src = self._source()
        skipped_before = self._skipped
        passed, _, _ = self._take((self._rank + 1) * b, keep=False)
        if passed < (self._rank + 1) * b:
            self._skipped = skipped_before
            self._exhausted(g, passed)
        self._take((self._world_size - 1 - self._rank) * b, keep=False)
        self._group = src.position
        self._read += 1

    def _source(self) -> LineSource:
        """The line source, positioned at the start of the current group of global batches."""
        if self._src is None:
            self._src = LineSource(self._paths, self._sizes)
        if self._src.position != self._group:  # after an error the source may have moved on
            self._src.seek(*self._group)
        return self._src

    def _exhausted(self, g: int, passed: int) -> NoReturn:
        """Raise DataExhaustedError for global batch ``g``; ``passed``: samples of its group seen."""
        b = self._batch_size
        group_sample = (g - self._rank) * b
        raise DataExhaustedError(
            f"TSV data is exhausted at global batch {g} with {b} samples per batch: the "
            f"{len(self._paths)} file(s) hold {group_sample + passed} samples"
            f" (global batch {g} needs samples up to {(g + 1) * b - 1})")

    def _take(self, n: int, keep: bool) -> Tuple[int, List[bytes], List[Position]]:
        """Pass the next ``n`` samples; return (samples passed, their lines, their positions).

        Lines are returned only with ``keep``. In "reject" mode every line is a sample and
        unkept lines are not parsed. In "skip" mode lines are validated a block at a time with
        the vectorised parser; only a block that fails is checked line by line.
        """
        src = self._src
        assert src is not None
        if not keep and not self._skip_bad:
            done = 0
            while done < n and src.next_line() is not None:
                done += 1
            return done, [], []
        lines: List[bytes] = []
        where: List[Position] = []
        done = 0
        while done < n:
            block: List[bytes] = []
            block_where: List[Position] = []
            while len(block) < min(n - done, _BLOCK):
                item = src.next_line()
                if item is None:
                    break
                block.append(item[0])
                block_where.append((item[1], item[2]))
            if not block:
                break
            if self._skip_bad and self._parse(block) is None:
                good = [i for i, line in enumerate(block) if self._problem(line) is None]
                self._skipped += len(block) - len(good)
                block = [block[i] for i in good]
                block_where = [block_where[i] for i in good]
            done += len(block)
            if keep:
                lines += block
                where += block_where
        return done, lines, where

    def _problem(self, line: bytes) -> Optional[str]:
        """What is wrong with ``line``, or None if it is a valid record."""
        fields = line.split(b"\t")
        if len(fields) != self._ncols:
            return (f"has {len(fields)} tab-separated fields, expected {self._ncols} "
                    f"(label, {self._num_dense} dense, {len(self._features)} categorical)")
        if fields[0] not in (b"0", b"1"):
            return f"label {fields[0]!r} is not 0 or 1"
        for j in range(1, 1 + self._num_dense):
            x = fields[j]
            if not x:
                continue
            if len(x) > _MAX_DENSE_CHARS:
                return f"dense column I{j} value is longer than {_MAX_DENSE_CHARS} characters"
            try:
                if x.translate(None, _DEC):
                    raise ValueError(x)
                int(x)
            except ValueError:
                return f"dense column I{j} value {x!r} is not a decimal integer"
        for i, (name, _) in enumerate(self._features):
            x = fields[1 + self._num_dense + i]
            if x.translate(None, _HEX):
                return f"categorical column C{i + 1} (feature {name!r}) value {x!r} is not hex"
        return None

    def _parse(self, lines: List[bytes]) -> Optional[Tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Parse ``B`` lines at once with numpy; None if any line is malformed.

        Returns ids int64 ``[F, B]``, dense float32 ``[B, D]``, labels float32 ``[B]``.
        Accepts exactly the lines :meth:`_problem` accepts (the tests hold them to that).
        """
        c, d, b = self._ncols, self._num_dense, len(lines)
        buf = b"\n".join(lines) + b"\n"
        arr = np.frombuffer(buf, dtype=np.uint8)
        is_sep = (arr == 9) | (arr == 10)
        ends = np.flatnonzero(is_sep)  # exclusive end of every field, row-major [B, C]
        # b lines of c fields each: b*c separators, of which every c-th is the line's newline.
        if ends.size != b * c or not (arr[ends[c - 1::c]] == 10).all():
            return None
        starts = np.empty_like(ends)
        starts[0] = 0
        starts[1:] = ends[:-1] + 1
        lens = ends - starts
        label_at = starts[0::c]
        if (lens[0::c] != 1).any() or not _IS_LABEL[arr[label_at]].all():
            return None
        labels = (arr[label_at] - ord("0")).astype(np.float32)

        # Byte regions from +/- markers at their boundaries: 0 label, 1 dense, 2 categorical
        # (separators inside a region carry its number; byte-class checks allow for that).
        marks = np.zeros(arr.size, dtype=np.int8)
        marks[ends[0::c]] = 1  # the tab after the label
        marks[ends[d::c]] += 1  # the tab after the last dense field (the label's tab if d == 0)
        marks[ends[c - 1::c]] = -2  # the newline
        region = np.cumsum(marks, dtype=np.int8)
        field_of = np.cumsum(is_sep) - is_sep  # index of the field each byte belongs to

        dense_bytes = region == 1
        if not _IS_DENSE_OR_SEP[arr[dense_bytes]].all():
            return None
        minus = np.flatnonzero(dense_bytes & (arr == ord("-")))
        # '-' only as the first byte of a field and followed by a digit (not alone, not '--').
        if not ((starts[field_of[minus]] == minus).all() and _IS_DIGIT[arr[minus + 1]].all()):
            return None
        if (lens.reshape(b, c)[:, 1:1 + d] > _MAX_DENSE_CHARS).any():
            return None
        dense = np.zeros(b * c, dtype=np.float64)
        if d:
            at = np.flatnonzero(dense_bytes & _IS_DIGIT[arr])
            fields = field_of[at]
            # A field's value is the sum of its digits times 10^(position from the right).
            power = ends[fields] - at - 1
            dense = np.bincount(fields, weights=_DIGIT_VALUE[arr[at]] * _POW10[power],
                                minlength=b * c)
        raw = dense.reshape(b, c)[:, 1:1 + d]
        raw = np.where(arr[starts].reshape(b, c)[:, 1:1 + d] == ord("-"), -raw, raw)

        cat_bytes = region == 2
        if not _IS_HEX_OR_SEP[arr[cat_bytes]].all():
            return None
        at = np.flatnonzero(cat_bytes & _IS_HEX[arr])
        fields = field_of[at]
        # Hex digits are disjoint 4-bit fields: their sum is exact in float64 up to 13 digits;
        # longer cells (their digits beyond 13 weigh 0 here) are redone exactly below.
        power = np.minimum(ends[fields] - at - 1, _POW16.size - 1)
        values = np.bincount(fields, weights=_HEX_VALUE[arr[at]] * _POW16[power], minlength=b * c)
        values = values.reshape(b, c)[:, 1 + d:].T.astype(np.uint64)
        ids = (values % self._rows_u64).astype(np.int64)
        for row, feat in np.argwhere(lens.reshape(b, c)[:, 1 + d:] > 13):
            k = row * c + 1 + d + feat  # over 52 bits (rare; Criteo uses 8 digits): exact ints
            ids[feat, row] = int(buf[starts[k]:ends[k]], 16) % self._features[feat][1]
        dense = np.log1p(np.maximum(raw, 0.0)).astype(np.float32)
        return ids, dense, labels

    def _raise_first_problem(self, lines: List[bytes], where: List[Position]) -> NoReturn:
        for line, (file, offset) in zip(lines, where):
            problem = self._problem(line)
            if problem is not None:
                path = self._paths[file]
                raise MalformedDataError(f"malformed TSV line in {path!r} line "
                                         f"{line_number(path, offset)} (byte offset {offset}): "
                                         f"{problem}")
        raise AssertionError("batch parse failed but every line checks as valid")
