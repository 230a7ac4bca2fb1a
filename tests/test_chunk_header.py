"""Chunk headers (cnr.codec.chunk_header): every readable version is upgraded to the current form
as it is parsed, so decoding reads data, not the version."""

from __future__ import annotations

import json

import pytest
import torch

from cnr.codec.chunk_format import encode_raw_chunk
from cnr.codec.chunk_header import FORMAT_VERSION, PREFIX, parse_header
from cnr.codec.spec import make_spec
from cnr.errors import CorruptChunkError


def _current_header():
    blob, _ref = encode_raw_chunk("k", "model/t", torch.ones(4, 2), row_start=0, col_offset=0,
                                  row_ids=torch.tensor([3, 17, 18, 900]))
    _magic, _version, size = PREFIX.unpack_from(blob, 0)
    return json.loads(blob[PREFIX.size:PREFIX.size + size])


def _as(version: int) -> dict:
    header = _current_header()
    if version < 3:  # encoding, bits and quant, not a codec chain
        del header["codecs"]
        header.update(encoding="raw", bits=32, quant=None)
    if version < 2:  # no ids: int64 ids whenever rows are listed
        del header["ids"]
    return header


@pytest.mark.parametrize("version", [1, 2, 3, FORMAT_VERSION])
def test_every_version_parses_to_the_current_form(version):
    current = parse_header(json.dumps(_current_header()).encode(), "chunk", FORMAT_VERSION)
    got = parse_header(json.dumps(_as(version)).encode(), "chunk", version)
    for name in ("encoding", "bits", "quant"):  # version 1 and 2 fields, said by the chain now
        got.pop(name, None)
    if version < 2:
        assert got["ids"] == {"format": "int64"}
        got["ids"] = current["ids"]
    assert got["codecs"] == current["codecs"] == (make_spec("raw"),)
    assert got["crc_over_header"] == (version >= 4) and got["codecs_recorded"] == (version >= 3)
    assert {k: v for k, v in got.items() if k not in ("crc_over_header", "codecs_recorded")} == \
        {k: v for k, v in current.items() if k not in ("crc_over_header", "codecs_recorded")}


def test_a_field_of_another_version_is_refused():
    header = _as(2)
    with pytest.raises(CorruptChunkError, match="differ from the expected"):
        parse_header(json.dumps(header).encode(), "chunk", 3)
