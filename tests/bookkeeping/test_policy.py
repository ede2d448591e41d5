"""psr.policy: the one source of policy defaults, the spec parser; pure bookkeeping."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from psr import policy as P


def test_defaults_come_from_one_place() -> None:
    assert P.make_policy("psr") == P.Policy("psr", P.DEFAULT_LAM, P.DEFAULT_N)
    assert P.make_policy("cache-prior") == P.Policy("cache-prior", P.DEFAULT_LAM, 0)
    assert P.make_policy("exact-prefetch") == P.Policy("exact-prefetch", 0.0, P.DEFAULT_N)
    assert P.parse_policies("cache-prior;psr") == [
        P.make_policy("exact"),
        P.make_policy("cache-prior"),
        P.make_policy("psr"),
    ]


@pytest.mark.parametrize(
    ("spec", "label"),
    [
        ("exact", "exact"),
        ("exact-prefetch:n=2", "exact-prefetch(n=2)"),
        ("cache-prior:lam=0.3", "cache-prior(lam=0.3)"),
        ("psr:lam=0.25,n=2", "psr(lam=0.25, n=2)"),
        (" psr : n=3 , lam=0.1 ", "psr(lam=0.1, n=3)"),
        ("cache-prior-async:lam=0.3,n=1", "cache-prior-async(lam=0.3, n=1)"),
    ],
)
def test_parse_policy_and_its_inverse(spec: str, label: str) -> None:
    p = P.parse_policy(spec)
    assert p.describe() == label
    assert P.parse_policy(p.spec()) == p


def test_parse_policies_keeps_order_adds_exact_and_drops_duplicates() -> None:
    ps = P.parse_policies("cache-prior:lam=0.3;psr:lam=0.2,n=2;psr:lam=0.2,n=2")
    assert [p.describe() for p in ps] == ["exact", "cache-prior(lam=0.3)", "psr(lam=0.2, n=2)"]
    assert P.parse_policies("psr", with_baseline=False) == [P.make_policy("psr")]
    assert P.parse_policies("psr;exact")[1] == P.make_policy("exact")


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("psr:k=2", "expected lam=<float> or n=<int>"),
        ("psr:lam", "expected lam=<float> or n=<int>"),
        ("psr:lam=abc", "lam='abc': expected a number"),
        ("psr:n=1.5", "n='1.5': expected an integer"),
        ("psr:n=1,n=2", "given twice"),
        ("psr:lam=-1", "lam must be a finite number >= 0"),
        ("psr:lam=nan", "lam must be a finite number >= 0"),
        ("lru", "unknown policy 'lru'"),
        ("exact:lam=0.3", "policy 'exact' has lam=0"),
        ("cache-prior:n=1", "policy 'cache-prior' has n=0"),
        (" ; ", "no policy"),
    ],
)
def test_bad_specs_name_the_problem(spec: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        P.parse_policies(spec)


def test_params_are_none_where_a_policy_has_no_such_parameter() -> None:
    assert P.make_policy("exact").params() == {"policy": "exact", "lam": None, "n": None}
    assert P.make_policy("exact-prefetch", n=2).params() == {
        "policy": "exact-prefetch",
        "lam": None,
        "n": 2,
    }
    assert P.make_policy("cache-prior", 0.1).params()["n"] is None


def test_policy_touches_no_files() -> None:
    """Reading, hashing and writing operating points is psr.points' job, not this module's."""
    tree = ast.parse(Path(P.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    roots = {m.split(".")[0] for m in imported}
    assert not roots & {"os", "pathlib", "hashlib", "json", "platformdirs", "io", "shutil"}
    assert roots <= {"__future__", "math", "dataclasses", "typing"}, roots
