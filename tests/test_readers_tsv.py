"""TsvReader: parsing, file boundaries, cursor/world-size protocol, malformed lines, exhaustion."""

from __future__ import annotations

import json
import math
import os
import random
import re
from typing import Dict, List, Tuple

import numpy as np
import pytest
import torch

from cnr.errors import ConfigError
from cnr.readers import Batch, DataExhaustedError, MalformedDataError, TsvReader

FEATURES = [("f0", 7), ("f1", 1000), ("f2", 2 ** 40)]
D = 3
B = 10
SIZES = (43, 0, 35, 27)  # lines per file; an empty file in the middle; 105 lines in all


def random_line(rnd: random.Random) -> str:
    dense = [rnd.choice(["", "0", "-3", str(rnd.randint(0, 10 ** 6)), str(rnd.randint(-9, 9))])
             for _ in range(D)]
    cats = [rnd.choice(["", "%08x" % rnd.getrandbits(32), "%X" % rnd.getrandbits(20),
                        "%x" % rnd.getrandbits(60), "%x" % rnd.getrandbits(90)])
            for _ in FEATURES]
    return "\t".join([rnd.choice("01")] + dense + cats)


def expected(line: str) -> Tuple[List[int], List[float], float]:
    """Reference parse with Python ints: (ids per feature, dense, label)."""
    fields = line.split("\t")
    dense = [math.log1p(max(int(x) if x else 0, 0)) for x in fields[1:1 + D]]
    ids = [int(h, 16) % rows if h else 0 for h, (_, rows) in zip(fields[1 + D:], FEATURES)]
    return ids, dense, float(fields[0])


@pytest.fixture
def data(tmp_path):
    """Three non-empty files (plus an empty one) of random valid lines; returns (paths, lines)."""
    rnd = random.Random(5)
    paths, lines = [], []
    for i, n in enumerate(SIZES):
        file_lines = [random_line(rnd) for _ in range(n)]
        path = tmp_path / f"day_{i}.tsv"
        path.write_text("".join(line + "\n" for line in file_lines))
        paths.append(str(path))
        lines += file_lines
    return paths, lines


def reader(paths, rank=0, world_size=1, cursor=None, **kw) -> TsvReader:
    return TsvReader(paths, FEATURES, D, B, rank, world_size, cursor, **kw)


def read_all(r: TsvReader) -> List[Batch]:
    """Batches until DataExhaustedError; bounded so a reader that never ends fails fast."""
    out = []
    for _ in range(len(SIZES) * 50):
        try:
            out.append(r.next_batch())
        except DataExhaustedError:
            return out
    raise AssertionError("the reader did not run out of data")


def check_batch(batch: Batch, lines: List[str]) -> None:
    """``batch`` holds global batch g = sample_ids[0] // B, i.e. ``lines[g*B:(g+1)*B]``."""
    g = int(batch.sample_ids[0]) // B
    assert torch.equal(batch.sample_ids, torch.arange(g * B, (g + 1) * B))
    want = [expected(line) for line in lines[g * B:(g + 1) * B]]
    assert batch.sparse.keys() == [n for n, _ in FEATURES]
    assert bool((batch.sparse.lengths() == 1).all())
    for f, (name, _) in enumerate(FEATURES):
        assert batch.sparse[name].values().tolist() == [w[0][f] for w in want]
    np.testing.assert_allclose(batch.dense.numpy(), np.array([w[1] for w in want]), rtol=1e-6)
    assert batch.dense.dtype == torch.float32
    assert batch.labels.tolist() == [w[2] for w in want]


def test_parse_whole_stream_across_file_boundaries(data):
    paths, lines = data
    batches = read_all(reader(paths))
    assert len(batches) == len(lines) // B  # the trailing partial batch is dropped
    for batch in batches:
        check_batch(batch, lines)
    # Global batch 4 = lines 40..49 spans day_0 (43 lines), the empty day_1 and day_2.
    assert int(batches[4].sample_ids[0]) == 40


