"""Serving publishes from torchrec's quantized inference modules (cnr.publish.serving, serving_tables).

One small sharded job (cnr.testing.jobs: an EBC with a column-split, a table-wise and a row-wise
table, a weighted EBC and an EmbeddingCollection) is trained once per publish setting, identically (the same
seeds and batches), publishing at every step through cnr.Checkpointer (bases at seq 1 and 4,
increments between) and saving an fp32 checkpoint of the final state, the trainer's rows.
Settings: 8 and 4 bits with serving parameters (the default), 32 bits, and 8 bits without
serving parameters (the float32 ones of earlier publishes).
"""

from __future__ import annotations

from typing import Dict

import pytest
import torch

import cnr
from cnr.app.launch import launch
from cnr.codec.quant.bitpack import unpack
from cnr.format.catalog import read_manifest
from cnr.format.chunks import fetch_chunk
from cnr.publish.module_target import ModuleTarget
from cnr.publish.serving import ServingTarget
from cnr.publish.serving_tables import ServingTable, quantize_tables
from cnr.publish.subscriber import Subscriber, committed_publishes
from cnr.storage.local import LocalStorage
from cnr.testing.jobs import JobSpec, Model, batch, build, train_step

SPEC = JobSpec(tables=("column_wise", "table_wise", "row_wise"), weighted=("table_wise",),
               sequence=("table_wise", "row_wise"))
STEPS = 5
SETTINGS = {"b8": {"bits": 8}, "b4": {"bits": 4}, "b32": {"bits": 32}, "b8_fp32_params": {"bits": 8, "serving_params": False}}
SPLIT = "model/ebc.embedding_bags.t_0.weight"  # column_wise: its pieces carry their own scales
WHOLE = ["model/ebc.embedding_bags.t_1.weight", "model/ebc.embedding_bags.t_2.weight",
         "model/webc.embedding_bags.w_0.weight", "model/ec.embeddings.s_0.weight", "model/ec.embeddings.s_1.weight"]


def _train(rank: int, world_size: int, arg: Dict) -> Dict:
    for name, setting in SETTINGS.items():
        dmp, opt = build(SPEC, world_size)
        publish = cnr.PublishOptions(full_every=3, dense_interval=1, keep_bases=0, **setting)
        uri = f"{arg['root']}/{name}"
        with cnr.Checkpointer(uri, {"model": dmp, "optim": opt}, cnr.CheckpointOptions(policy="full"),
                              publish=publish) as ckpt:
            for step in range(1, STEPS + 1):
                train_step(SPEC, dmp, opt, step, rank)
                ckpt.publish(step)
                ckpt.publisher.wait()  # nothing skipped: seq 1..5, bases at 1 and 4
            ckpt.publish(STEPS, wait=True)
            ckpt.save(STEPS).wait()
    return {}


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("serving")
    launch(_train, 1, {"root": str(root)})
    return {name: str(root / name) for name in SETTINGS}


def _serving(bits: int) -> ServingTarget:
    return ServingTarget(quantize_tables(Model(SPEC), bits))


def _fp32() -> ModuleTarget:
    model = Model(SPEC)
    for module in (model.ebc, model.webc, model.ec):
        module.to_empty(device=torch.device("cpu"))
    return ModuleTarget(model)


def _follow(uri: str, target: ModuleTarget) -> Subscriber:
    sub = Subscriber(uri + "/publish", target)
    sub.poll()
    assert sub.applied is not None and sub.applied.seq == STEPS and sub.stats.errors == [], sub.stats.errors
    return sub


def _fbgemm(values: torch.Tensor, bits: int) -> Dict[str, torch.Tensor]:
    """fbgemm's own quantization of ``values`` (what torchrec's from_float stores)."""
    fused = torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(values.contiguous(), bits)
    width = fused.shape[1] - 4
    params = fused[:, width:].contiguous().view(torch.float16)
    return {"codes": fused[:, :width], "scale": params[:, :1], "bias": params[:, 1:]}


def _dequantized(parts: Dict[str, torch.Tensor], bits: int, dim: int) -> torch.Tensor:
    return unpack(parts["codes"], bits, dim).float() * parts["scale"].float() + parts["bias"].float()


def _served(target: ServingTarget, name: str) -> torch.Tensor:
    table = target.tables[name]
    return table.values(torch.arange(table.rows))


def _parts(target: ServingTarget, name: str) -> Dict[str, torch.Tensor]:
    table = target.tables[name]
    return {"codes": table.codes, "scale": table.scale, "bias": table.bias}


def _assert_parts_equal(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor], what: str) -> None:
    for part in ("codes", "scale", "bias"):
        assert torch.equal(got[part], want[part]), f"{what}: {part} differs"


