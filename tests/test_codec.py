"""The codec seam (cnr.codec): registry, specs, the zstd and log8 codecs, and chunks whose
header chain is altered or hostile. Chunk framing itself is tested in test_encode."""

from __future__ import annotations

import dataclasses
import json
import struct
import zlib

import pytest
import torch
import zstandard

from cnr.codec import array_codec, array_encoding, bytes_codec, register
from cnr.codec.log8 import log8_applies, log8_codes, log8_values
from cnr.codec.spec import make_spec, spec_from_json, spec_to_json
from cnr.codec.zstd import zstd_spec
from cnr.codec.chunk_format import decode_chunk, encode_log8_chunk, encode_quantized_chunk, encode_raw_chunk
from cnr.errors import CorruptChunkError
from cnr.codec.quant.quantize import _bias_dtype, quantize_rows
from cnr.types import Encoding

ZSTD = (zstd_spec(3),)


def _header(blob: bytes):
    _, _, n = struct.unpack_from("<4sHI", blob, 0)
    return json.loads(blob[10:10 + n]), n


def _with_header(blob: bytes, ref, header: dict, payload: bytes = None):
    """``blob`` with ``header`` (and ``payload``, its CRC and size then recomputed), as a writer
    that means harm would produce it: every checksum consistent."""
    _, n = _header(blob)
    payload = blob[10 + n:] if payload is None else payload
    header = {**header, "payload_bytes": len(payload), "payload_crc32": zlib.crc32(payload)}
    raw = json.dumps(header).encode()
    new = blob[:4] + struct.pack("<HI", 3, len(raw)) + raw + payload
    return new, dataclasses.replace(ref, nbytes=len(new), crc32=header["payload_crc32"])


# --- registry and specs ---------------------------------------------------------------------

def test_the_registry_names_what_it_reads():
    assert array_encoding("rowwise") == Encoding.QUANTIZED and array_encoding("log8") == Encoding.LOG8
    assert array_codec("raw").name == "raw" and bytes_codec("zstd").name == "zstd"
    with pytest.raises(CorruptChunkError, match="array codec 'lz4' is not one this cnr reads: log8, raw, rowwise"):
        array_codec("lz4")
    with pytest.raises(CorruptChunkError, match="bytes codec 'raw' is not one this cnr reads: zstd"):
        bytes_codec("raw")  # an array codec is not a bytes codec
    with pytest.raises(ValueError, match="already registered"):
        register("zstd", "cnr.codec.zstd", "ZstdCodec", None)


@pytest.mark.parametrize("obj,message", [
    ({"level": 3}, "string 'name'"),
    ({"name": "zstd", "level": 3.0}, "not an int or a string"),
    ({"name": "zstd", "level": True}, "not an int or a string"),
    ("zstd", "string 'name'"),
])
def test_spec_json_is_strict(obj, message):
    with pytest.raises(CorruptChunkError, match=message):
        spec_from_json(obj, "here")


def test_specs_are_canonical_and_round_trip():
    a, b = make_spec("rowwise", bits=2, method="adaptive"), make_spec("rowwise", method="adaptive", bits=2)
    assert a == b and hash(a) == hash(b)
    assert spec_from_json(spec_to_json(a), "here") == a
    with pytest.raises(ValueError, match="zstd level 0"):
        zstd_spec(0)


# --- zstd -----------------------------------------------------------------------------------

@pytest.mark.parametrize("make", [
    lambda c: encode_raw_chunk("k", "t", torch.randn(50, 8), 0, 0, compression=c),
    lambda c: encode_raw_chunk("k", "t", torch.arange(40, dtype=torch.int64), 0, 0,
                               row_ids=torch.arange(0, 400, 10), compression=c),
    lambda c: encode_quantized_chunk("k", "t", quantize_rows(torch.randn(30, 16), 2), 7, 0,
                                     row_ids=torch.tensor(sorted(set(range(0, 90, 3)))), compression=c),
    lambda c: encode_log8_chunk("k", "t", torch.rand(64) * (torch.rand(64) > 0.5), 0, 0, compression=c),
])
def test_zstd_is_lossless_on_every_array_codec(make):
    torch.manual_seed(0)
    plain_blob, plain_ref = make(())
    torch.manual_seed(0)  # the same values again
    blob, ref = make(ZSTD)
    assert ref.codecs == plain_ref.codecs + ZSTD and ref.encoding == plain_ref.encoding
    plain, packed = decode_chunk(plain_blob, plain_ref, dequantize=False), decode_chunk(blob, ref, dequantize=False)
    for field in ("data", "row_ids"):
        a, b = getattr(plain, field), getattr(packed, field)
        assert (a is None and b is None) or torch.equal(a, b)
    if plain.quantized is not None:
        assert torch.equal(plain.quantized.codes, packed.quantized.codes)