def test_parse_details(tmp_path):
    path = tmp_path / "x.tsv"
    path.write_bytes(b"1\t\t-5\t12\t\t00000010\tFFFFFFFFFFFFFFFFFFFFFFFF\r\n"
                     b"0\t7\t0\t\tA\t\t10000000000")  # CRLF, then a last line without newline
    batch = TsvReader([str(path)], FEATURES, D, 2, 0, 1).next_batch()
    assert batch.labels.tolist() == [1.0, 0.0]
    assert batch.sparse["f0"].values().tolist() == [0, 10 % 7]
    assert batch.sparse["f1"].values().tolist() == [16, 0]
    assert batch.sparse["f2"].values().tolist() == [(16 ** 24 - 1) % 2 ** 40, 16 ** 10 % 2 ** 40]
    np.testing.assert_allclose(batch.dense.numpy(), np.log1p([[0, 0, 12], [7, 0, 0]]))


def test_exhaustion_error_leaves_cursor_unchanged(data):
    paths, lines = data
    r = reader(paths)
    read_all(r)
    before = r.cursor()
    with pytest.raises(DataExhaustedError) as info:
        r.next_batch()
    msg = str(info.value)
    assert "global batch 10" in msg and "10 samples per batch" in msg and "105" in msg
    assert r.cursor() == before
    with pytest.raises(DataExhaustedError):
        r.next_batch()


def test_two_ranks_partition_the_stream(data):
    paths, lines = data
    seen: Dict[int, Batch] = {}
    for rank in range(2):
        for step, batch in enumerate(read_all(reader(paths, rank, 2))):
            g = int(batch.sample_ids[0]) // B
            assert g == rank + 2 * step and g not in seen
            seen[g] = batch
            check_batch(batch, lines)
    assert sorted(seen) == list(range(10))


def line_start(sizes_lines: List[List[str]], sample: int) -> Tuple[int, int]:
    """(file index, byte offset) of global sample ``sample`` (files given as their lines)."""
    for i, file_lines in enumerate(sizes_lines):
        if sample < len(file_lines):
            return i, sum(len(x) + 1 for x in file_lines[:sample])
        sample -= len(file_lines)
    return len(sizes_lines), 0


@pytest.mark.parametrize("w_before,k,w_after", [(1, 3, 1), (2, 2, 2), (2, 2, 1), (1, 3, 2),
                                                (3, 1, 2), (2, 4, 3)])
