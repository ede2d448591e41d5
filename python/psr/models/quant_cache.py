"""On-disk cache of quantized expert rows (`psr.load(..., quant_cache=True)`).

Quantizing a real checkpoint's experts takes minutes (OLMoE-1B-7B: 1,024 experts), and
the rows depend only on the checkpoint's expert weights, the format and the group size,
so a second load reads the rows instead of quantizing again. Files live in the user's
cache folder ($PSR_CACHE/quantized, else the platform's user cache folder), never in the
model folder. A file is written whole (a temporary file, then a rename: an interrupted
write leaves no file) and checked when read (its key, format, tensor names, dtypes and
shapes); a file that fails the check is reported with a warning and rebuilt.

The key hashes the format, group size, expert shapes, MoE layers, and every checkpoint
file's name, size and modification time (as Python's bytecode cache does: cheap, and a
rewritten checkpoint gets a new key).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from pathlib import Path

import torch

VERSION = 1  # bump when the row layout of any format changes


def default_root() -> Path:
    """$PSR_CACHE/quantized, else the user cache folder's psr/quantized."""
    home = os.environ.get("PSR_CACHE", "").strip()
    if home:
        return Path(home) / "quantized"
    import platformdirs

    return Path(platformdirs.user_cache_dir("psr")) / "quantized"


def resolve_root(quant_cache: bool | str | Path, model_dir: str | Path) -> Path | None:
    """The cache folder `psr.load`'s `quant_cache` asks for (None: no cache). Refuses a
    folder inside the model folder: psr never writes into a checkpoint."""
    if quant_cache is False:
        return None
    if quant_cache is True:
        root = default_root()
    elif isinstance(quant_cache, str | Path) and str(quant_cache).strip():
        root = Path(quant_cache)
    else:
        raise TypeError(f"quant_cache must be True, False or a folder path; got {quant_cache!r}")
    model = Path(model_dir).resolve()
    r = root.resolve()
    if r == model or model in r.parents:
        raise ValueError(
            f"quant_cache folder {root} is inside the model folder {model_dir}; "
            "psr never writes into a checkpoint (choose another folder)"
        )
    if root.exists() and not root.is_dir():
        raise ValueError(f"quant_cache {root} exists and is not a folder")
    return root


class QuantCache:
    """The cache file of one checkpoint in one format: per MoE layer, a uint8 tensor
    `[num_experts, row_bytes]` of the rows the host store holds."""

    def __init__(
        self,
        root: Path,
        model_dir: str | Path,
        files: list[str],
        expert_format: str,
        group_size: int,
        shape: dict[str, int],
        moe_layers: list[int],
        row_bytes: int,
    ) -> None:
        d = Path(model_dir)
        stats = []
        for name in sorted({*files, "config.json"}):
            st = (d / name).stat()
            stats.append([name, st.st_size, st.st_mtime_ns])
        ident = {
            "version": VERSION,
            "format": expert_format,
            "group_size": group_size,
            "shape": shape,
            "moe_layers": moe_layers,
            "row_bytes": row_bytes,
            "files": stats,
        }
        self.key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()
        self.num_layers, self.num_experts, self.row_bytes = (
            len(moe_layers),
            shape["num_experts"],
            row_bytes,
        )
        self.format = expert_format
        self.path = (
            root / f"{d.resolve().name}-{expert_format}-g{group_size}-{self.key[:16]}.safetensors"
        )

    def read(self) -> list[torch.Tensor] | None:
        """Every layer's rows, or None: no file, or one that fails its check (warned)."""
        if not self.path.is_file():
            return None
        from safetensors import safe_open

        want = [self.num_experts, self.row_bytes]
        try:
            with safe_open(str(self.path), framework="pt") as f:
                meta = f.metadata() or {}
                if meta.get("key") != self.key or meta.get("format") != self.format:
                    raise ValueError("its key or format does not match this checkpoint")
                names = [f"layer{i}" for i in range(self.num_layers)]
                if sorted(f.keys()) != sorted(names):
                    raise ValueError("its tensors are not one per MoE layer")
                out = []
                for name in names:
                    t = f.get_tensor(name)
                    if t.dtype != torch.uint8 or list(t.shape) != want:
                        raise ValueError(
                            f"{name} is {t.dtype} {list(t.shape)}, expected uint8 {want}"
                        )
                    out.append(t)
        except Exception as e:  # any unreadable file is rebuilt, never used
            warnings.warn(
                f"ignoring the quantized-expert cache {self.path} ({type(e).__name__}: {e}); "
                "quantizing again and rewriting it",
                stacklevel=3,
            )
            return None
        return out

    def write(self, layers: list[torch.Tensor]) -> None:
        """Write every layer's rows as one file, atomically (temporary file + rename)."""
        from safetensors.torch import save_file

        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".safetensors", dir=self.path.parent)
        os.close(fd)
        try:
            save_file(
                {f"layer{i}": t.contiguous() for i, t in enumerate(layers)},
                tmp,
                metadata={"key": self.key, "format": self.format, "version": str(VERSION)},
            )
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
