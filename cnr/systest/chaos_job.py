"""What ``bench chaos`` does to a running ``cnr train`` job and to its store.

- ``Job``: one attempt, a ``cnr train`` launcher in its own session, its output in files; a kill
  SIGKILLs its process group and every process below it (torchrun's workers, cnr.testing.nodes,
  run in sessions of their own): a machine failure of the whole job;
- process lookup by name (cnr.write.proc names the writers and readers) below the launcher;
- damage to stored objects: a flipped byte in a chunk object, a flipped bit in a manifest,
  always of the newest committed checkpoint's own objects, so that older chains stay intact.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from cnr.format.layout import checkpoint_prefix, manifest_key
from cnr.write.proc import READER, WRITER
from cnr.storage.base import Storage
from cnr.testing.procs import descendants


@dataclass
class Job:
    """One ``cnr train`` attempt."""

    args: List[str]
    env: Dict[str, str]
    workdir: str
    name: str
    launcher: List[str] = field(default_factory=lambda: ["-m", "cnr"])  # argv after the interpreter, before args
    proc: Optional[subprocess.Popen] = None
    started: float = 0.0
    ended: float = 0.0
    killed: bool = False
    events: List[str] = field(default_factory=list)

    def start(self) -> "Job":
        self._out = open(os.path.join(self.workdir, f"{self.name}.out"), "w")
        self._err = open(os.path.join(self.workdir, f"{self.name}.err"), "w")
        self.started = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, *self.launcher, *self.args], cwd=self.workdir, env=self.env,
                                     stdout=self._out, stderr=self._err, start_new_session=True)
        return self

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the whole job (launcher, ranks, writers, readers): a machine failure."""
        self.killed = True
        below = descendants(self.proc.pid)  # before the kill: orphans are re-parented
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in below:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def wait(self, timeout: float) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.events.append(f"did not end within {timeout:.0f} s: killed")
            self.kill()
            rc = self.proc.wait()
        self.ended = time.monotonic()
        self._out.close()
        self._err.close()
        return rc

    def stderr(self) -> str:
        with open(os.path.join(self.workdir, f"{self.name}.err")) as f:
            return f.read()

    def summary(self) -> Optional[Dict]:
        with open(os.path.join(self.workdir, f"{self.name}.out")) as f:
            lines = f.read().strip().splitlines()
        try:
            return json.loads(lines[-1]) if lines else None
        except ValueError:
            return None


WRITER_NAME, READER_NAME = WRITER, READER


# ---- damage to the store ---------------------------------------------------------------------


def corrupt_chunk(storage: Storage, ckpt_id: str, rng: random.Random) -> Optional[str]:
    """Flip one byte of one of ``ckpt_id``'s data objects; the key, or None when it has none."""
    keys = [k for k in storage.list(checkpoint_prefix(ckpt_id)) if "/rank-" in k and not k.endswith(".json")]
    if not keys:
        return None
    key = rng.choice(keys)
    data = bytearray(storage.get(key))
    if not data:
        return None
    at = rng.randrange(len(data))
    data[at] ^= 0xFF
    storage.put(key, bytes(data))
    return key


def corrupt_manifest(storage: Storage, ckpt_id: str, rng: random.Random) -> str:
    """Flip one bit of ``ckpt_id``'s manifest; the key."""
    key = manifest_key(ckpt_id)
    data = bytearray(storage.get(key))
    at = rng.randrange(len(data) * 8)
    data[at // 8] ^= 1 << (at % 8)
    storage.put(key, bytes(data))
    return key
