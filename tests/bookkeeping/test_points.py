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
        f"tuned ({out})",
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


def _safetensors(path: Path, header: dict, data: bytes) -> None:
    """A safetensors file written by hand: 8-byte header length, JSON header, the bytes."""
    h = json.dumps(header).encode()
    path.write_bytes(len(h).to_bytes(8, "little") + h + data)


def _checkpoint(folder: Path, hidden: int = 4, config: dict | None = None) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config or {"model_type": "olmoe", "h": 1}))
    hdr = {"w": {"dtype": "F32", "shape": [hidden], "data_offsets": [0, 4 * hidden]}}
    _safetensors(folder / "model.safetensors", hdr, b"\0" * (4 * hidden))
    return folder


def test_model_key_is_config_and_tensor_layout_wherever_the_folder_lies(tmp_path) -> None:
    a = _checkpoint(tmp_path / "a")
    key = points.model_key(a)
    assert len(key) == 16 and int(key, 16) >= 0
    # Another folder with the same config and layout: the same checkpoint.
    b = _checkpoint(tmp_path / "elsewhere" / "b")
    assert points.model_key(b) == key
    # Config formatting is not identity, its content is.
    (b / "config.json").write_text(json.dumps({"h": 1, "model_type": "olmoe"}, indent=4))
    assert points.model_key(b) == key
    (b / "config.json").write_text(json.dumps({"model_type": "olmoe", "h": 2}))
    assert points.model_key(b) != key
    # A tensor of another shape changes the header, so the key; the tensors' bytes are
    # never read (changing them leaves the key).
    assert points.model_key(_checkpoint(tmp_path / "c", hidden=5)) != key
    data = bytearray((a / "model.safetensors").read_bytes())
    data[-4:] = b"\1\2\3\4"
    (a / "model.safetensors").write_bytes(bytes(data))
    assert points.model_key(a) == key
    # The weights index is part of it too.
    (a / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "x"}}))
    assert points.model_key(a) != key
    (a / "model.safetensors").write_bytes(b"\xff" * 8 + b"{}")
    with pytest.raises(ValueError, match="is not a safetensors file"):
        points.model_key(a)


def test_a_points_file_of_another_checkpoint_is_refused_and_says_whose(tmp_path) -> None:
    mine = _checkpoint(tmp_path / "mine")
    theirs = _checkpoint(tmp_path / "theirs", config={"model_type": "olmoe", "h": 3})
    pts = {
        "0.5": {
            "cache-prior": P.make_policy("cache-prior", 0.1),
            "psr": P.make_policy("psr", 0.2, 2),
        }
    }
    # Written for `theirs`, shipped beside `mine` (a copied operating_points.json).
    shipped = points.write_operating_points(theirs, pts, {}, mine / points.OPERATING_POINTS_FILE)
    want = (
        rf"tuned for another checkpoint, {theirs.resolve()} \(model key "
        rf"{points.model_key(theirs)}\), not {mine} \(model key {points.model_key(mine)}\)"
    )
    with pytest.raises(ValueError, match=want):
        points.resolve_policy("psr", model_dir=mine, residency=0.5)
    with pytest.raises(ValueError, match="tuned for another checkpoint"):
        points.operating_points(mine, 0.5)
    # The same file as the user's tuned file of `mine` (copied there by hand): refused too.
    points.user_points_file(mine).parent.mkdir(parents=True, exist_ok=True)
    shipped.rename(points.user_points_file(mine))
    with pytest.raises(ValueError, match="tuned for another checkpoint"):
        points.resolve_policy("psr", model_dir=mine, residency=0.5)
    # `theirs` itself takes it.
    points.write_operating_points(theirs, pts, {})
    assert points.resolve_policy("psr", model_dir=theirs, residency=0.5)[0] == pts["0.5"]["psr"]


def test_policy_sources_and_the_untuned_default_warning(tmp_path, caplog) -> None:
    model = _checkpoint(tmp_path / "m")
    caplog.set_level("WARNING", logger="psr")

    def resolve(*a, **k):
        caplog.clear()
        out = points.resolve_policy(*a, model_dir=model, residency=0.5, **k)
        return out, [r.getMessage() for r in caplog.records if r.name == "psr"]

    (pol, src), msgs = resolve("psr")
    assert pol == P.Policy("psr", P.DEFAULT_LAM, P.DEFAULT_N) and src == points.UNTUNED
    assert len(msgs) == 1 and "\n" not in msgs[0]
    assert f"psr(lam={P.DEFAULT_LAM:g}, n={P.DEFAULT_N}) is the untuned default" in msgs[0]
    # no heldout.txt in the folder: the command asks for the user's text
    assert msgs[0].endswith(f"psr tune --model {model} --text YOUR_TEXT --residency 0.5")
    (pol, src), msgs = resolve("cache-prior")
    assert (pol.lam, src, len(msgs)) == (P.DEFAULT_LAM, points.UNTUNED, 1)
    for given in (("psr", 0.1), ("psr", None, 2), ("exact",), ("exact-prefetch",)):
        (pol, src), msgs = resolve(*given)
        if given[1:] == (None, 2):  # n given, lam not: the bias is still the untuned one
            assert (src, len(msgs)) == (points.UNTUNED, 1)
        else:
            assert (src, msgs) == (points.GIVEN, [])
    (pol, src), msgs = resolve(P.make_policy("psr"))  # a Policy object: given as it is
    assert (src, msgs) == (points.GIVEN, [])
    # quality_budget never takes an untuned point
    with pytest.raises(ValueError, match=r"no operating point .* was tuned for a quality budget"):
        resolve("psr", quality_budget=0.01)
    # A tuned file with only a PSR point: Cache-Prior stays untuned.
    pts = {"0.5": {"psr": P.make_policy("psr", 0.2, 2)}}
    f = points.write_operating_points(model, pts, {"budget_nats": 0.01})
    (pol, src), msgs = resolve("psr")
    assert (pol, src, msgs) == (pts["0.5"]["psr"], f"tuned ({f})", [])
    (pol, src), msgs = resolve("cache-prior")
    assert (src, len(msgs)) == (points.UNTUNED, 1)
    with pytest.raises(ValueError, match="was tuned for a quality budget"):
        resolve("cache-prior", quality_budget=0.01)
    assert points.operating_points(model, 0.5)["cache-prior"] == P.make_policy("cache-prior")
