"""torchrec's quantized inference tables as a subscriber writes them: built in place of a module's
fp32 collections, found in a module, and written row by row, either copied as stored or converted.

``torchrec.quant.EmbeddingBagCollection`` and ``EmbeddingCollection`` keep their tables in fbgemm's
inference TBEs (``IntNBitTableBatchedEmbeddingBagsCodegen``, whose CPU kernels answer lookups).
A row there is an fp16 scale, an fp16 bias and the codes, ``value = code * scale + bias``,
padded to the TBE's ``row_alignment`` bytes; 4-bit codes hold two values a byte, low nibble
first, which is cnr's packing too (cnr.codec.quant.bitpack). The TBE hands out views of the
three parts (``split_embedding_weights_with_scale_bias``): writing into them is writing the table.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Dict, Iterable, List, Tuple, Union

import torch
from torchrec.modules.embedding_configs import DataType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEmbeddingBagCollection
from torchrec.quant.embedding_modules import EmbeddingCollection as QuantEmbeddingCollection

from cnr.codec.chunk_format import DecodedChunk
from cnr.codec.quant.bitpack import unpack

logger = logging.getLogger(__name__)

SERVING_BITS: Dict[int, DataType] = {8: DataType.INT8, 4: DataType.INT4}
"""Row widths a serving table may have, and torchrec's data type of each (qint8, quint4x2)."""
_BITS_OF = {dtype: bits for bits, dtype in SERVING_BITS.items()}
_PARAM_BYTES = 4  # fbgemm's fused rows end with an fp16 scale and an fp16 bias
QUANT_MODULES = (QuantEmbeddingBagCollection, QuantEmbeddingCollection)


def quantize_tables(module: torch.nn.Module, bits: int) -> torch.nn.Module:
    """Replace every torchrec EmbeddingBagCollection and EmbeddingCollection in ``module``
    (unsharded; tables on any device, meta included, since none of their values is read) by
    torchrec's quantized inference module of the same tables with ``bits``-wide rows (8: int8,
    4: int4), every row zero, on the CPU. In place; returns ``module`` (the new collection when
    ``module`` is one). A subscriber's first base fills the rows."""
    if bits not in SERVING_BITS:
        raise ValueError(f"serving tables are {' or '.join(map(str, SERVING_BITS))} bits wide, not {bits!r}")
    found = [(path, child) for path, child in module.named_modules()
             if type(child) in (EmbeddingBagCollection, EmbeddingCollection)]
    for path, child in found:
        quantized = _quantized(child, SERVING_BITS[bits])
        if not path:
            return quantized
        parent, _, attr = path.rpartition(".")
        setattr(module.get_submodule(parent), attr, quantized)
    return module


def _quantized(fp32: torch.nn.Module, data_type: DataType) -> torch.nn.Module:
    """The quantized inference module of ``fp32``'s tables (its configs, rows at ``data_type``)."""
    cpu = torch.device("cpu")
    if isinstance(fp32, EmbeddingBagCollection):
        configs = copy.deepcopy(fp32.embedding_bag_configs())
        for config in configs:
            config.data_type = data_type
        return QuantEmbeddingBagCollection(configs, fp32.is_weighted(), cpu, output_dtype=torch.float,
                                           quant_state_dict_split_scale_bias=True)
    configs = copy.deepcopy(fp32.embedding_configs())
    for config in configs:
        config.data_type = data_type
    return QuantEmbeddingCollection(configs, cpu, need_indices=fp32.need_indices(), output_dtype=torch.float,
                                    quant_state_dict_split_scale_bias=True)


def chunk_rows(chunk: DecodedChunk) -> torch.Tensor:
    """The table rows a chunk holds, int64, in its order."""
    ref = chunk.ref
    if chunk.row_ids is not None:
        return chunk.row_ids
    return torch.arange(ref.row_start, ref.row_start + ref.rows, dtype=torch.int64)


def chunk_values(chunk: DecodedChunk) -> torch.Tensor:
    """A chunk's rows as float32 values (quantized rows dequantized)."""
    return chunk.data if chunk.data is not None else chunk.quantized.values()


