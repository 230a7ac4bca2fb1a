"""``zstd``: Zstandard over a chunk's whole payload (row ids, codes, scales, biases or raw
values), a lossless bytes->bytes stage. Parameter ``level`` (1..19).

Level table, measured by ``python -m cnr bench codecs`` on the 212 chunks of a 2-bit full
checkpoint and the next 100-step increment of bench.yaml (82.4 MB of payloads, Adagrad sums
log8-coded; one core of the 2-core machine; ratio = payload / stored):

    level   ratio   encode MB/s   decode MB/s
      1     1.092       837          2770
      3     1.096       435          2438
      6     1.099       164          2113
      9     1.100       111          2220
     19     1.112         6.5        1387

Level 3, the default, is the best ratio that still encodes at >= 200 MB/s. Packed 2-bit codes
barely compress (1.05 in full checkpoints, 1.13-1.18 in increments, whose row-id bitmaps and
codes of recently moved rows repeat more); the log8 Adagrad sums of a full checkpoint do
(2.8x: rows never looked up hold code 0).

The payload's header records the decoded size, and the frame must declare exactly that size,
so a crafted frame cannot make a reader allocate more than the chunk's own header promised.
"""

from __future__ import annotations

import threading

import numpy as np
import zstandard

from cnr.codec.base import BytesCodec
from cnr.codec.spec import make_spec, require_params
from cnr.errors import CorruptChunkError
from cnr.types import CodecSpec

LEVELS = tuple(range(1, 20))
DEFAULT_LEVEL = 3


def zstd_spec(level: int = DEFAULT_LEVEL) -> CodecSpec:
    """The spec of a zstd stage at ``level``."""
    if level not in LEVELS:
        raise ValueError(f"zstd level {level!r} is not allowed; allowed: 1..19")
    return make_spec("zstd", level=level)


class ZstdCodec(BytesCodec):
    name = "zstd"

    def __init__(self) -> None:
        # one compressor per level and thread, and one decompressor per thread, reused: creating
        # one costs ~0.1 ms, and neither may be used by two threads at once (the writer encodes,
        # a restore decodes, on several)
        self._local = threading.local()

    def check(self, spec: CodecSpec, where: str) -> None:
        require_params(spec, {"level": LEVELS}, where)

    def encode(self, spec: CodecSpec, data: bytes) -> bytes:
        level = dict(spec.params)["level"]
        compressors = getattr(self._local, "by_level", None)
        if compressors is None:
            compressors = self._local.by_level = {}
        if level not in compressors:
            compressors[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
        return compressors[level].compress(data)

    def decode(self, spec: CodecSpec, data: memoryview, size: int, where: str) -> memoryview:
        try:
            declared = zstandard.get_frame_parameters(data).content_size
            if declared in (zstandard.CONTENTSIZE_UNKNOWN, zstandard.CONTENTSIZE_ERROR):
                raise CorruptChunkError(f"{where} zstd frame does not declare its size (the header says {size})")
            if declared != size:
                raise CorruptChunkError(f"{where} zstd frame declares {declared} bytes, the header says {size}")
            decompressor = getattr(self._local, "decompressor", None)
            if decompressor is None:
                decompressor = self._local.decompressor = zstandard.ZstdDecompressor()
            # straight into a fresh writable buffer (not zero-filled): the decoded chunk's tensors
            # are views of it (cnr.codec.base.take), with no second copy of the values
            out = np.empty(size, dtype=np.uint8)
            view, got = memoryview(out), 0
            with decompressor.stream_reader(data, read_across_frames=False) as reader:
                while got < size:  # a reader may fill less than asked at once: 0 is the frame's end
                    n = reader.readinto(view[got:])
                    if not n:
                        break
                    got += n
                # a frame holding more than it declared is damaged: read on to its end to know
                extra = len(reader.read(1)) if got == size else 0
        except zstandard.ZstdError as e:
            raise CorruptChunkError(f"{where} zstd payload does not decompress: {e}") from e
        if got != size or extra:
            raise CorruptChunkError(f"{where} zstd payload decompresses to {'more than ' if extra else ''}{got} bytes, "
                                    f"the header says {size}")
        return view