@pytest.mark.parametrize("setting", ["b8", "b4"])
def test_publishes_at_the_serving_width_are_copied_as_stored(stores, setting, monkeypatch):
    """After every publish the table rows it holds are its stored codes, scale and bias, bit for bit:
    a path that dequantized and re-quantized would store fbgemm's own scales instead (at 4 bits
    they differ; at 8 bits they are the same rows, so there the conversion is watched too)."""
    bits = SETTINGS[setting]["bits"]
    storage = LocalStorage(stores[setting] + "/publish")
    converted = []
    convert = ServingTable.convert
    monkeypatch.setattr(ServingTable, "convert", lambda self, chunks: (converted.append(self.name), convert(self, chunks)))
    target = _serving(bits)
    sub = Subscriber(storage, target)
    split_pieces = 0
    for _seq, pub_id in committed_publishes(storage):
        assert sub.apply(pub_id)
        manifest = read_manifest(storage, pub_id)
        for name in WHOLE:
            for ref in manifest.tensors[name].chunks if name in manifest.tensors else ():
                chunk = fetch_chunk(storage, ref, dequantize=False)
                q = chunk.quantized
                assert q.bits == bits and q.scale.dtype == q.bias.dtype == torch.float16, (name, q.bits, q.scale.dtype)
                rows = chunk.row_ids if chunk.row_ids is not None else torch.arange(ref.row_start, ref.row_start + ref.rows)
                table = target.tables[name]
                assert torch.equal(table.codes[rows], q.codes), name
                assert torch.equal(table.scale[rows, 0], q.scale) and torch.equal(table.bias[rows, 0], q.bias), name
        split_pieces += sum(ref.cols < 16 for ref in manifest.tensors[SPLIT].chunks) if SPLIT in manifest.tensors else 0
    assert split_pieces, "the column_wise table was published whole: the conversion path went untested"
    assert sub.applied.seq == STEPS
    assert set(converted) == {SPLIT[len("model/"):]}, converted  # only the column-split table converts


def _error(trainer: torch.Tensor, served: torch.Tensor) -> float:
    return float((trainer.double() - served.double()).square().sum())


@pytest.mark.parametrize("setting", ["b8", "b4"])
def test_served_rows_are_at_most_fbgemm_requantization_error_of_the_trainer_rows(stores, setting, capsys):
    bits = SETTINGS[setting]["bits"]
    target = _serving(bits)
    _follow(stores[setting], target)
    trainer = cnr.load_state_dict(stores[setting], "model")
    figures = {}
    for name in WHOLE:
        x = trainer[name[len("model/"):]]
        served, fbgemm = _error(x, _served(target, name)), _error(x, _dequantized(_fbgemm(x, bits), bits, x.shape[1]))
        figures[name] = (served, fbgemm)
        assert served <= fbgemm * (1 + 1e-6) + 1e-12, (name, served, fbgemm)
        if bits == 8:  # the naive 8-bit rows with fp16 parameters are fbgemm's own rows
            _assert_parts_equal(_parts(target, name), _fbgemm(x, bits), name)
    with capsys.disabled():
        print(f"\n{setting}: squared error vs the trainer's rows (served, fbgemm requantization): {figures}")


@pytest.mark.parametrize("setting,bits", [("b8", 8), ("b4", 4), ("b32", 8), ("b32", 4), ("b8_fp32_params", 8),
                                          ("b8", 4)])
def test_other_widths_params_and_column_splits_are_converted_once_by_fbgemm(stores, setting, bits):
    """Whatever is not copied as stored holds fbgemm's quantization of the published values: a
    32-bit publish (the trainer's rows), float32 parameters, another width, a column-split table."""
    target, fp32 = _serving(bits), _fp32()
    _follow(stores[setting], target)
    _follow(stores[setting], fp32)
    published = fp32.tensors
    converted = list(target.tables) if (setting != f"b{bits}") else [SPLIT]
    for name in converted:
        _assert_parts_equal(_parts(target, name), _fbgemm(published[name], bits), name)


def _feature(table: str) -> str:
    """The feature of a table of SPEC's model (t_i serves f_i, w_i g_i, s_i h_i)."""
    name = table.split(".")[-2]
    return {"t": "f_", "w": "g_", "s": "h_"}[name[0]] + name[2:]


def _lookups(module: torch.nn.Module, step: int) -> Dict[str, torch.Tensor]:
    """Pooled EBC rows (weighted ones too) and EC sequence rows of step ``step``'s batch, per feature."""
    kjt, weighted, sequence = batch(SPEC, step, 0)
    out = dict(module.ebc(kjt).to_dict())
    out.update(module.webc(weighted).to_dict())
    out.update({f: jt.values() for f, jt in module.ec(sequence).items()})
    return out