def test_zstd_shrinks_what_repeats():
    blob, ref = encode_raw_chunk("k", "t", torch.zeros(1000, 16), 0, 0, compression=ZSTD)
    assert ref.nbytes < 1000 * 16 * 4 / 100


def test_a_zstd_frame_claiming_another_size_is_refused():
    blob, ref = encode_raw_chunk("k", "t", torch.zeros(100, 4), 0, 0, compression=ZSTD)
    header, _ = _header(blob)
    bomb = zstandard.ZstdCompressor().compress(b"\0" * 10_000_000)  # 10 MB from a few hundred bytes
    with pytest.raises(CorruptChunkError, match="declares 10000000 bytes, the header says 1600"):
        decode_chunk(*_with_header(blob, ref, header, bomb))
    with pytest.raises(CorruptChunkError, match="does not declare its size"):
        decode_chunk(*_with_header(blob, ref, header, b"\x28\xb5\x2f\xfd" + b"\x01" * 20))
    frame = zstandard.ZstdCompressor(write_content_size=True).compress(bytes(range(256)) * 6 + bytes(64))
    broken = frame[:-8] + bytes(8)  # the declared size is right, the blocks are not
    with pytest.raises(CorruptChunkError, match="does not decompress|decompresses to"):
        decode_chunk(*_with_header(blob, ref, header, broken))


@pytest.mark.parametrize("codecs,message", [
    ([{"name": "raw"}, {"name": "zstd", "level": 3}, {"name": "zstd", "level": 3}], "lists 3 codecs"),
    ([{"name": "zstd", "level": 3}], "array codec 'zstd' is not one"),
    ([{"name": "raw", "extra": 1}], "has parameters"),
    ([{"name": "raw"}, {"name": "zstd", "level": 99}], "level=99 is not allowed"),
    ([{"name": "rowwise", "bits": 2, "method": "adaptive", "scale": "float16", "bias": "float16"}],
     "quantized rows must be float32 of shape"),
    ([{"name": "log8", "lo": 5, "hi": 5}], "log8 grid lo=5 hi=5"),
    ([], "lists 0 codecs"),
])
def test_hostile_codec_chains_are_refused_before_any_payload_is_read(codecs, message):
    blob, ref = encode_raw_chunk("k", "t", torch.zeros(4, 2, dtype=torch.int64), 0, 0)
    header, _ = _header(blob)
    with pytest.raises(CorruptChunkError, match=message):
        decode_chunk(*_with_header(blob, ref, {**header, "codecs": codecs}))


def test_a_header_chain_that_differs_from_the_manifest_is_refused():
    blob, ref = encode_raw_chunk("k", "t", torch.zeros(4, 2), 0, 0, compression=ZSTD)
    with pytest.raises(CorruptChunkError, match="header codecs="):
        decode_chunk(blob, dataclasses.replace(ref, codecs=(ref.codecs[0], zstd_spec(9))))


# --- log8 -----------------------------------------------------------------------------------

@pytest.mark.parametrize("octaves", [0, 1, 10, 20, 44, 90])
def test_log8_error_is_within_its_bound_and_zero_stays_exact(octaves):
    g = torch.Generator().manual_seed(octaves)
    v = torch.exp2(torch.rand(5000, generator=g, dtype=torch.float64) * octaves - 7).float()
    v[::7] = 0.0
    codes, lo, hi = log8_codes(v)
    back = log8_values(codes, lo, hi)
    assert torch.equal(back[::7], v[::7]) and bool((codes[v > 0] > 0).all())
    bound = 2.0 ** ((hi - lo) / 254 / 32) - 1
    rel = ((back - v).abs() / v.clamp_min(1e-38))[v > 0]
    assert float(rel.max()) <= bound * 1.0001 + 2e-7, (float(rel.max()), bound)
    assert bool((torch.diff(back[torch.argsort(v)]) >= 0).all())  # order is kept


def test_log8_takes_only_what_it_can_code():
    assert log8_applies(torch.tensor([0.0, 1e-30, 3.0]))
    for bad in (torch.tensor([1.0, -1e-9]), torch.tensor([float("inf")]), torch.ones(2, 2),
                torch.ones(3, dtype=torch.float64)):
        assert not log8_applies(bad)
    with pytest.raises(ValueError, match="only 1-D float32 values"):
        log8_codes(torch.tensor([1.0, -1.0]))
    codes, lo, hi = log8_codes(torch.zeros(5))
    assert not bool(codes.any()) and lo < hi


def test_a_log8_chunk_is_one_byte_per_row():
    v = torch.rand(10_000)
    blob, ref = encode_log8_chunk("k", "t", v, 0, 0)
    assert ref.encoding == Encoding.LOG8 and (ref.bits, ref.method) == (8, "log8")
    assert 10_000 <= ref.nbytes < 10_000 + 400


