"""The inference side of publishing: an unsharded DLRM on the CPU that publishes are applied to.

Its tables are a torchrec ``EmbeddingBagCollection`` (fp32) holding exactly the published
values (dequantized when publishing below 32 bits). With ``quantized=True`` the tables are also
mirrored into torchrec's quantized inference EBC (``torchrec.quant.EmbeddingBagCollection``,
int8 rows with fp16 scale and bias, fbgemm's CPU kernels): the rows each publish changed are
re-quantized into it, so it serves the same model at a quarter of the memory.

Tensors are addressed by their published names (``model/<state_dict key>``, as cnr.track.state names
them on the trainer), which for this unsharded model are the same keys.
"""

from __future__ import annotations

import copy
from typing import Dict, List, Optional

import torch
from torch.ao.quantization import PlaceholderObserver, QConfig
from torchrec.models.dlrm import SparseArch
from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEmbeddingBagCollection
from torchrec.quant.embedding_modules import quant_prep_enable_quant_state_dict_split_scale_bias

from cnr.app.config import Config
from cnr.app.evaluate import evaluate
from cnr.models.dlrm import build_dlrm
from cnr.publish.module_target import ModuleTarget

_INT8_SCALE_BIAS_BYTES = 4  # fbgemm's fused int8 rows end with an fp16 scale and an fp16 bias


def _int8_qconfig() -> QConfig:
    return QConfig(activation=PlaceholderObserver.with_args(dtype=torch.float),
                   weight=PlaceholderObserver.with_args(dtype=torch.qint8))


def _table_name(tensor: str) -> Optional[str]:
    """torchrec's name of the table whose weight ``tensor`` is (``...embedding_bags.<t>.weight``), else None."""
    parts = tensor.split(".")
    if tensor.endswith(".weight") and len(parts) >= 3 and parts[-3] in ("embedding_bags", "embeddings"):
        return parts[-2]
    return None


class InferenceModel(ModuleTarget):
    """cnr's DLRM for serving, updated in place by a subscriber (a ModuleTarget of its model).

    ``tensors``: published name -> live tensor (table weights and dense parameters).
    ``lock``: held while a publish is applied and while ``evaluate`` runs, so a reader in
    another thread never sees a publish half-applied.
    """

    def __init__(self, config: Config, quantized: bool = False) -> None:
        self.config = config
        self.model = build_dlrm(config)  # tables on meta: nothing is drawn, a base fills them
        self.ebc = self.model.sparse_arch.embedding_bag_collection
        self.ebc.to_empty(device=torch.device("cpu"))
        with torch.no_grad():
            for p in self.ebc.parameters():
                p.zero_()
        self.model.eval()
        super().__init__(self.model, "model")  # cnr train's app_state key of its model
        self.qebc: Optional[QuantEmbeddingBagCollection] = None
        self.quant_model: Optional[torch.nn.Module] = None
        if quantized:
            self._build_quantized()

    def _build_quantized(self) -> None:
        self.ebc.qconfig = _int8_qconfig()
        quant_prep_enable_quant_state_dict_split_scale_bias(self.ebc)  # scale/bias as views we can write
        self.qebc = QuantEmbeddingBagCollection.from_float(self.ebc)
        # the same dense layers, with the quantized tables in the sparse arch
        self.quant_model = copy.copy(self.model)
        self.quant_model._modules = dict(self.model._modules)
        self.quant_model._modules["sparse_arch"] = SparseArch(self.qebc)

    def table(self, name: str) -> torch.Tensor:
        """The fp32 weight of table ``name`` (live)."""
        return self.ebc.embedding_bags[name].weight.data

    def _written(self, written: Dict[str, Optional[List[torch.Tensor]]]) -> None:
        """Refresh the quantized tables' rows a publish wrote."""
        if self.qebc is None:
            return
        for name, parts in written.items():
            table = _table_name(name)
            if table is not None:
                self._requantize(table, None if parts is None else torch.unique(torch.cat(parts)))

    def _requantize(self, table: str, ids: Optional[torch.Tensor]) -> None:
        """Quantize rows ``ids`` (None: all) of the fp32 table into the int8 EBC, as torchrec's
        ``from_float`` does (fbgemm's fused 8-bit rows: codes, then fp16 scale and bias)."""
        src = self.table(table) if ids is None else self.table(table).index_select(0, ids)
        fused = torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(src.contiguous(), 8)
        dim = src.shape[1]
        codes = fused[:, :dim]
        scale_bias = fused[:, dim:dim + _INT8_SCALE_BIAS_BYTES].contiguous().view(torch.float16)
        bag = self.qebc.embedding_bags[table]
        if ids is None:
            bag.weight.copy_(codes)
            bag.weight_qscale.copy_(scale_bias[:, :1])
            bag.weight_qbias.copy_(scale_bias[:, 1:])
        else:
            bag.weight[ids] = codes
            bag.weight_qscale[ids] = scale_bias[:, :1]
            bag.weight_qbias[ids] = scale_bias[:, 1:]

    def dequantized_table(self, name: str) -> torch.Tensor:
        """The int8 table's rows as fp32 (codes x scale + bias), to compare with ``table``."""
        bag = self.qebc.embedding_bags[name]
        return bag.weight.float() * bag.weight_qscale.float() + bag.weight_qbias.float()

    def evaluate(self, quantized: bool = False) -> Dict[str, float]:
        """Eval logloss and AUC of the served model on the held-out stream (cnr.app.evaluate)."""
        model = self.quant_model if quantized else self.model
        if model is None:
            raise ValueError("this InferenceModel was built without quantized tables")
        with self.lock:
            return evaluate(self.config, model, 0, 1, torch.device("cpu"))

    def _loaded(self) -> None:
        if self.qebc is not None:
            for table in self.ebc.embedding_bags:
                self._requantize(table, None)
