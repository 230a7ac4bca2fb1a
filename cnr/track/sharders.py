"""Sharders for torchrec's planner and DistributedModelParallel that cnr's jobs and users share."""

from __future__ import annotations

from typing import List

from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.types import ShardingType


class CPURowWiseSharder(EmbeddingBagCollectionSharder):
    """torchrec's EBC sharder, offering row-wise and table-row-wise on CPU too (exported as
    ``cnr.CPURowWiseSharder``; give it to torchrec's planner and DistributedModelParallel as
    ``sharders=[cnr.CPURowWiseSharder(fused_params=...)]``).

    torchrec's default list for CPU leaves them out, but fbgemm's CPU kernels run them
    (bucketized input dist, fused lookup): measured here with gloo on 2 ranks, and the tracker
    and resume tests cover them. The planner still chooses among the constraints' sharding types.
    """

    def sharding_types(self, compute_device_type: str) -> List[str]:
        types = super().sharding_types(compute_device_type)
        for extra in (ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value):
            if extra not in types:
                types.append(extra)
        return types