# --- float16 bias -----------------------------------------------------------------------------

@pytest.mark.parametrize("rows,bits,dtype", [
    (torch.randn(100, 64), 2, torch.float16),
    (torch.randn(100, 64), 4, torch.float16),
    (torch.randn(100, 64), 8, torch.float32),  # 8 bits: 2 bytes are 3% of a row, the error is not
    (torch.randn(100, 64) * 2 + 20, 2, torch.float16),  # step ~3: the rounding (~0.012) is < 1/128 of it
    (torch.randn(100, 64) + 20, 4, torch.float32),  # step 0.4: it is not
    (torch.full((3, 8), 0.5), 2, torch.float16),  # constant, exact in float16
    (torch.full((3, 8), 0.1), 2, torch.float32),  # constant, not exact: stays exact in float32
    (torch.randn(10, 8) * 1e5, 2, torch.float32),  # beyond float16's range
    (torch.rand(100, 64) * 2e-3 - 1e-3, 2, torch.float16),  # torchrec's init of a 1M-row table
])
def test_bias_precision_rule(rows, bits, dtype):
    assert _bias_dtype(bits, rows.amin(1), rows.amax(1)) == dtype
    q = quantize_rows(rows, bits)
    assert q.bias.dtype == dtype
    if dtype == torch.float32 and bool((rows.amin(1) == rows.amax(1)).all()):
        assert torch.equal(q.bias, rows[:, 0])  # constant rows round-trip exactly


def test_float16_bias_costs_no_measurable_error():
    """The grid shift is bounded by step / 64: the l2 error per row stays within 1% of fp32 bias."""
    from cnr.codec.quant.quantize import l2_per_row, quantize_rows_with_dtypes

    x = torch.randn(2000, 64, generator=torch.Generator().manual_seed(0)) * 0.05
    for bits in (2, 3, 4):
        half = l2_per_row(x, quantize_rows(x, bits)).mean()
        full = l2_per_row(x, quantize_rows_with_dtypes(x, bits, "adaptive", bias_dtype=torch.float32)).mean()
        assert float(half) <= float(full) * 1.01, (bits, float(half), float(full))


