"""cnr.track.sharders: the sharder cnr exports for torchrec's row-wise kinds on CPU."""

from __future__ import annotations

from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.types import ShardingType

import cnr


def test_the_exported_sharder_adds_the_row_wise_kinds_on_cpu_to_torchrecs():
    default = EmbeddingBagCollectionSharder().sharding_types("cpu")
    assert ShardingType.ROW_WISE.value not in default  # what the export is for
    ours = cnr.CPURowWiseSharder(fused_params={"learning_rate": 0.05})
    offered = ours.sharding_types("cpu")
    assert set(offered) == set(default) | {ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value}
    assert isinstance(ours, EmbeddingBagCollectionSharder) and ours.fused_params == {"learning_rate": 0.05}
