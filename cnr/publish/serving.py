"""A subscriber's target that serves from torchrec's quantized inference modules, without re-quantizing.

``ServingTarget(module)`` applies publishes to a module whose torchrec collections are the
quantized inference ones (``torchrec.quant.EmbeddingBagCollection`` / ``EmbeddingCollection``,
int8 or int4 tables: cnr.publish.serving_tables.quantize_tables builds them from the fp32
architecture). Every other floating tensor (dense layers) is applied in float32 as by a
ModuleTarget. A table row arrives one of two ways:

- **Copied as stored** when its chunk is quantized at the table's width with float16 scale and
  bias (a publish with ``PublishOptions.serving_params``, the default) and spans whole rows:
  codes, scale and bias go into the table as the publisher stored them, never dequantized.
- **Converted once** otherwise (a 32-bit publish, another width, float32 parameters, a
  column-split table whose pieces each carry their own scale): the rows' values are quantized
  by fbgemm's quantizer, the one torchrec's ``from_float`` uses.

The subscriber stages quantized chunks undecoded for it (``dequantize`` False). Its state file
holds the quantized rows as they are (``snapshot`` / ``load``).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Set

import torch

from cnr.codec.chunk_format import DecodedChunk
from cnr.errors import CheckpointError
from cnr.publish.module_target import ModuleTarget, write_chunk
from cnr.publish.serving_tables import ServingTable, chunk_values, serving_tables

_PARTS = ("codes", "scale", "bias")


class ServingTarget(ModuleTarget):
    """The published tensors of ``module`` (app_state key ``key`` on the trainer): ``tables``,
    published name -> ServingTable for every int8/int4 table of its quantized inference modules,
    and ``tensors``, the other floating tensors, live in float32. A module without quantized
    tables is served as a plain ModuleTarget would be."""

    def __init__(self, module: torch.nn.Module, key: str = "model") -> None:
        super().__init__(module, key)
        found, paths = serving_tables(module)
        self.tables: Dict[str, ServingTable] = {f"{key}/{name}": table for name, table in found.items()}
        # a quantized module's own floating buffers (its fp16 scale and bias views) are no published tensors
        inside = tuple(f"{key}/{path}." if path else f"{key}/" for path in paths)
        self.tensors = {name: t for name, t in self.tensors.items() if not name.startswith(inside)}
        self.dequantize = not self.tables

    @property
    def table_bytes(self) -> int:
        """Bytes the quantized tables hold (rows, parameters and the TBEs' row padding)."""
        return sum(t.nbytes for t in self.tables.values())

    def published_names(self) -> Set[str]:
        return set(self.tensors) | set(self.tables)

    def check_tensor(self, name: str, shape: tuple, dtype: str) -> None:
        table = self.tables.get(name)
        if table is None:
            super().check_tensor(name, shape, dtype)
        elif tuple(shape) != (table.rows, table.dim) or dtype != "float32":
            raise CheckpointError(f"published table {name!r} is {dtype} {list(shape)}, the served table has "
                                  f"{table.rows} rows of {table.dim}: not the trainer's architecture")

    def apply(self, chunks: List[DecodedChunk]) -> None:
        """Write verified chunks: table rows copied as stored where they can be, the rest of each
        table converted once after them, dense tensors in float32 (no I/O, cannot fail half-way on
        valid input)."""
        converted: Dict[str, List[DecodedChunk]] = {}
        with self.lock, torch.no_grad():
            for chunk in chunks:
                name = chunk.ref.tensor_name
                table = self.tables.get(name)
                if table is None:
                    write_chunk(self.tensors[name], _with_values(chunk))
                elif table.takes_as_stored(chunk):
                    table.copy(chunk)
                else:
                    converted.setdefault(name, []).append(chunk)
            for name, parts in converted.items():
                self.tables[name].convert(parts)

    def snapshot(self) -> Dict[str, torch.Tensor]:
        """A copy of the dense tensors and of every table's rows (``<name>:codes``, ``:scale``, ``:bias``)."""
        with self.lock:
            out = super().snapshot()
            for name, table in self.tables.items():
                out.update({f"{name}:{part}": t for part, t in table.state().items()})
            return out

    def load(self, tensors: Dict[str, torch.Tensor]) -> None:
        """Set every tensor and table from a ``snapshot``; names, shapes and dtypes must match."""
        saved = {name: {part: tensors.get(f"{name}:{part}") for part in _PARTS} for name in self.tables}
        saved = {name: {p: t for p, t in parts.items() if t is not None} for name, parts in saved.items()}
        keys = {f"{name}:{part}" for name, parts in saved.items() for part in parts}
        for name, table in self.tables.items():
            try:
                table.check_state(saved[name], f"saved table {name!r}")
            except ValueError as e:
                raise CheckpointError(f"{e}: the state file was not made for this serving model") from None
        with self.lock, torch.no_grad():
            super().load({k: v for k, v in tensors.items() if k not in keys})
            for name, table in self.tables.items():
                table.load(saved[name])


def _with_values(chunk: DecodedChunk) -> DecodedChunk:
    """``chunk`` with its values (a quantized chunk of a tensor this target keeps in float32)."""
    return chunk if chunk.data is not None else dataclasses.replace(chunk, data=chunk_values(chunk))
