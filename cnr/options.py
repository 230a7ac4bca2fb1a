"""``CheckpointOptions``: every knob of a checkpoint engine, validated when constructed.

The same rules as the ``checkpoint`` section of ``cnr train``'s config (cnr.app.config_checks.validate);
an error names the option as ``CheckpointOptions.<name>``.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Tuple, Union

from cnr.errors import ConfigError
from cnr.types import CodecSpec, SearchKernel


class OptionsError(ConfigError, ValueError):
    """A CheckpointOptions value is not allowed (a ValueError too, as Python APIs raise)."""


def _default_failures():
    from cnr.app.config import FailureConfig

    return FailureConfig()


@dataclass(frozen=True)
class CheckpointOptions:
    """How checkpoints are taken, stored and kept. Times in seconds, sizes in bytes.

    - ``policy``: "full", "one_shot", "consecutive" or "intermittent" (full baseline when the
      history predictor expects it to pay off; cnr.policy.kinds).
    - ``bits``: embedding rows stored at 2, 3, 4, 8 bits (row-wise quantized) or 32 (exact);
      ``quant_method``: "adaptive", "naive", "symmetric" or "" (the width's default);
      ``optimizer_bits``: 32, or 8 to store fused optimizer state in 8 bits too (2-D state
      row-wise, the 1-D row-wise Adagrad sum on a log grid, cnr.codec.log8), or 0 to let the
      failure budget choose (``bit_policy`` "failures").
    - ``compression``: "zstd" (lossless, quantized and log8 chunks' payloads, at
      ``compression_level`` 1..19) or "none".
    - ``small_table_rows``/``small_table_bits``: tables of at most ``small_table_rows`` rows
      (0: none) are stored at no fewer than ``small_table_bits`` (3, 4, 8, 32) bits.
    - ``table_bits``: table -> the width (2, 3, 4, 8, 32) its rows are stored at instead
      (a plan from ``bench tables``). A table is named by its id (as ``cnr inspect --tables``
      shows it) or by torchrec's table name when that is unique; the Checkpointer refuses
      names that match no table or several. Never below 8 after the fallback to 8 bits.
      ``table_plan_width``: the uniform width the plan stands in for (0: any); at another
      width (chosen by the failure budget, or the fallback) every table is stored at it.
    - ``bit_policy``: "fixed" (``bits``) or "failures" (chosen from the expected failures over
      ``expected_steps`` steps, ``failures``: a cnr.app.config.FailureConfig or a dict of its fields).
    - ``keep_last``: checkpoints of the job's history whose chains verify, kept after each commit
      with what their chains need (cnr.policy.retention; 0: all); ``merge_every``: merge consecutive chains into a new baseline every N increments.
    - ``max_chain_ratio``: with "intermittent" or "consecutive", a new baseline whenever the next
      chain (what a restore reads) is predicted to exceed this many baselines' bytes (0: no cap).
    - ``chunk_bytes``: largest stored chunk; ``upload_threads``/``encode_threads``/``restore_threads``:
      concurrent puts / chunks encoded at once per writer / objects fetched at once per rank on
      restore. Each encoding thread keeps one core busy while a checkpoint is written: more
      than 1 only where training leaves cores idle (a GPU host). ``search_kernel``: "auto",
      "eager" or "compiled", how the writer runs the adaptive search (cnr.types.SearchKernel).
    - ``on_overlap``: "wait" for the previous checkpoint at a save, or "abandon" it;
      ``commit_timeout_s``: how long rank 0 waits for every rank's data.
    - ``on_damage``: when the newest committed checkpoint does not verify on restore,
      "fallback" restores the newest one that does (cnr.restore.newest), "fail" raises.
    - ``local_dir``: a node-local directory in front of the storage (cnr.storage.tiered; "" none):
      a checkpoint commits there once every rank's chunks are durable on its node, then is
      flushed to the storage in the background and commits there too; each storage location has
      its own subdirectory of it (cnr.write.local_tier), so jobs may share one. ``local_keep_last``:
      committed checkpoints (with their chains) the local tier keeps (0: all).
    - ``lease_ttl_s``: the storage location's lease (cnr.write.lease, one writing job per location)
      expires this long after its holder's last renewal, when the holder is on another machine.
    """

    policy: str = "intermittent"
    bits: int = 32
    quant_method: str = ""
    optimizer_bits: int = 32
    compression: str = "zstd"
    compression_level: int = 3
    small_table_rows: int = 0
    small_table_bits: int = 8
    table_bits: Dict[str, int] = field(default_factory=dict)
    table_plan_width: int = 0
    bit_policy: str = "fixed"
    failures: Any = field(default_factory=_default_failures)
    expected_steps: int = 0
    keep_last: int = 2
    merge_every: int = 0
    max_chain_ratio: float = 0.0
    chunk_bytes: int = 16 * 1024 * 1024
    upload_threads: int = 2
    encode_threads: int = 1
    search_kernel: str = "auto"
    restore_threads: int = 2
    on_overlap: str = "wait"
    commit_timeout_s: float = 600.0
    lease_ttl_s: float = 60.0
    on_damage: str = "fallback"
    local_dir: str = ""
    local_keep_last: int = 1

    def __post_init__(self) -> None:
        from cnr.app.config import CheckpointConfig, FailureConfig, _build
        from cnr.app.config_checks import validate_checkpoint

        if isinstance(self.failures, Mapping):
            try:
                object.__setattr__(self, "failures", _build(FailureConfig, dict(self.failures), "checkpoint.failures"))
            except ConfigError as e:
                raise OptionsError(_rename(str(e))) from None
        if not isinstance(self.failures, FailureConfig):
            raise OptionsError(f"CheckpointOptions.failures = {self.failures!r:.80} is not allowed; give a "
                               "cnr.app.config.FailureConfig or a dict of its fields")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            want = {"int": int, "float": (int, float), "str": str}.get(str(f.type))
            if want is not None and (not isinstance(value, want) or isinstance(value, bool)):
                raise OptionsError(f"CheckpointOptions.{f.name} = {value!r:.80} is not allowed; it must be {f.type}")
        if self.bit_policy == "failures" and self.expected_steps < 1:
            raise OptionsError(f"CheckpointOptions.expected_steps = {self.expected_steps} is not allowed with "
                               "bit_policy 'failures'; it must be the job's length in steps (>= 1)")
        section = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "expected_steps"}
        try:
            validate_checkpoint(CheckpointConfig(**section))
        except ConfigError as e:
            raise OptionsError(_rename(str(e))) from None

    @classmethod
    def from_config(cls, section: Any, expected_steps: int = 0) -> "CheckpointOptions":
        """The options of a ``cnr train`` config's checkpoint section (cnr.app.config.CheckpointConfig)."""
        names = {f.name for f in dataclasses.fields(cls)}
        values: Dict[str, Any] = {k: v for k, v in dataclasses.asdict(section).items() if k in names}
        values["failures"] = section.failures
        return cls(**values, expected_steps=expected_steps)

    def compression_chain(self) -> Tuple[CodecSpec, ...]:
        """The bytes->bytes stages of quantized and log8 chunks' payloads (cnr.codec)."""
        from cnr.codec.zstd import zstd_spec  # zstandard loads only in processes that encode

        return (zstd_spec(self.compression_level),) if self.compression == "zstd" else ()

    def to_dict(self) -> Dict[str, Union[str, int, float, Dict]]:
        return dataclasses.asdict(self)

    def may_search(self) -> bool:
        """Whether some checkpoint may store rows with the adaptive range search: the failure
        budget choosing widths, or a width below 32 whose method (cnr.codec.quant.quantize.stored_method)
        is adaptive."""
        from cnr.codec.quant.quantize import stored_method

        widths = [w for w in (self.bits, *self.table_bits.values()) if w < 32]
        return self.bit_policy == "failures" or any(
            stored_method(w, self.bits, self.quant_method) == "adaptive" for w in widths)

    def for_writer(self, rows_per_rank: int) -> "CheckpointOptions":
        """These options with ``search_kernel`` "auto" made definite for a writer about to start
        (cnr.codec.quant.range_search.writer_kernel): "compiled", built as the writer starts, when checkpoints
        may search at least AUTO_COMPILE_ROWS of this rank's table rows, else "eager"."""
        from cnr.codec.quant.range_search import writer_kernel

        kernel = writer_kernel(SearchKernel(self.search_kernel), rows_per_rank, self.may_search())
        return dataclasses.replace(self, search_kernel=kernel.value)


@dataclass(frozen=True)
class PublishOptions:
    """How ``Checkpointer.publish`` sends fresh rows to inference (cnr.publish.publisher). Steps are training steps.

    - ``uri``: the publish store; "" means ``<checkpoint uri>/publish``. It must not overlap the
      checkpoint store's ``checkpoints/`` layout.
    - ``full_every``: every N-th publish (and the first of every run) is a full base, the others
      hold the rows touched since the previous publish.
    - ``dense_interval``: dense parameters go with every base and with the first publish at or
      after each multiple of this many steps.
    - ``bits``: 4, 8 (row-wise quantized) or 32 (exact); ``quant_method`` as in CheckpointOptions.
    - ``keep_bases``: after each commit keep the newest N bases and the publishes after the
      oldest of them (0: keep all).
    """

    uri: str = ""
    full_every: int = 10
    dense_interval: int = 100
    bits: int = 8
    quant_method: str = ""
    keep_bases: int = 2

    def __post_init__(self) -> None:
        from cnr.app.config import PublishConfig
        from cnr.app.config_checks import _validate_publish

        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            want = {"int": int, "str": str}[str(f.type)]
            if not isinstance(value, want) or isinstance(value, bool):
                raise OptionsError(f"PublishOptions.{f.name} = {value!r:.80} is not allowed; it must be {f.type}")
        try:  # publish.interval is the caller's business here: 1 makes any dense_interval a multiple
            _validate_publish(PublishConfig(True, self.uri, 1, self.full_every, self.dense_interval, self.bits,
                                            self.quant_method, self.keep_bases))
        except ConfigError as e:
            raise OptionsError(re.sub(r"config key 'publish\.(\w+)'", r"PublishOptions.\1", str(e))) from None

    @classmethod
    def from_config(cls, section: Any, uri: str) -> "PublishOptions":
        """The options of a ``cnr train`` config's publish section (cnr.app.config.PublishConfig),
        publishing to ``uri``."""
        return cls(uri, section.full_every, section.dense_interval, section.bits, section.quant_method,
                   section.keep_bases)


def _rename(message: str) -> str:
    """A config error's wording for the options: ``config key 'checkpoint.bits'`` -> ``CheckpointOptions.bits``."""
    message = re.sub(r"config key 'checkpoint\.([\w.]+)'", r"CheckpointOptions.\1", message)
    return re.sub(r"\bcheckpoint\.(\w+)", r"CheckpointOptions.\1", message)
