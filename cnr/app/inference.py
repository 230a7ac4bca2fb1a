"""The inference side of publishing: an unsharded DLRM on the CPU that publishes are applied to.

By default its tables are a torchrec ``EmbeddingBagCollection`` (fp32) holding exactly the
published values (dequantized when publishing below 32 bits). With ``quantized`` ("int8", or
True, or "int4") the tables are torchrec's quantized inference EBC instead
(``torchrec.quant.EmbeddingBagCollection``, rows with an fp16 scale and bias, fbgemm's CPU
kernels), and no fp32 copy of them is kept: publishes go straight into it as a
cnr.publish.serving.ServingTarget, copied as stored when they were published at the same width
with serving parameters, converted once otherwise.

Tensors are addressed by their published names (``model/<state_dict key>``, as cnr.track.state names
them on the trainer), which for this unsharded model are the same keys.
"""

from __future__ import annotations

from typing import Dict, Union

import torch

from cnr.app.config import Config
from cnr.app.evaluate import evaluate
from cnr.models.dlrm import build_dlrm
from cnr.publish.serving import ServingTarget
from cnr.publish.serving_tables import quantize_tables

SERVING_WIDTHS: Dict[str, int] = {"int8": 8, "int4": 4}
"""``quantized`` values and the table row width each serves at (True means "int8")."""
_FP32_BYTES = 4


def serving_width(quantized: Union[bool, str]) -> int:
    """Bits per table value an InferenceModel built with ``quantized`` serves (32: fp32 tables)."""
    if quantized is False or quantized is None:
        return 32
    if quantized is True:
        return SERVING_WIDTHS["int8"]
    if quantized not in SERVING_WIDTHS:
        raise ValueError(f"quantized={quantized!r} is not allowed; allowed: False, True (int8), "
                         + ", ".join(repr(k) for k in SERVING_WIDTHS))
    return SERVING_WIDTHS[quantized]


class InferenceModel(ServingTarget):
    """cnr's DLRM for serving, updated in place by a subscriber (a ServingTarget of its model).

    ``bits``: 32 (fp32 tables), 8 or 4 (torchrec's quantized inference tables). ``ebc``: its
    embedding bag collection, either kind. ``lock``: held while a publish is applied and while
    ``evaluate`` runs, so a reader in another thread never sees a publish half-applied.
    """

    def __init__(self, config: Config, quantized: Union[bool, str] = False) -> None:
        self.config = config
        self.bits = serving_width(quantized)
        self.model = build_dlrm(config)  # tables on meta: nothing is drawn, a base fills them
        if self.bits == 32:
            ebc = self.model.sparse_arch.embedding_bag_collection
            ebc.to_empty(device=torch.device("cpu"))
            with torch.no_grad():
                for p in ebc.parameters():
                    p.zero_()
        else:
            quantize_tables(self.model, self.bits)
        self.model.eval()
        self.ebc = self.model.sparse_arch.embedding_bag_collection
        super().__init__(self.model, "model")  # cnr train's app_state key of its model

    def table(self, name: str) -> torch.Tensor:
        """Table ``name``'s values as served, float32: the live fp32 weight, or of a quantized
        table every row dequantized (a copy)."""
        if self.bits == 32:
            return self.ebc.embedding_bags[name].weight.data
        table = self.tables[f"model/sparse_arch.embedding_bag_collection.embedding_bags.{name}.weight"]
        with self.lock:
            return table.values(torch.arange(table.rows))

    def fp32_table_bytes(self) -> int:
        """Bytes the tables take in fp32 (what ``bits`` 32 holds)."""
        return sum(t.rows * self.config.model.embedding_dim * _FP32_BYTES for t in self.config.model.tables)

    def served_table_bytes(self) -> int:
        """Bytes the served tables take: fp32, or the quantized TBEs' rows with their parameters and padding."""
        return self.fp32_table_bytes() if self.bits == 32 else self.table_bytes

    def evaluate(self) -> Dict[str, float]:
        """Eval logloss and AUC of the served model on the held-out stream (cnr.app.evaluate)."""
        with self.lock:
            return evaluate(self.config, self.model, 0, 1, torch.device("cpu"))
