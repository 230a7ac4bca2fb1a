"""The checkpoint store (cnr.storage.checkpoint_store) and the NodeTier protocol (cnr.storage.base).

A plain store answers ``node_tier()`` with None, a tiered one with itself; the writer, the commit,
the API and the writer's Peers work through that answer alone, so any NodeTier (here one that is no
TieredStorage) takes the tier's path, and no caller tests the store's type.
"""

from __future__ import annotations

import ast
import functools
import os
from types import SimpleNamespace
from typing import List, Optional, Set

import pytest

from cnr.errors import CheckpointError
from cnr.format.manifest import manifest_key
from cnr.storage import NodeTier, open_checkpoint_store
from cnr.storage.base import Fence, Storage
from cnr.storage.checkpoint_store import local_tier_root
from cnr.storage.local import LocalStorage
from cnr.storage.tiered import TieredStorage
from cnr.storage.wrapper import CountingStorage, WrapperStorage
from cnr.types import CheckpointInfo, CheckpointStatus

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class RecordingTier(WrapperStorage, NodeTier):
    """A NodeTier that is no TieredStorage: it stores straight to ``remote`` and records what the
    callers asked of it."""

    remote_down: bool = False  # plain attributes answer the protocol's properties
    fenced_out: Optional[str] = None

    def __init__(self, local: Storage, remote: Storage, remote_down: bool = False,
                 fenced_out: Optional[str] = None) -> None:
        super().__init__(remote)
        self.local = local
        self.remote_down, self.fenced_out = remote_down, fenced_out
        self.commits: List[tuple] = []
        self.fences: List[Fence] = []
        self.unreachable = 0

    @property
    def remote(self) -> Storage:
        return self.inner

    def commit(self, key, data, requires=(), fence=None) -> None:
        self.commits.append((key, tuple(requires), fence))
        self.local.put(key, data)

    def put_local(self, key, data) -> bool:
        self.local.put(key, data)
        return True

    def resend(self, key) -> None:
        self.remote.put(key, self.local.get(key))

    def set_fence(self, fence) -> None:
        self.fences.append(fence)

    def note_unreachable(self) -> None:
        self.unreachable += 1

    def unflushed_commits(self) -> List[str]:
        return [key for key, _requires, _fence in self.commits]

    def pending_groups(self) -> Set[str]:
        return set()


def test_a_plain_store_has_no_tier_and_a_tiered_store_is_its_own(tmp_path):
    plain = open_checkpoint_store(str(tmp_path / "store"))
    assert isinstance(plain, LocalStorage) and plain.node_tier() is None
    tiered = open_checkpoint_store(str(tmp_path / "store"), str(tmp_path / "nvme"), create=True)
    try:
        assert isinstance(tiered, NodeTier) and tiered.node_tier() is tiered
        assert tiered.remote.uri == plain.uri  # the lease and the durable checkpoints are the storage's
        assert tiered.local.root == local_tier_root(str(tmp_path / "nvme"), plain)
        assert not tiered.remote_down and tiered.fenced_out is None and tiered.unflushed_commits() == []
    finally:
        tiered.close()
    # a wrapper in front of a tier is no tier itself: its writes go through the wrapper
    assert WrapperStorage(TieredStorage(LocalStorage(str(tmp_path / "l")), plain)).node_tier() is None
    # ... but a counting one (a progress bar's) changes no answer: the tier stays a tier behind it
    behind = TieredStorage(LocalStorage(str(tmp_path / "l2")), plain)
    assert CountingStorage(behind, lambda n: None).node_tier() is behind
    assert CountingStorage(plain, lambda n: None).node_tier() is None
    with pytest.raises(TypeError):
        NodeTier()  # the protocol is abstract: an implementation provides every member


def test_the_factory_builds_the_callers_tier_keyed_by_the_location(tmp_path):
    built = []

    def tier(local, remote):
        built.append((local, remote))
        return RecordingTier(local, remote)

    store = open_checkpoint_store(str(tmp_path / "store"), str(tmp_path / "nvme"), create=True, tier=tier)
    (local, remote), = built
    assert store.node_tier() is store and remote.uri == store.remote.uri
    assert local.root == local_tier_root(str(tmp_path / "nvme"), remote)  # keyed by the location
    assert os.path.exists(os.path.join(local.root, "location.json"))  # a writer's records the location


def test_a_reader_creates_nothing_in_local_dir(tmp_path):
    store = open_checkpoint_store(str(tmp_path / "store"), str(tmp_path / "nvme"))
    try:
        assert store.node_tier() is not None and not (tmp_path / "nvme").exists()
    finally:
        store.close()


def _job(lease):
    return SimpleNamespace(ckpt_id="0000000001-00000001", lease=lease, lease_uri=None)


def test_the_commit_takes_the_tier_path_for_any_node_tier(tmp_path):
    from cnr.write.commit import _commit_under_lease

    tier = RecordingTier(LocalStorage(str(tmp_path / "l")), LocalStorage(str(tmp_path / "r")), remote_down=True)
    _commit_under_lease(tier, _job(lease=object()), b"{}", ["a/b"])
    (key, requires, fence), = tier.commits
    assert key == manifest_key("0000000001-00000001") and requires == ("a/b",)
    assert isinstance(fence, functools.partial)  # checked on the remote once it answers again
    assert not tier.remote.exists(key)  # down: committed on the local tier only

    refused = RecordingTier(LocalStorage(str(tmp_path / "l2")), LocalStorage(str(tmp_path / "r2")),
                            fenced_out="another job holds the lease")
    with pytest.raises(CheckpointError, match="another job"):
        _commit_under_lease(refused, _job(lease=object()), b"{}", [])
    assert refused.commits == []


def test_peers_and_inspect_see_the_tier_through_node_tier(tmp_path):
    from cnr.write.local_tier import Peers, committed_in

    local, remote = LocalStorage(str(tmp_path / "l")), LocalStorage(str(tmp_path / "r"))
    tier = RecordingTier(local, remote)
    exchange = SimpleNamespace(address=("127.0.0.1", 1))
    assert Peers.connect(exchange, remote, 1.0) is None  # no tier: no manifests to store on the node
    assert Peers.connect(exchange, tier, 1.0).tier is tier
    ids = ["0000000001-00000001", "0000000002-00000002"]
    local.put(manifest_key(ids[0]), b"{}")
    remote.put(manifest_key(ids[1]), b"{}")
    infos = [CheckpointInfo(i, n, None, CheckpointStatus.COMMITTED, None, None, 0) for n, i in enumerate(ids)]
    assert committed_in(tier, infos) == {ids[0]: ["local"], ids[1]: ["remote"]}
    assert committed_in(remote, infos) == {ids[0]: ["remote"], ids[1]: ["remote"]}


@pytest.mark.parametrize("module", ["cnr/write/writer.py", "cnr/write/commit.py", "cnr/api.py",
                                    "cnr/write/local_tier.py", "cnr/write/local_flush.py"])
def test_the_callers_of_the_tier_test_no_store_type(module):
    tree = ast.parse(open(os.path.join(ROOT, module)).read())
    tested = [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Call)
              and getattr(node.func, "id", None) == "isinstance"
              and ast.unparse(node.args[1]) in ("TieredStorage", "NodeTier")]
    assert tested == []
