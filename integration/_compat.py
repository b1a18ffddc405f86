"""Everything that depends on the installed transformers version lives here (>= 5.17, < 6).

What moved between the releases we support:

* 5.24 renamed the ``past_key_values`` argument of ``forward``/``generate`` to ``cache`` (the old
  name is still accepted, with a deprecation warning); a forward pre-hook sees whichever name the
  caller used, so :func:`find_cache` looks for both, and :func:`cache_kwargs` gives callers the
  name the installed release wants (``model.generate(ids, **cache_kwargs(cache))``).
* 5.24's ``generate`` builds the attention masks itself for a compileable cache (also when there
  is no padding) and passes them to ``forward`` as a dict keyed by layer type; 5.17 only does so
  when a 2-D mask exists. :func:`padding_mask` accepts every form a forward may receive.
* ``Cache.update`` is called with ``kwargs=...`` by 5.24's attention modules and without it by
  5.17's; ``PagedKVCache.update`` takes ``*args, **kwargs`` and ignores them.
"""

from __future__ import annotations

import inspect

import torch
import transformers
from transformers.cache_utils import Cache, CacheLayerMixin  # noqa: F401  (re-exported)
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: F401
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

MIN_VERSION = (5, 17)
MAX_VERSION = (6, 0)  # exclusive


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


TRANSFORMERS_VERSION = _version_tuple(transformers.__version__)
if not (MIN_VERSION <= TRANSFORMERS_VERSION[:2] < MAX_VERSION):
    raise ImportError(
        f"minipaged_ops.integration supports transformers >= 5.17 and < 6, found {transformers.__version__}"
    )

# Names under which a forward receives the cache, newest first.
CACHE_KWARGS = ("cache", "past_key_values")


def _cache_argument() -> str:
    from transformers.generation.utils import GenerationMixin

    params = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    return "cache" if "cache" in params else "past_key_values"


# The name this release's generate()/forward() take the cache under, without a deprecation warning.
CACHE_ARGUMENT = _cache_argument()


def cache_kwargs(cache) -> dict:
    """``{"cache": cache}`` on releases that renamed the argument, else ``{"past_key_values": cache}``."""
    return {CACHE_ARGUMENT: cache}


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside ``torch.compile``'s wrapper and PEFT's (``get_base_model()``), any depth.
    Hooks go on that one: both wrappers end up calling it."""
    from torch._dynamo.eval_frame import OptimizedModule

    for _ in range(8):
        if isinstance(model, OptimizedModule):
            model = model._orig_mod
        elif callable(getattr(type(model), "get_base_model", None)):
            inner = model.get_base_model()
            if inner is model:
                break
            model = inner
        else:
            break
    return model


def register(name: str, attention_fn, mask_fn) -> None:
    """Register ``name`` in both global registries (idempotent: re-registering overwrites)."""
    AttentionInterface.register(name, attention_fn)
    AttentionMaskInterface.register(name, mask_fn)


def find_cache(args: tuple, kwargs: dict):
    """The cache object a ``*ForCausalLM.forward`` call received (``cache`` or ``past_key_values``,
    keyword or 4th positional), or None."""
    for name in CACHE_KWARGS:
        if kwargs.get(name) is not None:
            return kwargs[name]
    if len(args) > 3 and isinstance(args[3], Cache):
        return args[3]
    return None


def find_inputs(args: tuple, kwargs: dict):
    """``(input_ids, inputs_embeds, attention_mask)`` of a ``*ForCausalLM.forward`` call."""
    input_ids = kwargs.get("input_ids", args[0] if len(args) > 0 else None)
    attention_mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
    inputs_embeds = kwargs.get("inputs_embeds", args[4] if len(args) > 4 else None)
    return input_ids, inputs_embeds, attention_mask


def padding_mask(attention_mask, batch_size: int, num_columns: int, device) -> torch.Tensor | None:
    """Boolean ``[batch, num_columns]`` (True = real token) for the *last* ``num_columns`` columns
    of whatever attention mask a forward received, or None when every token is real.

    Accepted forms: None; a 2-D 0/1 mask ``[batch, kv_len]``; a 4-D mask ``[batch, 1, q, kv_len]``
    (bool, or additive float with 0 = attend); or 5.24's dict of such masks keyed by layer type.
    For a 4-D causal mask the last query row is the padding mask: the last token of a left-padded
    row is real and may attend to every real token before it.
    """
    if isinstance(attention_mask, dict):
        attention_mask = attention_mask.get("full_attention")
    if attention_mask is None or not isinstance(attention_mask, torch.Tensor):
        return None
    if attention_mask.dim() == 4:
        row = attention_mask[:, 0, -1, :]
        row = row if row.dtype == torch.bool else row == 0
    elif attention_mask.dim() == 2:
        row = attention_mask.bool()
    else:
        raise ValueError(f"attention_mask: expected a 2-D or 4-D mask, got {attention_mask.dim()}-D")
    if row.shape[0] != batch_size:
        raise ValueError(f"attention_mask: batch {row.shape[0]} does not match the inputs' batch {batch_size}")
    width = row.shape[-1]
    if width >= num_columns:
        row = row[:, width - num_columns:]
    else:  # shorter mask (e.g. only covers the past): missing columns are real tokens
        row = torch.cat([torch.ones(batch_size, num_columns - width, dtype=torch.bool, device=row.device), row], 1)
    return row.to(device)


def layer_types(config) -> list[str]:
    """Attention type of every decoder layer (``full_attention``, ``sliding_attention``, ...)."""
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    sliding = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", False) else None
    return ["sliding_attention" if sliding else "full_attention"] * config.num_hidden_layers


def is_pretrained_model(obj) -> bool:
    from transformers import PreTrainedModel

    return isinstance(obj, PreTrainedModel)


def attention_implementation(model) -> str | None:
    """The attention implementation ``model`` runs: transformers keeps it on the config as
    ``_attn_implementation`` and offers no public reader."""
    return getattr(model.config, "_attn_implementation", None)
