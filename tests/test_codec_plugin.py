"""The codec seam from outside: two codecs defined and registered only here (a bytes->bytes XOR
stage and a sign-flipping array codec) go through a real chunk encode/decode, the manifest's
chain check, the writer's per-chunk plan and the library's restore, without any file of cnr/
knowing them. A codec is one class plus one ``register`` call."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Tuple

import pytest
import torch

from cnr.codec import array_codec, bytes_codec, register, unregister
from cnr.codec.base import (
    DTYPES, ArrayCodec, BytesCodec, DecodedValues, Encoded, Target, ValuesShape, numel, take, tensor_bytes,
    values_shape,
)
from cnr.codec.chunk_format import decode_chunk, encode_chunk, stored_payload
from cnr.codec.spec import make_spec, require_params
from cnr.codec.zstd import zstd_spec
from cnr.errors import CheckpointError, CorruptChunkError
from cnr.format.manifest import Manifest, manifest_to_bytes, parse_manifest
from cnr.restore.chain import restore_chain
from cnr.storage.local import LocalStorage
from cnr.track.snapshot import HostPiece
from cnr.track.state import StatePiece
from cnr.types import CheckpointKind, CodecSpec, Encoding, Role, ShardRegion
from cnr.write.job import CodecPlan, WriteJob
from cnr.write.plan import encode_block
from cnr.write.puts import Uploader
from cnr.write.writer_process import write_rank_data


class XorCodec(BytesCodec):
    """bytes->bytes: every byte XOR ``key`` (1..255)."""

    name = "xor"

    def check(self, spec: CodecSpec, where: str) -> None:
        require_params(spec, {"key": tuple(range(1, 256))}, where)

    def encode(self, spec: CodecSpec, data: bytes) -> bytes:
        key = dict(spec.params)["key"]
        return bytes(b ^ key for b in data)

    def decode(self, spec: CodecSpec, data: memoryview, size: int, where: str) -> bytes:
        if len(data) != size:
            raise CorruptChunkError(f"{where} xor payload has {len(data)} bytes, the header says {size}")
        return self.encode(spec, bytes(data))


class SignFlipCodec(ArrayCodec):
    """array->bytes, lossless: float32 values stored negated. The writer's plan gives it what it
    would store exactly (32 bits); it is compressible, so a job's bytes stage runs over it."""

    name = "signflip"
    encoding = Encoding.RAW

    def encode(self, values: Any, target: Optional[Target] = None) -> Optional[Encoded]:
        if values.dtype != torch.float32 or (target is not None and target.bits != 32):
            return None
        return Encoded(make_spec("signflip"), values_shape(values), [tensor_bytes(-values)])

    def check(self, spec: CodecSpec, shape: ValuesShape, where: str) -> Dict[str, Any]:
        if shape.dtype != "float32":
            raise CorruptChunkError(f"{where} signflip values must be float32")
        return require_params(spec, {}, where)

    def value_bytes(self, spec: CodecSpec, shape: ValuesShape) -> int:
        return numel(shape) * DTYPES[shape.dtype].itemsize

    def decode(self, spec: CodecSpec, shape: ValuesShape, data: memoryview, where: str,
               reference: Optional[torch.Tensor] = None) -> DecodedValues:
        assert reference is None  # a delta codec would read it; cnr passes none today
        values, _ = take(data, 0, numel(shape), torch.float32, where)
        return DecodedValues(data=(-values).reshape((shape.rows,) + shape.row_shape))

    def summary(self, spec: CodecSpec, dtype: str) -> Tuple[int, str]:
        return 32, ""


XOR = make_spec("xor", key=0x5A)


@pytest.fixture
def plugins():
    """Both codecs registered for one test, the sign flip tried first by the writer's plan."""
    register("xor", __name__, "XorCodec", None)
    register("signflip", __name__, "SignFlipCodec", Encoding.RAW, plan=1)
    try:
        yield
    finally:
        unregister("xor")
        unregister("signflip")


def test_plugins_round_trip_through_a_chunk(plugins):
    x = torch.randn(40, 6)
    ids = torch.arange(0, 80, 2)
    blob, ref = encode_chunk("k", "t", array_codec("signflip").encode(x), 0, 3, row_ids=ids, compression=(XOR,))
    assert [s.name for s in ref.codecs] == ["signflip", "xor"] and ref.encoding == Encoding.RAW
    plain, _ = encode_chunk("k", "t", array_codec("signflip").encode(x), 0, 3, row_ids=ids)
    assert bytes(stored_payload(blob)) == bytes(b ^ 0x5A for b in stored_payload(plain))
    chunk = decode_chunk(blob, ref)
    assert torch.equal(chunk.data, x) and torch.equal(chunk.row_ids, ids)
    assert bytes_codec("xor").name == "xor"
    with pytest.raises(CorruptChunkError, match="codecs"):  # the manifest must name the header's chain
        decode_chunk(blob, dataclasses.replace(ref, codecs=(ref.codecs[0], make_spec("xor", key=7))))


