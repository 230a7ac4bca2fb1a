"""``python -m cnr export URI --format dcp OUT``: a committed checkpoint as a torch.distributed.checkpoint.

The export holds the modules' tensors (TABLE_ROWS and DENSE roles), unsharded, as DCP state
``{key: {state_dict key: tensor}}`` (DCP names them ``key.<state_dict key>``), so DCP's default
planner loads them into a DistributedModelParallel at any world size (each rank reads its own
shards) or into the same model built without DMP, in a process with no process group::

    sd = {"model": dmp.state_dict()}   # or model.state_dict() for the plain model
    torch.distributed.checkpoint.load(sd, checkpoint_id=OUT)
    dmp.load_state_dict(sd["model"])

DMP's ``state_dict()`` keys carry no ``_dmp_wrapped_module.`` prefix, so they are the plain
model's keys. Optimizer, RNG and Stateful state are not exported; quantized rows come back
dequantized (float32). OUT must be missing or empty: the export is written into a temporary
sibling directory and renamed onto OUT, so nothing in OUT is ever overwritten.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
import warnings
from typing import Any, Dict, List, Optional, Sequence

import torch

from cnr.app.console import progress_bar
from cnr.errors import CheckpointError, ConfigError, KeyNotFoundError
from cnr.restore.load import load_state_dict
from cnr.format.manifest import Manifest
from cnr.write.local_paths import check_creatable_dir
from cnr.format.catalog import newest_committed, read_manifest
from cnr.storage import open_storage
from cnr.types import Role

logger = logging.getLogger(__name__)

MODULE_ROLES = (Role.TABLE_ROWS, Role.DENSE)


def module_keys(manifest: Manifest) -> List[str]:
    """The app_state keys of the modules in ``manifest`` (first name component of their tensors)."""
    return sorted({n.split("/")[0] for n, e in manifest.tensors.items() if e.role in MODULE_ROLES})


def _check_out(out: str) -> None:
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        what = "already holds files" if os.path.isdir(out) else "is a file"
        raise ConfigError(f"export target {out} {what}; give a missing or empty directory (cnr never overwrites)")


def _manifest(uri: str, checkpoint: Optional[str]) -> Manifest:
    storage = open_storage(uri)
    try:
        if checkpoint is None:
            manifest = newest_committed(storage)
            if manifest is None:
                raise CheckpointError(f"no committed checkpoint in {storage.uri}: nothing to export")
            return manifest
        try:
            return read_manifest(storage, checkpoint)
        except KeyNotFoundError:
            raise CheckpointError(f"checkpoint {checkpoint!r} is not committed in {storage.uri}") from None
    finally:
        storage.close()


def export_dcp(uri: str, out: str, checkpoint: Optional[str] = None,
               keys: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Write the modules ``keys`` (default: all) of checkpoint ``checkpoint`` (default: the newest
    committed) under ``uri`` to the new DCP directory ``out``; return a summary dict."""
    out = os.path.abspath(out)
    _check_out(out)
    check_creatable_dir(out, "export target")  # before reading the store: creates nothing
    manifest = _manifest(uri, checkpoint)
    available = module_keys(manifest)
    wanted = sorted(set(keys)) if keys else available
    unknown = [k for k in wanted if k not in available]
    if unknown:
        raise ConfigError(f"--key {', '.join(unknown)} is not a module of checkpoint {manifest.id}; modules: {available}")
    with progress_bar("export", total=len(wanted) + 1, unit="step") as bar:  # each module's read, the DCP write
        state = {}
        for k in wanted:
            state[k] = load_state_dict(uri, k, manifest.id)
            bar.update(1)
        _write_dcp(state, out)
        bar.update(1)
    tensors = sum(len(sd) for sd in state.values())
    nbytes = sum(t.numel() * t.element_size() for sd in state.values() for t in sd.values())
    logger.info("exported checkpoint %s (step %d) modules %s: %d tensors, %d bytes to %s",
                manifest.id, manifest.step, wanted, tensors, nbytes, out)
    return {"checkpoint": manifest.id, "step": manifest.step, "keys": wanted, "tensors": tensors, "bytes": nbytes,
            "format": "dcp", "out": out, "torch": torch.__version__}


def _write_dcp(state: Dict[str, Dict[str, torch.Tensor]], out: str) -> None:
    """``state`` as a new DCP directory ``out``: written into a temporary sibling, renamed onto ``out``."""
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(out)}.tmp-{uuid.uuid4().hex[:12]}")
    os.mkdir(tmp)
    try:
        with warnings.catch_warnings():  # DCP warns that it saves in a single process: that is the intent
            warnings.simplefilter("ignore", UserWarning)
            import torch.distributed.checkpoint as dcp

            dcp.save(state, checkpoint_id=tmp, no_dist=True)
        _check_out(out)
        try:
            os.rename(tmp, out)  # atomic; replaces only a missing or empty directory
        except OSError as e:
            raise ConfigError(f"export target {out} could not be created ({e.strerror}); nothing was overwritten") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
