"""A model and its tokenizer from a local folder, as users have them (a Hugging Face checkpoint:
``config.json``, ``*.safetensors``, the tokenizer files). Nothing is downloaded: a folder that is
incomplete is an error that says what is missing, not a trip to the Hub."""

from __future__ import annotations

import os

import torch

_DTYPES = {"auto": "auto", "float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}


def resolve_dtype(dtype):
    """``None``/"auto" (the checkpoint's own dtype), a name in :data:`_DTYPES`, or a torch.dtype."""
    if dtype is None:
        return "auto"
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"load_pretrained: dtype must be a floating-point dtype, got {dtype}")
        return dtype
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(f"load_pretrained: dtype must be None, a torch.dtype or one of {sorted(_DTYPES)}, got {dtype!r}")


def resolve_device(device) -> torch.device:
    """``None``: CUDA when there is one, else the CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"load_pretrained: device must be None, a torch.device or a device string, "
                         f"got {device!r}") from None


def load_pretrained(path, *, dtype=None, device=None, quantization=None):
    """``(model, tokenizer)`` from the folder ``path``: ``AutoModelForCausalLM`` in eval mode on
    ``device`` in ``dtype`` (None: the checkpoint's dtype), and ``AutoTokenizer``, both with
    ``local_files_only=True``. Raises ValueError for a path that is not a model folder or a
    tokenizer whose ids do not fit the model's vocabulary. ``quantization`` ("int8", "int4"):
    its linear layers quantized (:func:`..weight_quant.quantize_weights`; ValueError naming it)."""
    from ..weight_quant import check_quantization, quantize_weights

    check_quantization(quantization, resolve_device(device))  # before the minutes a load can take

    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"load_pretrained: path must be a folder path (str or os.PathLike), got {type(path).__name__}")
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"load_pretrained: path must be a local model folder; {path!r} is not a directory "
                         f"(minipaged never downloads: fetch the checkpoint first, e.g. `hf download`)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"load_pretrained: {path!r} has no config.json, so it is not a transformers model folder")
    torch_dtype = resolve_dtype(dtype)
    device = resolve_device(device)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, local_files_only=True)
    model = model.to(device).eval()
    if quantization is not None:
        quantize_weights(model, quantization)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    vocab = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > vocab:
        raise ValueError(f"load_pretrained: the tokenizer in {path!r} has {len(tokenizer)} tokens but the model's "
                         f"embedding has {vocab} rows")
    return model, tokenizer