@dataclass
class ServingTable:
    """One int8 or int4 table of a quantized inference module (``name``: its state_dict key):
    ``rows`` x ``dim`` values of ``bits`` bits. ``codes`` (uint8 ``[rows, width]``), ``scale`` and
    ``bias`` (fp16 ``[rows, 1]``) are views into the TBE's rows."""

    name: str
    bits: int
    rows: int
    dim: int
    codes: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor

    @property
    def nbytes(self) -> int:
        """Bytes the TBE holds for this table: every row with its parameters and padding."""
        return self.rows * self.codes.stride(0)

    def takes_as_stored(self, chunk: DecodedChunk) -> bool:
        """Whether ``chunk``'s stored rows are this table's rows as they are: quantized at its
        width, with fp16 scale and bias, spanning whole rows."""
        q, ref = chunk.quantized, chunk.ref
        return (q is not None and q.bits == self.bits and q.scale.dtype == torch.float16
                and q.bias.dtype == torch.float16 and ref.col_offset == 0 and ref.cols == self.dim
                and tuple(q.codes.shape[1:]) == tuple(self.codes.shape[1:]))

    def copy(self, chunk: DecodedChunk) -> None:
        """Write a chunk ``takes_as_stored`` into its rows: codes, scale and bias as stored."""
        q, ref = chunk.quantized, chunk.ref
        # a range (a base's chunks) is written as a slice: a copy, not an index_put
        at = chunk.row_ids if chunk.row_ids is not None else slice(ref.row_start, ref.row_start + ref.rows)
        self._write(at, q.codes, q.scale.unsqueeze(1), q.bias.unsqueeze(1))

    def convert(self, chunks: Iterable[DecodedChunk]) -> None:
        """Write ``chunks`` (values of any width, whole rows or column slices) by quantizing
        their rows once with fbgemm's quantizer, the one torchrec's ``from_float`` uses. Columns
        a chunk does not hold keep the row's current (dequantized) values; a whole row is staged
        in float32 first, so a base of a column-split table stages the table once."""
        chunks = [c for c in chunks if c.ref.rows]
        if not chunks:
            return
        ids = torch.unique(torch.cat([chunk_rows(c) for c in chunks]))  # sorted
        whole = all(c.ref.col_offset == 0 and c.ref.cols == self.dim for c in chunks)
        staged = torch.empty((ids.numel(), self.dim)) if whole else self.values(ids)
        for chunk in chunks:
            at = torch.searchsorted(ids, chunk_rows(chunk))
            staged[at, chunk.ref.col_offset:chunk.ref.col_offset + chunk.ref.cols] = chunk_values(chunk)
        fused = torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(staged, self.bits)
        width = self.codes.shape[1]
        params = fused[:, width:width + _PARAM_BYTES].contiguous().view(torch.float16)
        bad = int((~torch.isfinite(params)).any(dim=1).sum())
        if bad:  # fbgemm's fp16 parameters cannot hold them either; say so rather than serve them silently
            logger.warning("table %s: %d rows hold values beyond float16's range; their served scale or bias is "
                           "not finite", self.name, bad)
        self._write(ids, fused[:, :width], params[:, :1], params[:, 1:])

    def values(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 ``[len(ids), dim]``: rows ``ids`` as served (code * scale + bias)."""
        codes = unpack(self.codes.index_select(0, ids), self.bits, self.dim).float()
        return codes.mul_(self.scale.index_select(0, ids).float()).add_(self.bias.index_select(0, ids).float())

    def state(self) -> Dict[str, torch.Tensor]:
        """A copy of the rows (for a subscriber's state file)."""
        return {"codes": self.codes.clone(), "scale": self.scale.clone(), "bias": self.bias.clone()}

    def check_state(self, state: Dict[str, torch.Tensor], where: str) -> None:
        """Raise ValueError unless ``state`` is a ``state()`` of a table like this one."""
        for part, live in (("codes", self.codes), ("scale", self.scale), ("bias", self.bias)):
            saved = state.get(part)
            if saved is None or saved.shape != live.shape or saved.dtype != live.dtype:
                got = "missing" if saved is None else f"{saved.dtype} {list(saved.shape)}"
                raise ValueError(f"{where} {part} is {got}, the table has {live.dtype} {list(live.shape)}")

    def load(self, state: Dict[str, torch.Tensor]) -> None:
        """Set every row from a checked ``state()``."""
        self.codes.copy_(state["codes"])
        self.scale.copy_(state["scale"])
        self.bias.copy_(state["bias"])

    def _write(self, ids: Union[torch.Tensor, slice], codes: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor) -> None:
        self.codes[ids] = codes
        self.scale[ids] = scale
        self.bias[ids] = bias


def serving_tables(module: torch.nn.Module) -> Tuple[Dict[str, ServingTable], List[str]]:
    """Every int8 and int4 table of the quantized inference modules in ``module``, by its
    ``state_dict`` key in the fp32 module it stands for (``<path>.embedding_bags.<table>.weight``,
    ``<path>.embeddings.<table>.weight``), and the paths of those modules. Raises ValueError for a
    table of another data type."""
    tables: Dict[str, ServingTable] = {}
    paths = []
    for path, child in module.named_modules():
        if not isinstance(child, QUANT_MODULES):
            continue
        paths.append(path)
        kind = "embedding_bags" if isinstance(child, QuantEmbeddingBagCollection) else "embeddings"
        prefix = f"{path}.{kind}" if path else kind
        # torchrec's own pairing of its TBEs with their tables (each TBE's tables in order)
        for configs, tbe in zip(child._key_to_tables.values(), child._emb_modules):
            for config, (codes, scale, bias) in zip(configs, tbe.split_embedding_weights_with_scale_bias(2)):
                if config.data_type not in _BITS_OF:
                    raise ValueError(f"table {prefix}.{config.name} is {config.data_type.name}; a serving target "
                                     "takes int8 and int4 tables")
                name = f"{prefix}.{config.name}.weight"
                tables[name] = ServingTable(name, _BITS_OF[config.data_type], config.num_embeddings,
                                            config.embedding_dim, codes, scale, bias)
    return tables, paths
