"""torchrec's FeatureProcessedEmbeddingBagCollection (position-weighted features): its tables are
the wrapped EBC's, found, tracked and restored exactly from an increment. Real spawned gloo ranks."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

import cnr
from cnr.testing.jobs import differing, gathered
from cnr.format.catalog import list_checkpoints, read_manifest
from cnr.app.launch import launch
from cnr.storage import open_storage


def build(ws: int):
    """A position-weighted FP-EBC (one table-wise table, fused row-wise Adagrad) and a linear head."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
    from torchrec.modules.feature_processor_ import PositionWeightedModule
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.fp_embeddingbag import FeatureProcessedEmbeddingBagCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=40, feature_names=["f0"])], is_weighted=True, device=torch.device("meta"))
            self.fp = FeatureProcessedEmbeddingBagCollection(ebc, {"f0": PositionWeightedModule(max_feature_length=4)})
            self.lin = torch.nn.Linear(8, 1)
        def forward(self, kjt):
            return self.lin(self.fp(kjt).values()).pow(2).mean()
    torch.manual_seed(3)
    m = M()
    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}
    sharders = [FeatureProcessedEmbeddingBagCollectionSharder(EmbeddingBagCollectionSharder(fused_params=fused))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchrec.distributed.planner import ParameterConstraints
        plan = EmbeddingShardingPlanner(topology=Topology(world_size=ws, compute_device="cpu", local_world_size=ws), constraints={"t0": ParameterConstraints(sharding_types=["table_wise"])}).collective_plan(m, sharders, dist.GroupMember.WORLD)
        dmp = DistributedModelParallel(m, device=torch.device("cpu"), plan=plan, sharders=sharders)
    opt = torch.optim.SGD([p for n, p in dmp.named_parameters() if "embedding_bags" not in n], lr=0.05, momentum=0.9)
    return dmp, opt

def batch(step: int, rank: int):
    from torchrec import KeyedJaggedTensor
    g = torch.Generator().manual_seed(step * 100 + rank)
    lengths = torch.randint(0, 4, (8,), generator=g, dtype=torch.int32)
    return KeyedJaggedTensor(keys=["f0"], values=(40 * torch.rand(int(lengths.sum()), generator=g) ** 2).long(), lengths=lengths)

def run(rank: int, ws: int, arg: dict) -> dict:
    dmp, opt = build(ws)
    app = {"model": dmp, "optim": opt}
    out = {}
    with cnr.Checkpointer(arg["uri"], app, cnr.CheckpointOptions(policy="consecutive", keep_last=0,
                                                                  compact_at_chain_ratio=0)) as ck:
        info = ck.restore()
        start = info.step if info else 0
        if info:
            st = gathered(app)
            if rank == 0:
                torch.save(st, arg["dir"] + "/restored.pt")
        out["tables"] = [t.id for t in ck.app.tables]
        for step in range(start + 1, arg["steps"] + 1):
            for g in dmp.fused_optimizer.param_groups:
                g["lr"] = 0.05 / step
            loss = dmp(batch(step, rank))
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step in arg.get("saves", ()):
                out[str(step)] = ck.save(step).wait().kind.value
                if step == 4:
                    st = gathered(app)
                    if rank == 0:
                        torch.save(st, arg["dir"] + "/saved.pt")
    return out



def test_feature_processed_ebc_tables_are_tracked_and_restored_exactly(tmp_path):
    d = str(tmp_path)
    saved = launch(run, 2, {"uri": d + "/ck", "dir": d, "steps": 4, "saves": [2, 4]})
    assert saved["tables"] == ["model/fp._embedding_bag_collection.embedding_bags.t0.weight"]
    assert saved["4"] == "incremental"
    launch(run, 2, {"uri": d + "/ck", "dir": d, "steps": 4})
    assert differing(torch.load(tmp_path / "saved.pt"), torch.load(tmp_path / "restored.pt")) == []
    storage = open_storage(d + "/ck")
    increment = read_manifest(storage, list_checkpoints(storage)[-1].id)
    chunks = increment.tensors[saved["tables"][0]].chunks
    assert all(c.row_ids for c in chunks) and 0 < sum(c.rows for c in chunks) < 40  # the rows looked up
    storage.close()
