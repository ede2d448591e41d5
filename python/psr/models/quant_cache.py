"""On-disk cache of quantized expert rows (`psr.load(..., quant_cache=True)`).

Quantizing a real checkpoint's experts takes minutes (OLMoE-1B-7B: 1,024 experts), and
the rows depend only on the checkpoint's expert weights, the format and the group size,
so a second load reads the rows instead of quantizing again. Files live in the user's
cache folder ($PSR_CACHE/quantized, else the platform's user cache folder), never in the
model folder.

Trust, in layers:
- the key hashes the psr version, format, group size, shapes, MoE layers, the model
  folder's resolved path, and every checkpoint file's size, mtime, ctime and inode (a
  copy that keeps mtimes still gets a new ctime and inode);
- the header is checked (key, format, one uint8 `[E, row bytes]` tensor per MoE layer,
  no truncation) before any row is used;
- the loader re-quantizes one expert per layer from the checkpoint and compares bytes
  (about 1/E of the work), so rows of other weights are never loaded silently.
A file that fails a check is reported with a warning and rebuilt. Writes go to a
temporary file that is synced and renamed (an interrupted write leaves no cache file),
and replace the files of earlier keys for the same model folder and format.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from psr.models.checkpoint import read_header

VERSION = 1  # bump when the row layout of any format changes
STALE_TMP_S = 24 * 3600  # temporary files older than this are from killed writers


def default_root() -> Path:
    """$PSR_CACHE/quantized, else the user cache folder's psr/quantized."""
    home = os.environ.get("PSR_CACHE", "").strip()
    if home:
        return Path(home) / "quantized"
    import platformdirs

    return Path(platformdirs.user_cache_dir("psr")) / "quantized"


def resolve_root(quant_cache: bool | str | Path | None, model_dir: str | Path) -> Path | None:
    """The cache folder `psr.load`'s `quant_cache` asks for (None: no cache). Refuses a
    folder inside the model folder: psr never writes into a checkpoint."""
    if quant_cache is None or quant_cache is False:
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


def _psr_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("psr")
    except PackageNotFoundError:
        return "unknown"


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
        self.model_dir = Path(model_dir).resolve()
        self.files = sorted({*files, "config.json"})
        self.format = expert_format
        self.num_layers, self.num_experts, self.row_bytes = (
            len(moe_layers),
            shape["num_experts"],
            row_bytes,
        )
        self._stats = self._file_stats()
        ident = {
            "version": [VERSION, _psr_version()],
            "format": expert_format,
            "group_size": group_size,
            "shape": shape,
            "moe_layers": moe_layers,
            "row_bytes": row_bytes,
            "model_dir": str(self.model_dir),
            "files": self._stats,
        }
        self.key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()
        where = hashlib.sha256(str(self.model_dir).encode()).hexdigest()[:8]
        self._prefix = f"{self.model_dir.name}-{where}-{expert_format}-g{group_size}-"
        self.root = root
        self.path = root / f"{self._prefix}{self.key[:16]}.safetensors"

    def _file_stats(self) -> list[list]:
        out = []
        for name in self.files:
            st = (self.model_dir / name).stat()
            out.append([name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino])
        return out

    def reject(self, why: str) -> None:
        warnings.warn(
            f"ignoring the quantized-expert cache {self.path} ({why}); quantizing again "
            "and rewriting it",
            stacklevel=3,
        )

    def check(self) -> bool:
        """True when the file exists and its header fits this checkpoint; a file that
        does not fit is rejected with a warning (False)."""
        if not self.path.is_file():
            return False
        try:
            header = read_header(self.path)  # also refuses a truncated file
        except (ValueError, OSError) as e:  # CheckpointError names the defect
            self.reject(str(e))
            return False
        meta = header.pop("__metadata__", None) or {}
        if meta.get("key") != self.key or meta.get("format") != self.format:
            self.reject("its key or format does not match this checkpoint")
            return False
        want = {f"layer{i}" for i in range(self.num_layers)}
        if set(header) != want:
            self.reject("its tensors are not one per MoE layer")
            return False
        for name, info in header.items():
            if info["dtype"] != "U8" or info["shape"] != [self.num_experts, self.row_bytes]:
                self.reject(
                    f"{name} is {info['dtype']} {info['shape']}, expected U8 "
                    f"{[self.num_experts, self.row_bytes]}"
                )
                return False
        return True

    def layers(self) -> Iterator[torch.Tensor]:
        """Each MoE layer's rows, one layer in memory at a time (after `check`)."""
        from safetensors import safe_open

        with safe_open(str(self.path), framework="pt") as f:
            for i in range(self.num_layers):
                yield f.get_tensor(f"layer{i}")

    def write(self, layers: list[torch.Tensor]) -> None:
        """Write every layer's rows as one file: a synced temporary file renamed into
        place, then the files of this model folder's earlier keys removed. Skipped, with a
        warning, if a checkpoint file changed while it was being quantized."""
        if self._file_stats() != self._stats:
            warnings.warn(
                f"the checkpoint {self.model_dir} changed while loading; its quantized "
                "experts are not cached",
                stacklevel=3,
            )
            return
        from safetensors.torch import save_file

        self.root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".safetensors", dir=self.root)
        os.close(fd)
        try:
            save_file(
                {f"layer{i}": t.contiguous() for i, t in enumerate(layers)},
                tmp,
                metadata={"key": self.key, "format": self.format, "version": str(VERSION)},
            )
            with open(tmp, "rb+") as fh:
                os.fsync(fh.fileno())
            os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide a shared cache from others
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        dfd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        self._prune()

    def _prune(self) -> None:
        """Remove superseded keys of this folder and format, and old temporary files."""
        now = time.time()
        for p in self.root.iterdir():
            try:
                if p.name.startswith(self._prefix) and p != self.path:
                    p.unlink()
                elif p.name.startswith(".tmp-") and now - p.stat().st_mtime > STALE_TMP_S:
                    p.unlink()
            except OSError:  # another process pruned it first
                pass
