"""`psr tune` on the user's text (psr.eval.text): reading, the A/B split, the budget's token
count, and tuning end to end on a tiny random checkpoint and on the embedded model."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from tiny_models import tiny_model, write_checkpoint, write_tokenizer

from psr.eval import text as T

LINE = "Now is the winter of our discontent made glorious summer by this sun of York.\n"


def chars(t: str) -> dict[str, list[int]]:
    """A tokenizer of one token per character (the tests count tokens independently)."""
    return {"input_ids": [ord(c) for c in t]}


def test_a_folder_is_its_txt_and_jsonl_files_sorted_and_split_by_whole_documents(
    tmp_path,
) -> None:
    docs = ["alpha " * 20, "bravo " * 20, "charlie " * 15, "delta " * 20]
    (tmp_path / "b.txt").write_text(docs[2])
    (tmp_path / "c.txt").write_text(docs[3])
    recs = [{"text": docs[0]}, {"text": "   "}, {"text": docs[1], "id": 7}]  # blank: skipped
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n\n")
    (tmp_path / "notes.md").write_text("not read")
    got = T.read_documents(tmp_path)
    assert [t for _, t in got] == docs
    assert [n for n, _ in got] == ["a.jsonl:1", "a.jsonl:3", "b.txt", "c.txt"]
    sets = T.text_sets(tmp_path)
    # The boundary nearest the middle of the joined text is after the second document.
    assert sets["A"][1] == docs[0] + "\n\n" + docs[1]
    assert sets["B"][1] == docs[2] + "\n\n" + docs[3]
    assert "set A of" in sets["A"][0] and "(documents 1-2 of 4)" in sets["A"][0]
    assert "(documents 3-4 of 4)" in sets["B"][0]
    assert T.text_sets(tmp_path) == sets  # deterministic
    (tmp_path / "c.txt").write_text(docs[3] + "more")
    assert T.text_sets(tmp_path)["A"][0] != sets["A"][0]  # a changed text: another hash


def test_one_document_is_cut_at_the_line_break_before_its_middle(tmp_path) -> None:
    text = "".join(f"{i} {LINE}" for i in range(10))
    (tmp_path / "t.txt").write_text(text)
    sets = T.text_sets(tmp_path / "t.txt")
    cut = text.rfind("\n", 0, len(text) // 2) + 1
    assert (sets["A"][1], sets["B"][1]) == (text[:cut], text[cut:])
    assert sets["A"][1].endswith("4 " + LINE) and sets["B"][1].startswith("5 Now")
    # Two documents of very unequal length: no boundary in the middle third, so a line cut.
    (tmp_path / "u.txt").write_text("x")
    sets = T.text_sets(tmp_path)
    assert "characters" in sets["A"][0] and sets["A"][1] + sets["B"][1] == text + "\n\nx"


def test_bad_text_is_a_clear_error(tmp_path) -> None:
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.txt").write_text(" \n\n ")
    (tmp_path / "latin1.txt").write_bytes(b"so fair and foul a day\ncaf\xe9")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\nnot json\n')
    (tmp_path / "notext.jsonl").write_text('{"body": "x"}\n')
    (tmp_path / "empty_dir").mkdir()
    cases = {
        "empty.txt": r"empty\.txt: no text \(empty\)",
        "blank.txt": r"no text \(empty\)",
        "latin1.txt": r"latin1\.txt: not UTF-8 \(byte 26: b'\\xe9'\)",
        "bad.jsonl": "line 2 is not JSON",
        "notext.jsonl": "line 1 has no string field 'text'",
        "empty_dir": "a folder without .txt or .jsonl files",
        "missing.txt": "no such file or folder",
    }
    for name, want in cases.items():
        with pytest.raises(T.TextError, match=want):
            T.text_sets(tmp_path / name)


def test_the_budget_sets_the_tokens_each_set_needs(tmp_path) -> None:
    # The rule: (2 * 1.96)^2 * dispersion / budget decode-path tokens per set.
    assert T.tokens_needed(0.01) == math.ceil(3.919928**2 * 3.84 / 0.01) == 5901
    assert T.windows_needed(0.01, 128) == 47
    assert T.windows_needed(100.0, 128) == T.MIN_WINDOWS == 2
    with pytest.raises(T.TextError, match="no text makes the interval narrower"):
        T.tokens_needed(0.0)
    sets = {"A": ("a", "x" * 500), "B": ("b", "y" * 300)}
    budget, wt, pt = 0.5, 40, 8  # 32 decode-path tokens a window
    need = max(2, math.ceil(3.919928**2 * 3.84 / budget / 32))  # 4 windows: 160 tokens a set
    assert T.check_sets(chars, sets, "src", budget, 160, wt, pt) == min(500, 300) // wt
    assert T.check_sets(chars, sets, "src", budget, need, wt, pt) == need
    with pytest.raises(T.TextError, match=rf"--windows 3: .* needs {need} windows per set"):
        T.check_sets(chars, sets, "src", budget, need - 1, wt, pt)
    short = {"A": ("a", "x" * 150), "B": ("b", "y" * 100)}
    want = (
        rf"src: 250 tokens \(set A 150, set B 100\); the 0.5 nats/token budget needs {need} "
        rf"windows of {wt} tokens in each set \(160 per set, 320 in all\) for a 95% interval "
        r"narrower than the budget: about 70 more tokens"
    )
    with pytest.raises(T.TextError, match=want):
        T.check_sets(chars, short, "src", budget, 160, wt, pt)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random OLMoE with a tokenizer and no heldout.txt; and a tiny random checkpoint
    of another shape (a different model)."""
    root = tmp_path_factory.mktemp("tt")
    path = write_checkpoint(tiny_model("olmoe"), root / "olmoe")
    write_tokenizer(path)
    other = write_checkpoint(tiny_model("qwen3_moe"), root / "qwen3")
    write_tokenizer(other)
    return path, other


