"""Reading a checkpoint back: the newest restorable one, into an app, a chain, pieces, verification, load_state_dict.

The public interface of reading chunks into live state pieces (cnr.restore.pieces):
``plan_restore(manifest, pieces, overlay=False, wanted=None) -> RestorePlan`` and
``apply_restore(plan, storage, pool=None, held=None) -> AppliedRestore``; ``restore_pieces`` (one
checkpoint, coverage checked) and ``restore_chain`` (a baseline and its increments, cnr.restore.chain)
are built on them.
"""

from cnr.restore.pieces import AppliedRestore, RestorePlan, apply_restore, plan_restore, restore_pieces
from cnr.restore.chain import restore_chain

__all__ = ["AppliedRestore", "RestorePlan", "apply_restore", "plan_restore", "restore_pieces", "restore_chain"]
