"""psr.points: a model's operating points from its files, else psr.policy's defaults."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from psr import points
from psr import policy as P


def test_operating_points_from_file_else_defaults(tmp_path) -> None:
    pts, src = points.operating_points_with_source(tmp_path, 0.5)
    assert src == "defaults"
    assert pts == {"cache-prior": P.make_policy("cache-prior"), "psr": P.make_policy("psr")}
    (tmp_path / points.OPERATING_POINTS_FILE).write_text(
        json.dumps({"points": {"0.5": {"cache-prior": {"lam": 0.05}, "psr": {"lam": 0.1, "n": 2}}}})
    )
    pts, src = points.operating_points_with_source(tmp_path, 0.5)
    assert src.endswith(points.OPERATING_POINTS_FILE)
    assert pts["psr"] == P.make_policy("psr", 0.1, 2)
    assert pts["cache-prior"] == P.make_policy("cache-prior", 0.05)
    assert points.operating_points(tmp_path, 0.25)["psr"] == P.make_policy(
        "psr"
    )  # absent residency
    assert [p.name for p in P.standard_policies(pts)] == [
        "exact",
        "exact-prefetch",
        "cache-prior",
        "psr",
    ]


def test_the_users_tuned_file_wins_over_the_shipped_one(tmp_path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    shipped = {"points": {"0.5": {"cache-prior": {"lam": 0.05}, "psr": {"lam": 0.1, "n": 2}}}}
    (model / points.OPERATING_POINTS_FILE).write_text(json.dumps(shipped))
    tuned = {
        "0.5": {
            "cache-prior": P.make_policy("cache-prior", 0.3),
            "psr": P.make_policy("psr", 0.4, 1),
        }
    }
    out = points.write_operating_points(model, tuned, {"budget_nats": 0.01})
    assert out == points.user_points_file(model) and out.is_file()
    assert not out.with_suffix(".json.tmp").exists()
    pts, src = points.operating_points_with_source(model, 0.5)
    assert (pts, src) == (tuned["0.5"], str(out))
    # the budget recorded in the file gates resolve_policy
    assert points.resolve_policy("psr", model_dir=model, residency=0.5, quality_budget=0.02) == (
        tuned["0.5"]["psr"],
        str(out),
    )
    with pytest.raises(ValueError, match=r"tuned for a budget of 0\.01 nats/token"):
        points.resolve_policy("psr", model_dir=model, residency=0.5, quality_budget=0.001)


def test_points_reads_files_but_imports_nothing_heavy() -> None:
    tree = ast.parse(Path(points.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    heavy = {"torch", "triton", "numpy", "psr_kernels"}
    assert not {m.split(".")[0] for m in imported} & heavy
    assert not [m for m in imported if m.startswith(("psr.store", "psr.runtime", "psr.models"))]