def test_a_chain_takes_one_bytes_stage(plugins):
    x = torch.randn(4, 2)
    with pytest.raises(ValueError, match="at most 1 bytes->bytes stage"):
        encode_chunk("k", "t", array_codec("signflip").encode(x), 0, 0, compression=(XOR, zstd_spec()))
    blob, ref = encode_chunk("k", "t", array_codec("signflip").encode(x), 0, 0, compression=(zstd_spec(),))
    assert torch.equal(decode_chunk(blob, ref).data, x)  # a plugin array codec under a built-in bytes stage


def test_a_manifest_lists_plugin_chains_and_refuses_longer_ones(plugins):
    _, ref = encode_chunk("checkpoints/0000000001-ab/rank-00000/chunk-000000.bin", "t",
                          array_codec("signflip").encode(torch.randn(3, 2)), 0, 0, compression=(XOR,))
    manifest = Manifest(id="0000000001-ab", step=1, kind=CheckpointKind.FULL, base=None, world_size=1,
                        created_unix=0.0, tables=(), counters={},
                        tensors={"t": _entry(ref)})
    assert parse_manifest(manifest_to_bytes(manifest)).tensors["t"].chunks[0].codecs == (make_spec("signflip"), XOR)
    longer = dataclasses.replace(ref, codecs=(make_spec("signflip"), XOR, XOR))
    with pytest.raises(CheckpointError, match="at most one bytes codec"):
        parse_manifest(manifest_to_bytes(dataclasses.replace(manifest, tensors={"t": _entry(longer)})))


def _entry(ref):
    from cnr.format.manifest import TensorEntry
    return TensorEntry((3, 2), "float32", False, (ref,), Role.DENSE, None)


def _pieces() -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"model/ebc.t.weight": torch.randn(200, 8, generator=g), "model/dense.weight": torch.randn(7, 5, generator=g)}


def _host(name: str, t: torch.Tensor) -> HostPiece:
    table = "model/ebc.t.weight" if "ebc" in name else None
    return HostPiece(name, tuple(t.shape), ShardRegion((0, 0), tuple(t.shape)), False, t.clone(), None,
                     Role.TABLE_ROWS if table else Role.DENSE, table)


def test_the_writers_plan_picks_a_plugin_codec_and_a_job_selects_a_plugin_stage(plugins):
    job = WriteJob("0000000001-ab", 1, CheckpointKind.FULL, None, 0, 1, [], plan=CodecPlan(bits=4, compression=(XOR,)))
    state = _pieces()
    _, quantized = encode_block(job, _host("model/ebc.t.weight", state["model/ebc.t.weight"]), "k", 0, 50, 0, 0)
    assert [s.name for s in quantized.codecs] == ["rowwise", "xor"]  # 4-bit rows: rowwise, tried before
    blob, dense = encode_block(job, _host("model/dense.weight", state["model/dense.weight"]), "k", 0, 7, 0, 0)
    assert [s.name for s in dense.codecs] == ["signflip", "xor"]  # 32 bits: the sign flip, first in the plan
    assert torch.equal(decode_chunk(blob, dense).data, state["model/dense.weight"])


def test_a_checkpoint_written_and_restored_through_plugin_codecs(plugins, tmp_path):
    """The library's writer (in this process: a spawned writer would not have run the test's
    ``register``) stores a checkpoint through both plugins, and its restore reads it back."""
    store = LocalStorage(str(tmp_path))
    state = _pieces()
    job = WriteJob("0000000001-ab", 1, CheckpointKind.FULL, None, 0, 1, [_host(n, t) for n, t in state.items()],
                   plan=CodecPlan(bits=32, compression=(XOR,)))
    uploader = Uploader(store, 2)
    try:
        index, _ = write_rank_data(store, uploader, job, chunk_bytes=1024)
    finally:
        uploader.close()
    chunks = [c for entry in index.tensors.values() for c in entry.chunks]
    assert len(chunks) > 2 and all([s.name for s in c.codecs] == ["signflip", "xor"] for c in chunks)
    manifest = parse_manifest(manifest_to_bytes(Manifest(
        id=job.ckpt_id, step=1, kind=CheckpointKind.FULL, base=None, world_size=1, created_unix=0.0, tables=(),
        tensors={n: dataclasses.replace(t, extents=()) for n, t in index.tensors.items()}, counters={})))  # whole
    out = {n: torch.zeros_like(t) for n, t in state.items()}
    pieces = [StatePiece(n, tuple(t.shape), ShardRegion((0, 0), tuple(t.shape)), out[n], False,
                         Role.TABLE_ROWS if "ebc" in n else Role.DENSE, "model/ebc.t.weight" if "ebc" in n else None)
              for n, t in state.items()]
    restore_chain(store, [manifest], pieces, threads=2)
    for name, t in state.items():
        assert torch.equal(out[name], t), name


def test_unregistered_plugins_are_not_read(plugins):
    blob, ref = encode_chunk("k", "t", array_codec("signflip").encode(torch.randn(3, 2)), 0, 0, compression=(XOR,))
    unregister("xor")
    with pytest.raises(CorruptChunkError, match="bytes codec 'xor' is not one this cnr reads"):
        decode_chunk(blob, ref)