def test_zstd_decodes_after_a_damaged_payload_on_the_same_thread_and_on_others():
    """The decompressor is reused per thread: a payload that failed leaves it able to decode the
    next one, and threads decoding at once each get the right bytes."""
    import threading

    codec = bytes_codec("zstd")
    payloads = [bytes([i]) * 5000 + b"tail" * i for i in range(8)]
    encoded = [codec.encode(ZSTD[0], p) for p in payloads]
    bad = bytearray(encoded[0])
    bad[len(bad) // 2] ^= 0xFF
    with pytest.raises(CorruptChunkError, match="does not decompress"):
        codec.decode(ZSTD[0], memoryview(bytes(bad)), len(payloads[0]), "chunk 'k'")
    assert codec.decode(ZSTD[0], memoryview(encoded[0]), len(payloads[0]), "chunk 'k'") == payloads[0]
    got: dict = {}

    def decode_all(t: int) -> None:
        got[t] = [codec.decode(ZSTD[0], memoryview(e), len(p), "chunk 'k'") for e, p in zip(encoded, payloads)]

    threads = [threading.Thread(target=decode_all, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(got[t] == payloads for t in range(4))


def test_zstd_frame_that_holds_more_than_it_declares_is_refused():
    """A frame whose header declares the chunk's size but whose content runs on is damaged:
    the reader reads past the declared size to find out, and refuses it."""
    codec = bytes_codec("zstd")
    data = bytes(range(256)) + b"xyz" * 20  # 316 bytes: a 2-byte content size field, 316 - 256
    frame = bytearray(codec.encode(ZSTD[0], data))
    field = frame.index(bytes([316 - 256, 0]), 4)  # after the magic number and the descriptor
    frame[field] -= 1
    assert zstandard.get_frame_parameters(bytes(frame)).content_size == 315
    with pytest.raises(CorruptChunkError, match="decompresses to more than 315 bytes|does not decompress"):
        codec.decode(ZSTD[0], memoryview(bytes(frame)), 315, "chunk 'k'")
    short = codec.encode(ZSTD[0], data[:300])
    with pytest.raises(CorruptChunkError, match="declares 300 bytes, the header says 316"):
        codec.decode(ZSTD[0], memoryview(short), 316, "chunk 'k'")


@pytest.mark.parametrize("compression", [(), ZSTD], ids=["raw", "zstd"])
def test_decoded_rows_are_writable_and_never_alias_the_stored_blob(compression):
    """A zstd chunk's decoded codes, scales and biases are views of the buffer zstd decoded into
    (no second copy); a chunk without a bytes stage is copied out of the blob, even a writable
    one, so writing into decoded rows (a restore's merge does) never changes stored bytes."""
    x = torch.randn(300, 64, generator=torch.Generator().manual_seed(1))
    q = quantize_rows(x, 2)
    blob, ref = encode_quantized_chunk("k", "t", q, 0, 0, compression=compression)
    stored = bytearray(blob)
    got = decode_chunk(stored, ref, dequantize=False).quantized
    assert torch.equal(got.codes, q.codes) and torch.equal(got.scale, q.scale) and torch.equal(got.bias, q.bias)
    def adjacent(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.data_ptr() + a.numel() * a.element_size() == b.data_ptr()

    in_one_buffer = adjacent(got.codes, got.scale) and adjacent(got.scale, got.bias)
    assert in_one_buffer == bool(compression)  # views of the decoded payload, or three copies
    got.codes.fill_(0)
    got.scale.fill_(0)
    assert bytes(stored) == blob
    again = decode_chunk(stored, ref, dequantize=False).quantized
    assert torch.equal(again.codes, q.codes) and torch.equal(again.scale, q.scale)


@pytest.mark.parametrize("offset, writable, view", [(0, True, True), (8, True, True), (1, True, False),
                                                    (0, False, False), (3, False, False)])
def test_take_views_only_an_aligned_writable_buffer(offset, writable, view):
    """``take`` returns a view of a writable buffer when the values are aligned for their dtype,
    else a copy; the values are the same either way."""
    from cnr.codec.base import take

    values = torch.arange(5, dtype=torch.int64) * 1000 + 7
    raw = bytearray(offset) + bytearray(values.numpy().tobytes()) + bytearray(4)
    buf = torch.frombuffer(raw, dtype=torch.uint8)  # the bytearray's memory: 16-byte aligned (CPython)
    data = memoryview(buf.numpy()) if writable else memoryview(bytes(raw))
    got, end = take(data, offset, 5, torch.int64, "chunk 'k'")
    assert torch.equal(got, values) and end == offset + 40
    assert (got.data_ptr() == buf.data_ptr() + offset) == view
    with pytest.raises(CorruptChunkError, match="too short"):
        take(data, offset, 6, torch.int64, "chunk 'k'")


def test_an_id_bitmap_decoded_once_serves_every_chunk_that_stores_it():
    """With an ids memo (one object's decode), chunks whose id bitmaps are byte-identical (a
    table's weight and its optimizer state in one increment) share one decoded ids tensor, equal
    to each one's own decode; the same bits at another first row, or another bitmap, decode anew."""
    ids = torch.tensor([3, 4, 9, 100, 101, 250], dtype=torch.int64)
    weight = encode_quantized_chunk("k", "t.weight", quantize_rows(torch.randn(6, 8), 2), 0, 0, ids, ZSTD)
    state = encode_raw_chunk("k", "t.momentum1", torch.rand(6), 0, 0, ids, ZSTD)
    other = encode_raw_chunk("k", "t.momentum1", torch.rand(6), 0, 0, ids + 1, ZSTD)
    changed = ids.clone()
    changed[1] = 5
    shifted = encode_raw_chunk("k", "u.momentum1", torch.rand(6), 0, 0, changed, ZSTD)
    memo: dict = {}
    got = [decode_chunk(blob, ref, dequantize=False, ids_memo=memo) for blob, ref in (weight, state, other, shifted)]
    alone = [decode_chunk(blob, ref, dequantize=False) for blob, ref in (weight, state, other, shifted)]
    for g, a, want in zip(got, alone, (ids, ids, ids + 1, changed)):
        assert torch.equal(g.row_ids, want) and torch.equal(a.row_ids, want)
    assert got[1].row_ids is got[0].row_ids
    assert got[2].row_ids is not got[0].row_ids and got[3].row_ids is not got[0].row_ids
    assert len(memo) == 3


def test_zstd_decode_takes_every_byte_of_a_reader_that_fills_in_parts(monkeypatch):
    """A stream reader may fill less than the buffer at once; the decode reads on until the
    frame's end rather than taking a short read for a damaged payload."""
    codec = bytes_codec("zstd")
    data = bytes(range(256)) * 40
    frame = codec.encode(ZSTD[0], data)

    class Piecewise:
        def __init__(self, reader):
            self._reader = reader

        def __enter__(self):
            self._reader.__enter__()
            return self

        def __exit__(self, *exc):
            return self._reader.__exit__(*exc)

        def readinto(self, buf):
            return self._reader.readinto(memoryview(buf)[:1000])

        def read(self, n):
            return self._reader.read(n)

    class Decompressor:
        def stream_reader(self, source, **kw):
            return Piecewise(zstandard.ZstdDecompressor().stream_reader(source, **kw))

    monkeypatch.setattr(codec._local, "decompressor", Decompressor(), raising=False)
    assert bytes(codec.decode(ZSTD[0], memoryview(frame), len(data), "chunk 'k'")) == data