def test_resume_from_rank0_cursor(data, w_before, k, w_after):
    paths, lines = data
    per_file, start = [], 0
    for n in SIZES:
        per_file.append(lines[start:start + n])
        start += n
    got: List[int] = []
    readers = [reader(paths, r, w_before) for r in range(w_before)]
    for _ in range(k):
        for r in readers:
            batch = r.next_batch()
            check_batch(batch, lines)
            got.append(int(batch.sample_ids[0]) // B)
    cursors = [json.loads(json.dumps(r.cursor())) for r in readers]
    assert all(c == cursors[0] for c in cursors)
    cursor = cursors[0]
    assert cursor["next_batch"] == k * w_before
    assert (cursor["file"], cursor["offset"]) == line_start(per_file, k * w_before * B)
    for r in range(w_after):
        for batch in read_all(reader(paths, r, w_after, cursor)):
            check_batch(batch, lines)
            got.append(int(batch.sample_ids[0]) // B)
    assert sorted(got) == list(range(10))  # every complete global batch exactly once


def test_cursor_is_a_pure_getter(data):
    paths, lines = data
    r, ref = reader(paths, 1, 2), reader(paths, 1, 2)
    r.next_batch()
    ref.next_batch()
    assert r.cursor() == r.cursor()
    assert torch.equal(r.next_batch().sample_ids, ref.next_batch().sample_ids)


MALFORMED = [
    ("1\t2\t3\t4\t5\t6", "has 6 tab-separated fields, expected 7"),
    ("1\t2\t3\t4\t5\t6\t7\t8", "has 8 tab-separated fields"),
    ("", "has 1 tab-separated fields"),
    ("2\t1\t2\t3\ta\tb\tc", "label b'2' is not 0 or 1"),
    ("\t1\t2\t3\ta\tb\tc", "label b'' is not 0 or 1"),
    ("01\t1\t2\t3\ta\tb\tc", "label b'01'"),
    ("1\t1.5\t2\t3\ta\tb\tc", "dense column I1 value b'1.5'"),
    ("1\t1\tx\t3\ta\tb\tc", "dense column I2 value b'x'"),
    ("1\t1\t2\t-\ta\tb\tc", "dense column I3 value b'-'"),
    ("1\t1\t2\t3-4\ta\tb\tc", "dense column I3 value b'3-4'"),
    ("1\t--3\t2\t3\ta\tb\tc", "dense column I1 value b'--3'"),
    ("1\t+3\t2\t3\ta\tb\tc", "dense column I1 value b'+3'"),
    ("1\t 3\t2\t3\ta\tb\tc", "dense column I1 value b' 3'"),
    ("1\t" + "0" * 400 + "\t2\t3\ta\tb\tc", "dense column I1 value is longer than 308"),
    ("1\t1\t2\t3\tg\tb\tc", "categorical column C1 (feature 'f0') value b'g'"),
    ("1\t1\t2\t3\ta\t0x1f\tc", "categorical column C2 (feature 'f1') value b'0x1f'"),
    ("1\t1\t2\t3\ta\tb\tc_d", "categorical column C3 (feature 'f2') value b'c_d'"),
]


@pytest.mark.parametrize("bad,needle", MALFORMED)
def test_malformed_line_rejected_with_file_and_line(data, bad, needle):
    paths, lines = data
    # Line 8 of day_2.tsv is global sample 43 + 7 = 50: batch 5, read by rank 1 of 2.
    file_lines = lines[43:78]
    file_lines[7] = bad
    with open(paths[2], "w") as f:
        f.write("".join(x + "\n" for x in file_lines))
    owner = reader(paths, 1, 2)
    for _ in range(2):
        check_batch(owner.next_batch(), lines)  # batches 1 and 3 are clean
    with pytest.raises(MalformedDataError) as info:
        owner.next_batch()
    msg = str(info.value)
    assert paths[2] in msg and "line 8 " in msg and needle in msg
    # Rank 0 only counts the lines of rank 1's batches, so it is not stopped by them.
    assert len(read_all(reader(paths, 0, 2))) == 5


def test_skip_mode_counts_and_renumbers(data):
    paths, lines = data
    # file index -> line indices replaced by malformed lines; the last one lies in the tail
    # that the final, failing next_batch scans: a failed call must leave the count unchanged.
    bad_at = {0: [0, 20], 2: [34], 3: [26]}
    valid = []
    for i, (path, n) in enumerate(zip(paths, SIZES)):
        with open(path) as f:
            file_lines = f.read().splitlines()
        for j in bad_at.get(i, []):
            file_lines[j] = MALFORMED[j % len(MALFORMED)][0]
        valid += [x for j, x in enumerate(file_lines) if j not in bad_at.get(i, [])]
        with open(path, "w") as f:
            f.write("".join(x + "\n" for x in file_lines))
    r = reader(paths, on_malformed="skip")
    batches = read_all(r)
    assert r.skipped_lines == 3
    assert len(batches) == len(valid) // B == 10
    for batch in batches:
        check_batch(batch, valid)  # numbering counts valid lines only
    # Two ranks resumed mid-stream agree on the valid-line numbering too.
    first = reader(paths, 0, 2, on_malformed="skip")
    first.next_batch()
    got = []
    for rank in range(2):
        for batch in read_all(reader(paths, rank, 2, first.cursor(), on_malformed="skip")):
            check_batch(batch, valid)
            got.append(int(batch.sample_ids[0]) // B)
    assert sorted(got) == list(range(2, 10))
    with pytest.raises(MalformedDataError):
        read_all(reader(paths))  # the same files are rejected by default


STRICT = re.compile(r"[01]" + r"\t(-?[0-9]+)?" * D + r"\t[0-9a-fA-F]*" * len(FEATURES))


def test_fuzzed_lines_skip_exactly_the_invalid_ones(tmp_path):
    """Random single-character edits; the reader must keep exactly the lines the strict
    format accepts (checked against an independent regex) and parse those like Python ints."""
    rnd = random.Random(9)
    lines = []
    for _ in range(300):
        line = random_line(rnd)
        if rnd.random() < 0.5:
            at = rnd.randrange(len(line) + 1)
            edit = rnd.choice(["-", "x", " ", "\t", "+", "0", "g", ".", "F", "_", "\r", ""])
            line = line[:at] + edit + line[at + rnd.choice([0, 1]):]
        lines.append(line)
    path = tmp_path / "fuzz.tsv"
    path.write_text("".join(x + "\n" for x in lines))
    ok = [STRICT.fullmatch(x[:-1] if x.endswith("\r") else x) is not None for x in lines]
    valid = [x.rstrip("\r") for x, good in zip(lines, ok) if good]
    assert 60 < len(lines) - len(valid) < 200  # the edits did produce both kinds
    r = TsvReader([str(path)], FEATURES, D, B, 0, 1, on_malformed="skip")
    batches = read_all(r)
    assert len(batches) == len(valid) // B
    # Skipped: the invalid lines before the last valid line used (the failing call undoes its own).
    last_used = [i for i, good in enumerate(ok) if good][len(batches) * B - 1]
    assert r.skipped_lines == ok[:last_used].count(False)
    for batch in batches:
        check_batch(batch, valid)


def test_cursor_for_other_files_rejected(data, tmp_path):
    paths, lines = data
    r = reader(paths)
    r.next_batch()
    cursor = r.cursor()
    with pytest.raises(ConfigError, match="files"):
        reader(paths[:3], cursor=cursor)
    with open(paths[3], "a") as f:
        f.write(lines[0] + "\n")  # same names, different size
    with pytest.raises(ConfigError, match="day_3.tsv"):
        reader(paths, cursor=cursor)


BAD_CURSORS = [
    ({"kind": "synthetic"}, "cursor kind 'synthetic'"),
    ({"next_batch": -2}, "next_batch']=-2"),
    ({"file": 9}, "cursor['file']=9"),
    ({"offset": 10 ** 9}, "cursor['offset']=1000000000"),
    ({"offset": 3}, "not the start of a line"),
    ({"files": None}, "files None"),
]


@pytest.mark.parametrize("change,needle", BAD_CURSORS)
def test_bad_cursor_rejected(data, change, needle):
    paths, _ = data
    cursor = reader(paths).cursor()
    cursor.update(change)
    with pytest.raises(ConfigError) as info:
        reader(paths, cursor=cursor)
    assert needle in str(info.value)


def test_bad_arguments(data, tmp_path):
    paths, _ = data
    cases = [
        (lambda: reader(paths, on_malformed="warn"), "on_malformed='warn'"),
        (lambda: reader(paths, on_malformed="warn"), "['reject', 'skip']"),
        (lambda: reader([]), "paths=[]"),
        (lambda: reader([str(tmp_path / "missing.tsv")]), "missing.tsv"),
        (lambda: reader(paths, rank=2, world_size=2), "rank=2"),
        (lambda: TsvReader(paths, FEATURES, D, 0, 0, 1), "batch_size=0"),
    ]
    for make, needle in cases:
        with pytest.raises(ConfigError) as info:
            make()
        assert needle in str(info.value)
    assert os.path.exists(paths[0])