@pytest.mark.parametrize("setting,bits", [("b8", 8), ("b4", 4), ("b32", 4)])
def test_lookups_equal_the_fp32_module_holding_the_published_values(stores, setting, bits):
    """fbgemm's quantized EBC and EC answer as the fp32 modules holding the published values do
    (up to the kernels' float rounding) for tables copied as stored, and as the fp32 modules
    holding the served values for every table."""
    target, fp32 = _serving(bits), _fp32()
    _follow(stores[setting], target)
    _follow(stores[setting], fp32)
    for name in target.tensors:  # dense parameters are applied in fp32, exactly
        assert torch.equal(target.tensors[name], fp32.tensors[name]), name
    copied = WHOLE if setting == f"b{bits}" else []
    steps = (1, 2, 3)
    for step in steps:
        got, want = _lookups(target.module, step), _lookups(fp32.module, step)
        assert sorted(got) == sorted(want)
        for table in copied:
            f = _feature(table)
            assert torch.allclose(got[f], want[f], rtol=1e-5, atol=1e-6), (f, float((got[f] - want[f]).abs().max()))
    for name in target.tables:  # the fp32 reference now holds what the served table holds, dequantized
        fp32.module.get_parameter(name[len("model/"):]).data.copy_(_served(target, name))
    for step in steps:
        got, want = _lookups(target.module, step), _lookups(fp32.module, step)
        for f in want:
            assert torch.allclose(got[f], want[f], rtol=1e-5, atol=1e-6), (f, float((got[f] - want[f]).abs().max()))


def test_a_served_model_resumes_from_its_state_file(stores, tmp_path):
    uri, path = stores["b4"] + "/publish", str(tmp_path / "serving-state.pt")
    first = Subscriber(uri, _serving(4), state_path=path)
    ids = [pub_id for _seq, pub_id in committed_publishes(LocalStorage(uri))]
    for pub_id in ids[:3]:
        first.apply(pub_id)
    first.save_state(path)
    restarted = Subscriber(uri, _serving(4), state_path=path)
    assert restarted.applied == first.applied and restarted.applied.seq == 3
    for name in first.model.tables:
        _assert_parts_equal(_parts(restarted.model, name), _parts(first.model, name), name)
    assert restarted.poll() == ids[3:]
    fresh = _follow(stores["b4"], _serving(4))
    snapshot, expected = restarted.model.snapshot(), fresh.model.snapshot()
    assert sorted(snapshot) == sorted(expected)
    for key in expected:
        assert torch.equal(snapshot[key], expected[key]), key
    with pytest.raises(cnr.CheckpointError, match="not made for this serving model"):
        Subscriber(uri, _serving(8), state_path=path)


def test_tables_take_a_quarter_of_fp32_or_less(stores):
    target = _serving(4)
    fp32_bytes = sum(t.rows * t.dim * 4 for t in target.tables.values())
    # dim 16 at int4: 8 code bytes + 4 parameter bytes, padded to fbgemm's 16-byte rows
    assert target.table_bytes == fp32_bytes // 4
    assert _serving(8).table_bytes == fp32_bytes // 2


def test_a_module_with_other_tables_is_refused_by_name():
    from torchrec.modules.embedding_configs import DataType

    model = quantize_tables(Model(SPEC), 8)
    model.ec._key_to_tables[next(iter(model.ec._key_to_tables))][0].data_type = DataType.FP16
    with pytest.raises(ValueError, match="table ec.embeddings.s_0 is FP16; a serving target takes int8 and int4"):
        ServingTarget(model)


def test_published_tables_must_match_the_served_shapes(stores):
    target = _serving(8)
    with pytest.raises(cnr.CheckpointError, match="served table has 40 rows of 16"):
        target.check_tensor(WHOLE[0], (41, 16), "float32")
    sub = Subscriber(stores["b8"] + "/publish", target)
    assert sorted(sub.model.published_names()) == sorted(set(target.tables) | set(target.tensors))
    assert "model/over.weight" in target.tensors and not any(":" in n or "qscale" in n for n in target.tensors)


def test_values_float16_cannot_hold_are_converted_with_a_warning(caplog):
    from cnr.codec.chunk_format import decode_chunk, encode_raw_chunk

    target = _serving(8)
    name = WHOLE[0]
    values = torch.randn(3, 16)
    values[1, 2] = -1e6  # beyond float16's -65504: fbgemm's bias for the row is -inf
    blob, ref = encode_raw_chunk("k", name, values, 5, 0)
    target.apply([decode_chunk(blob, ref)])
    assert "table ebc.embedding_bags.t_1.weight: 1 rows hold values beyond float16's range" in caplog.text
    assert torch.equal(_parts(target, name)["codes"][5:8], _fbgemm(values, 8)["codes"])