def _untuned_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "untuned default" in r.getMessage()]


def test_tune_on_the_users_text_end_to_end_on_a_tiny_checkpoint(tiny, tmp_path, caplog) -> None:
    import psr
    from psr.eval.runs import tune
    from psr.points import model_key, user_points_file

    ckpt, other = tiny
    caplog.set_level("WARNING", logger="psr")
    text = tmp_path / "mine.jsonl"
    text.write_text("".join(json.dumps({"text": LINE * 6}) + "\n" for _ in range(4)))
    kw = dict(residencies=[0.5], lams=[0.5, 1.0], ns=[0, 1], window_tokens=64, progress=False)
    # the default budget (0.01): 5,901 decode-path tokens, 185 windows of 32 per set
    with pytest.raises(ValueError, match=r"--windows 2: .* needs 185 windows per set"):
        tune(str(ckpt), str(tmp_path / "o"), windows=2, text=str(text), **kw)
    with pytest.raises(
        ValueError, match=r"tokens \(set A 9\d\d, set B 9\d\d\); .* needs 47 windows of 64"
    ):
        tune(str(ckpt), str(tmp_path / "o"), budget=0.04, windows=300, text=str(text), **kw)
    assert not (tmp_path / "o").exists()  # refused before anything ran

    res = tune(str(ckpt), str(tmp_path / "o"), budget=10.0, windows=2, text=str(text), **kw)
    assert [row["replicated"] for row in res["replication"]] == [True, True]
    assert "set A of" in res["selected_on"] and "(documents 1-2 of 4)" in res["selected_on"]
    assert "(documents 3-4 of 4)" in res["replicated_on"]
    f = Path(res["file"])
    assert f == user_points_file(ckpt) and f.name == f"{model_key(ckpt)}.json"
    assert json.loads(f.read_text())["model_key"] == model_key(ckpt)
    assert not list(ckpt.glob("operating_points*"))  # the model folder is never written

    caplog.clear()
    m = psr.load(ckpt, "psr", residency=0.5, progress=False)
    assert m.policy == res["points"]["0.5"]["psr"] and m.policy_source == f"tuned ({f})"
    assert _untuned_warnings(caplog) == []
    assert psr.load(ckpt, "psr", 0.5, quality_budget=10.0, progress=False).policy == m.policy
    # At another residency nothing was measured: the untuned default, one warning per load.
    for _ in range(2):
        caplog.clear()
        m = psr.load(ckpt, "psr", residency=1.0, progress=False)
        assert (m.policy.lam, m.policy_source) == (psr.DEFAULT_LAM, "untuned default")
        (msg,) = _untuned_warnings(caplog)
        assert msg.endswith(f"psr tune --model {ckpt} --text YOUR_TEXT --residency 1")
    # Another model never picks the point up: untuned, warned once per load.
    assert model_key(other) != model_key(ckpt)
    caplog.clear()
    m = psr.load(other, "psr", residency=0.5, progress=False)
    assert (m.policy_source, len(_untuned_warnings(caplog))) == ("untuned default", 1)
    with pytest.raises(ValueError, match="was tuned for a quality budget"):
        psr.load(other, "psr", residency=0.5, quality_budget=10.0, progress=False)
    # ... even when the file is copied beside it: refused, naming whose it is.
    shutil.copy(f, other / "operating_points.json")
    try:
        with pytest.raises(ValueError, match=rf"tuned for another checkpoint, {ckpt}"):
            psr.load(other, "psr", residency=0.5, progress=False)
    finally:
        (other / "operating_points.json").unlink()

    # A selection is reused only on the same text's set A.
    sel = str(tmp_path / "o" / "select" / "sweep.json")
    again = tune(str(ckpt), str(tmp_path / "a"), budget=10.0, windows=2, text=str(text),
                 select_from=sel, write=str(tmp_path / "a.json"), **kw)  # fmt: skip
    assert again["points"] == res["points"]
    (tmp_path / "changed.txt").write_text(LINE * 24)
    with pytest.raises(ValueError, match="not measured on set A of"):
        tune(str(ckpt), str(tmp_path / "a"), budget=10.0, windows=2,
             text=str(tmp_path / "changed.txt"), select_from=sel, **kw)  # fmt: skip


