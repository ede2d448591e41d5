"""Model names (issue 42): a Hugging Face repo id resolved from a local Hub cache folder
(huggingface_hub's layout, files linked into blobs/), offline, `REPO:FILE.gguf`, a GGUF
stem as the served name, `psr list`, and a clear error with the fetch command when a
model is absent."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from tiny_models import tiny_model, write_checkpoint, write_tokenizer

import psr
from psr.cli import main
from psr.models.names import cached_models, resolve_model, served_name

REV = "0123456789abcdef0123456789abcdef01234567"


def _cache_repo(hub: Path, repo: str, files: Path) -> Path:
    """Put the files of folder `files` in the cache as huggingface_hub does: content in
    blobs/, the snapshot's entries links to them, refs/main naming the revision."""
    root = hub / f"models--{repo.replace('/', '--')}"
    snap = root / "snapshots" / REV
    snap.mkdir(parents=True)
    (root / "blobs").mkdir()
    for i, f in enumerate(sorted(files.iterdir())):
        blob = root / "blobs" / f"blob{i}"
        shutil.copyfile(f, blob)
        (snap / f.name).symlink_to(Path("..") / ".." / "blobs" / blob.name)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(REV)
    return snap


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> Path:
    from gguf_files import gguf_tiny_model, hf_tokenizer, write_gguf

    tmp = tmp_path_factory.mktemp("names")
    hub = tmp / "hub"
    ckpt = write_checkpoint(tiny_model("olmoe"), tmp / "olmoe")
    write_tokenizer(ckpt)
    _cache_repo(hub, "acme/tiny-moe", ckpt)
    ggufs = tmp / "ggufs"
    ggufs.mkdir()
    model = gguf_tiny_model("qwen3_moe", head_dim=32)
    write_gguf(model, ggufs / "tiny-Q4_K.gguf", {"experts": "Q4_K"}, tokenizer=hf_tokenizer())
    shutil.copyfile(ggufs / "tiny-Q4_K.gguf", ggufs / "tiny-copy.gguf")
    _cache_repo(hub, "acme/tiny-GGUF", ggufs)
    (hub / "models--acme--not-moe" / "snapshots" / REV).mkdir(parents=True)  # no files
    return hub


@pytest.fixture(autouse=True)
def _cache_env(hub, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_repo_ids_resolve_from_the_cache_only(hub, tmp_path) -> None:
    snap = hub / "models--acme--tiny-moe" / "snapshots" / REV
    assert resolve_model("acme/tiny-moe") == str(snap)
    gguf = resolve_model("acme/tiny-GGUF:tiny-Q4_K.gguf")
    assert gguf == str(hub / "models--acme--tiny-GGUF" / "snapshots" / REV / "tiny-Q4_K.gguf")
    assert resolve_model(str(tmp_path)) == str(tmp_path)  # an existing path stays itself
    with pytest.raises(FileNotFoundError, match=r"psr downloads nothing: fetch it with "
                       r"`hf download acme/absent`$"):  # fmt: skip
        resolve_model("acme/absent")
    with pytest.raises(FileNotFoundError, match=r"`hf download acme/tiny-GGUF other.gguf`$"):
        resolve_model("acme/tiny-GGUF:other.gguf")
    with pytest.raises(ValueError, match=r"holds 2 GGUF files .* name one: acme/tiny-GGUF:F"):
        resolve_model("acme/tiny-GGUF")
    # HF_HOME's layout when HF_HUB_CACHE is unset: $HF_HOME/hub.
    mp = pytest.MonkeyPatch()
    mp.delenv("HF_HUB_CACHE")
    mp.setenv("HF_HOME", str(hub.parent))
    try:
        assert resolve_model("acme/tiny-moe") == str(snap)
    finally:
        mp.undo()


def test_served_names() -> None:
    assert served_name("/x/models--acme--tiny-GGUF/snapshots/abc/tiny-Q4_K.gguf") == "tiny-Q4_K"
    assert served_name("/x/models--acme--tiny-moe/snapshots/abc") == "acme/tiny-moe"
    assert served_name("/x/my-model") == "my-model"


def test_load_and_generate_by_repo_id(hub, capsys) -> None:
    with psr.load("acme/tiny-moe", "exact", 0.5, progress=False) as model:
        assert model.path == resolve_model("acme/tiny-moe")
        text = model.tokenizer.decode(model.generate([5, 17, 33], max_new_tokens=2)[0].tolist())
    argv = ["generate", "--model", "acme/tiny-moe", "--prompt-ids", "5,17,33", "--quiet"]
    assert main([*argv, "--policy", "exact", "--residency", "0.5", "--max-new-tokens", "2"]) == 0
    assert capsys.readouterr().out == text + "\n"
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", "acme/absent", "--prompt-ids", "1", "--quiet"])
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.count("\n") == 1
    assert err.startswith("psr: error: --model acme/absent: not a local path, and not in the")
    assert err.rstrip().endswith("`hf download acme/absent`")


def test_psr_list_shows_what_psr_can_load(hub, capsys) -> None:
    found = {m.name: m for m in cached_models()}
    assert set(found) == {
        "acme/tiny-moe",
        "acme/tiny-GGUF:tiny-Q4_K.gguf",
        "acme/tiny-GGUF:tiny-copy.gguf",
    }  # not-moe: no files
    assert found["acme/tiny-moe"].family == "olmoe"
    assert found["acme/tiny-GGUF:tiny-copy.gguf"].family == "qwen3_moe"
    blobs = hub / "models--acme--tiny-moe" / "blobs"
    assert found["acme/tiny-moe"].size == sum(f.stat().st_size for f in blobs.iterdir())
    assert main(["list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["NAME", "FAMILY", "SIZE"]
    assert any(line.split()[:2] == ["acme/tiny-moe", "olmoe"] for line in out)
    assert main(["inspect", "--model", "acme/tiny-GGUF:tiny-copy.gguf"]) == 0
    capsys.readouterr()
