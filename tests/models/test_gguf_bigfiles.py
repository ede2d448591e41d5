"""GGUF files bigger than memory: psr's reader maps them read-only and shared (never
copy-on-write, which the kernel refuses past the memory it can commit), reads the header
itself (what gguf-py reads, per key and tensor) and parses the tokenizer's arrays only when
asked; header-faithful files of real models (bench/fit_table.py: metadata and tensor table
as published, data left as holes) open with little memory, split sets included."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf_files import fit_table, gguf_tiny_model, hf_tokenizer, write_gguf
from procfs import rss_bytes

from psr.models.gguf import GGUFCheckpoint
from psr.models.gguf_load import layer_formats
from psr.models.tiers import meminfo
from psr.runtime.spec import MoESpec


def _same(a: object, b: object) -> bool:
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) or isinstance(b, float):
        return bool(np.float32(a) == np.float32(b))  # type: ignore[arg-type]
    return a == b


def test_header_agrees_with_gguf_py(tmp_path: Path) -> None:
    """Every metadata value and tensor-table entry as gguf-py's reader (the reference)
    reads them, split parts included."""
    model = gguf_tiny_model("qwen3_moe", layers=2)
    write_gguf(model, tmp_path / "m.gguf", "Q8_0", split=2, tokenizer=hf_tokenizer())
    parts = sorted(tmp_path.glob("*.gguf"))
    ck = GGUFCheckpoint(parts[0])
    for i, part in enumerate(parts):
        ref = gguf.GGUFReader(part)
        mine = ck._readers[i]
        for key, field in ref.fields.items():
            if key.startswith("GGUF."):  # gguf-py's pseudo-fields (version, counts)
                continue
            assert _same(mine.value(key), field.contents()), key
        assert [t.name for t in mine.tensors] == [t.name for t in ref.tensors]
        for t, r in zip(mine.tensors, ref.tensors, strict=True):
            assert (t.tensor_type, t.shape, t.n_bytes) == (
                r.tensor_type,
                tuple(reversed(r.shape.tolist())),
                r.n_bytes,
            ), t.name
            assert t.data_offset == r.data_offset, t.name
            raw = mine.data[t.data_offset : t.data_offset + t.n_bytes]
            assert np.array_equal(raw, r.data.reshape(-1).view(np.uint8)), t.name


def test_every_value_type_as_gguf_py_reads_it(tmp_path: Path) -> None:
    """Each GGUF value type, arrays of each and nested arrays, read as gguf-py does; a
    string that is not UTF-8 is a one-line error naming the key when it is read."""
    from psr.models.gguf import GGUFError, _open

    VT = gguf.GGUFValueType
    path = tmp_path / "v.gguf"
    w = gguf.GGUFWriter(path, "qwen3moe")
    scalars = {
        "u8": (200, VT.UINT8),
        "i8": (-5, VT.INT8),
        "u16": (60000, VT.UINT16),
        "i16": (-300, VT.INT16),
        "u32": (4_000_000_000, VT.UINT32),
        "i32": (-70000, VT.INT32),
        "f32": (0.1, VT.FLOAT32),
        "b": (True, VT.BOOL),
        "u64": (2**40, VT.UINT64),
        "i64": (-(2**40), VT.INT64),
        "f64": (1e-300, VT.FLOAT64),
        "s": ("héllo", VT.STRING),
    }
    for k, (v, t) in scalars.items():
        w.add_key_value(f"t.{k}", v, t)
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, 1.25])
    w.add_array("t.strs", ["a", "", "ßx"])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_key_value("t.bad", "xx", VT.STRING)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    data = bytearray(path.read_bytes())
    at = data.index(b"t.bad") + len(b"t.bad") + 4 + 8
    data[at : at + 2] = b"\xff\xfe"  # not UTF-8
    path.write_bytes(bytes(data))
    ref = gguf.GGUFReader(path)
    mine = _open(path)
    for key, field in ref.fields.items():
        if key.startswith("GGUF.") or key in ("t.bad", "t.nested"):
            continue  # (gguf-py's contents() flattens a nested array: checked below)
        assert _same(mine.value(key), field.contents()), key
    assert mine.value("t.nested") == [[1, 2], [3]] and mine.value("t.absent") is None
    with pytest.raises(GGUFError) as e:
        mine.value("t.bad")
    assert "'t.bad'" in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value)


def test_the_map_is_read_only_and_shared(tmp_path: Path) -> None:
    """/proc/self/maps shows the file mapped `r--s` only (no private copy-on-write map);
    the raw views refuse writes; expert bytes come out as tensors without a warning."""
    path = tmp_path / "m.gguf"
    write_gguf(gguf_tiny_model("qwen3_moe", layers=1), path, "Q8_0")
    ck = GGUFCheckpoint(path)
    maps = [ln.split() for ln in Path("/proc/self/maps").read_text().splitlines()]
    mine = [m[1] for m in maps if len(m) >= 6 and m[5] == str(path)]
    assert mine and all(p == "r--s" for p in mine), mine
    et = ck.expert_tensors(0)["gate"]
    with pytest.raises(ValueError, match="read-only"):
        et.data[0, 0] = 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        b = et.expert(1)
        w = ck.get("model.layers.0.self_attn.q_proj.weight")
    assert b.numel() == et.row_bytes
    w.add_(1.0)  # a dense tensor is the caller's own copy


def test_a_150k_vocabulary_header_opens_and_inspects_in_little_memory(tmp_path: Path) -> None:
    """Qwen3-30B-A3B Q4_K_M as published (151,936 tokens, 151,387 merges, 18.6 GB of
    holes): opening grows RSS by a few MB (gguf-py's reader: ~600 MB, one numpy view per
    string) and leaves the tokenizer's arrays unparsed; psr.inspect stays bounded too."""
    import transformers.models.qwen3_moe.modeling_qwen3_moe  # noqa: F401  (not measured)

    import psr

    fit = fit_table()
    (path,) = fit.write(fit.SPECS["Qwen3-30B-A3B Q4_K_M"], tmp_path / "q.gguf")
    assert path.stat().st_size > 18 * 10**9
    r0 = rss_bytes()
    ck = GGUFCheckpoint(path)
    assert ck.config_dict["vocab_size"] == 151936
    opened = rss_bytes() - r0
    arrays = ("tokens", "merges", "token_type")
    parsed = [a for a in arrays if f"tokenizer.ggml.{a}" in ck._readers[0]._cache]
    assert parsed == []  # not read to open (nor by psr.inspect, which opens it the same way)
    assert opened < 48 * 2**20, opened
    assert len(ck.metadata("tokenizer.ggml.tokens")) == 151936  # parsed when asked
    ck.close()
    r = psr.inspect(path)
    assert r.num_experts == 128 and len(r.sparse_layers) == 48
    assert rss_bytes() - r0 < 96 * 2**20, rss_bytes() - r0  # measured: ~9 MB