def test_tune_on_the_users_text_on_the_embedded_model(tmp_path, caplog) -> None:
    import psr
    from psr.eval.runs import tune
    from psr.points import user_points_file

    # The user's text: some Shakespeare (Sonnet 18), twice as two files.
    sonnet = (
        "Shall I compare thee to a summer's day?\nThou art more lovely and more temperate:\n"
        "Rough winds do shake the darling buds of May,\nAnd summer's lease hath all too short "
        "a date;\n"
    ) * 6
    folder = tmp_path / "text"
    folder.mkdir()
    (folder / "1.txt").write_text(sonnet)
    (folder / "2.txt").write_text(sonnet.upper())
    res = tune(
        psr.DEFAULT_MODEL,
        str(tmp_path / "o"),
        [0.5],
        budget=1.0,
        lams=[0.1],
        ns=[1],
        windows=4,
        window_tokens=48,
        progress=False,
        text=str(folder),
    )
    f = user_points_file(psr.DEFAULT_MODEL)
    assert res["file"] == str(f) and set(res["points"]["0.5"]) == {"psr"}  # n=0 not in grid
    caplog.set_level("WARNING", logger="psr")
    m = psr.load(psr.DEFAULT_MODEL, "psr", 0.5, progress=False)
    assert m.policy == psr.make_policy("psr", 0.1, 1) and m.policy_source == f"tuned ({f})"
    # Cache-Prior was not tuned here: the point shipped with the model still serves it.
    cp = psr.load(psr.DEFAULT_MODEL, "cache-prior", 0.5, progress=False)
    assert cp.policy_source.endswith("default_model/operating_points.json)")
    assert _untuned_warnings(caplog) == []


def test_interval_note_says_how_many_more_tokens_narrow_set_a_below_the_budget() -> None:
    from psr.eval.runs import interval_note

    def row(policy: str, mean: float, lo: float, hi: float) -> dict:
        return {"config": {"policy": policy}, "delta_nll": {"mean": mean, "lo": lo, "hi": hi}}

    narrow = [row("psr", 0.004, 0.001, 0.008), row("cache-prior", 0.02, 0.0, 0.05)]
    assert interval_note(narrow, 0.01, 1000) is None  # the wide one is past the budget anyway
    wide = [*narrow, row("psr", 0.006, -0.004, 0.016), row("exact", 0.0, -1.0, 1.0)]
    note = interval_note(wide, 0.01, 1000)
    # width 0.02 = 2x the budget: 4x the tokens, i.e. 3,000 more per set
    assert note is not None and "up to 0.0200 nats/token wide" in note
    assert "about 3,000 more decode-path tokens per set" in note
