"""``python -m cnr bench conformance`` (issue #24's matrix) on a small subset: one
(model, fused, dense, policy) combination, three resumes, real spawned gloo ranks."""

from __future__ import annotations

import pytest

from cnr.systest import conformance
from cnr.app.cli import BENCHMARKS, main
from cnr.errors import ConfigError


def test_managed_collision_cells_are_exact_or_refused_never_wrong(tmp_path):
    out = conformance.run(["--models", "managed-collision", "--fused", "EXACT_ADAGRAD", "--dense", "sgd_momentum",
                           "--policies", "consecutive", "--resumes", "same_plan,other_plan,2to1",
                           "--workdir", str(tmp_path)])
    cell = "managed-collision/EXACT_ADAGRAD/sgd_momentum/consecutive/"
    assert out["wrong"] == [] and out["counts"]["wrong"] == 0
    assert out["cells"] == {cell + "same_plan": "exact", cell + "other_plan": "n/a", cell + "2to1": "refused"}
    assert out["counts"] == {"exact": 1, "refused": 1, "wrong": 0, "n/a": 1}
    refused = {r["cell"]: r["message"] for r in out["refused"]}
    assert "holds managed-collision state" in refused[cell + "2to1"]
    assert "cannot be restored at world size 1" in refused[cell + "2to1"]
    assert out["probes"] == {"managed-collision/EXACT_ADAGRAD": "runs"}


@pytest.mark.parametrize("argv,message", [
    (["--models", "ebc-family,dlrm"], "--models 'ebc-family,dlrm' is not allowed"),
    (["--fused", "EXACT_SGD,NOPE"], "--fused 'EXACT_SGD,NOPE' is not allowed"),
    (["--resumes", "3to1"], "--resumes '3to1' is not allowed; allowed: same_plan, other_plan, 2to1, 1to2"),
])
def test_unknown_names_are_refused(argv, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        conformance.run(argv)


def test_registered_and_bad_values_exit_2(capsys):
    assert "conformance" in BENCHMARKS
    assert main(["bench", "conformance", "--policies", "sometimes"]) == 2
    assert capsys.readouterr().err.startswith("error: bench conformance: --policies 'sometimes' is not allowed")