def test_a_split_set_bigger_than_memory_opens(tmp_path: Path) -> None:
    """DeepSeek-V3 Q4_K_M as published (404.5 GB) in parts each larger than this
    machine's memory: every part maps (a copy-on-write map of one fails with ENOMEM),
    the config and every layer's expert rows read from the header, psr.inspect answers
    from any part, RSS barely moves."""
    fit = fit_table()
    spec = fit.SPECS["DeepSeek-V3 Q4_K_M"]
    parts = fit.write(spec, tmp_path / "ds.gguf", split_bytes=150 * 10**9)
    sizes = [p.stat().st_size for p in parts]
    if min(sizes) <= meminfo()["MemTotal"]:
        pytest.skip(f"parts of {min(sizes)} bytes are not larger than this machine's memory")
    assert len(parts) == 3 and sum(sizes) > 400 * 10**9
    before = rss_bytes()
    ck = GGUFCheckpoint(parts[1])  # any part names the set
    cfg = ck.config_dict
    assert (cfg["num_hidden_layers"], cfg["n_routed_experts"], cfg["kv_lora_rank"]) == (
        61,
        256,
        512,
    )
    assert ck.files == [p.name for p in parts]
    moe = ck.moe_layers()
    assert moe == list(range(3, 61))
    fmts = layer_formats(
        ck, MoESpec(num_experts=256, top_k=8, hidden_size=7168, ffn_size=2048), moe
    )
    assert {f.name for f in fmts} == {"gguf:Q4_K,Q4_K,Q6_K", "gguf:Q4_K,Q4_K,Q4_K"}
    assert rss_bytes() - before < 64 * 2**20
    ck.close()
    import psr

    found = psr.inspect(parts[2])  # and inspects, from any part
    assert (found.num_experts, len(found.sparse_layers)) == (256, 58)
    assert sum(found.expert_types.values()) == 58
    assert rss_bytes() - before < 64 * 2**20


def test_a_safetensors_file_bigger_than_memory_reads_a_row(tmp_path: Path) -> None:
    """A checkpoint whose one file is larger than this machine's memory (its data holes):
    psr maps it read-only and shared (the safetensors library's copy-on-write map fails
    with ENOMEM), reads one row as a copy, and agrees with torch on a small tensor."""
    import struct

    import torch
    from safetensors.torch import save_file

    from psr.models.checkpoint import Checkpoint

    rows, cols = meminfo()["MemTotal"] // 4096 + 16, 1024  # bf16: > MemTotal bytes
    small = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    save_file({"small": small}, str(tmp_path / "a.safetensors"))
    header = {"big": {"dtype": "BF16", "shape": [rows, cols], "data_offsets": [0, rows * cols * 2]}}
    raw = json.dumps(header).encode()
    big = tmp_path / "b.safetensors"
    with big.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
    os.truncate(big, 8 + len(raw) + rows * cols * 2)
    (tmp_path / "config.json").write_text("{}")
    ck = Checkpoint(tmp_path)
    before = rss_bytes()
    row = ck.get_row("big", rows - 1)
    assert row.dtype == torch.bfloat16 and row.shape == (cols,) and not row.any()
    row += 1  # the caller's own copy
    assert torch.equal(ck.get("small"), small) and torch.equal(ck.get_row("small", 2), small[2])
    maps = [ln.split() for ln in Path("/proc/self/maps").read_text().splitlines()]
    mine = [m[1] for m in maps if len(m) >= 6 and m[5] == str(big)]
    assert mine == ["r--s"], mine
    assert rss_bytes() - before < 16 * 2**20
    ck.close()
