"""DLRM models built from torchrec.models.dlrm, shaped entirely by configuration."""

from __future__ import annotations

from typing import Any

import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.models.dlrm import DLRM, DLRM_DCN

# ``config`` below is the app's Config (cnr.app.config), read duck-typed: ``model`` (arch, tables,
# embedding_dim, layer sizes), ``data.num_dense`` and ``train.seed``. Not imported, so that the
# model folder stays below the app that builds it.
Config = Any


def embedding_configs(config: Config) -> list:
    """One torchrec EmbeddingBagConfig per configured table (sum pooling)."""
    return [
        EmbeddingBagConfig(
            name=t.name,
            embedding_dim=config.model.embedding_dim,
            num_embeddings=t.rows,
            feature_names=list(t.features),
        )
        for t in config.model.tables
    ]


def build_dlrm(config: Config) -> torch.nn.Module:
    """The unsharded model: tables on the meta device (DMP materialises them), dense on CPU.

    ``model.arch``: "dlrm" (dot interaction) or "dcn" (DLRM with a low-rank DCN interaction).
    Dense initialisation is seeded by ``train.seed`` so every rank builds identical dense layers.
    """
    torch.manual_seed(config.train.seed)
    ebc = EmbeddingBagCollection(tables=embedding_configs(config), device=torch.device("meta"))
    m = config.model
    if m.arch == "dcn":
        return DLRM_DCN(
            embedding_bag_collection=ebc,
            dense_in_features=config.data.num_dense,
            dense_arch_layer_sizes=list(m.dense_arch),
            over_arch_layer_sizes=list(m.over_arch),
            dcn_num_layers=m.dcn_num_layers,
            dcn_low_rank_dim=m.dcn_low_rank_dim,
        )
    return DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=config.data.num_dense,
        dense_arch_layer_sizes=list(m.dense_arch),
        over_arch_layer_sizes=list(m.over_arch),
    )
