"""Model families as plain PyTorch modules with the static-KV interface of docs/design.md.

`build_model(config)` picks the family from a transformers config; `load_weights` copies a
transformers state dict into it. Each family lives in one small file.
"""

from __future__ import annotations

import torch

from .common import UnsupportedArchitecture
from .llama import Llama

FAMILIES: dict[str, type] = {"llama": Llama}


def _register_optional():
    # Families added in their own modules; imported lazily so a broken one names itself.
    import importlib

    for mod, names in (
        ("mistral", ("mistral",)),
        ("qwen2", ("qwen2",)),
        ("qwen3", ("qwen3",)),
        ("gemma3", ("gemma3", "gemma3_text")),
        ("phi3", ("phi3",)),
    ):
        try:
            m = importlib.import_module(f"{__name__}.{mod}")
        except ModuleNotFoundError as e:
            if e.name and e.name.endswith(f"models.{mod}"):
                continue
            raise
        for n in names:
            FAMILIES[n] = m.MODEL


_register_optional()


def supported_families() -> list[str]:
    return sorted(FAMILIES)


def family_of(config) -> str:
    mt = getattr(config, "model_type", None)
    if mt in FAMILIES:
        return mt
    raise UnsupportedArchitecture(
        f"architecture '{mt}' is not supported; supported families: {', '.join(supported_families())}"
    )


# "gqa" follows the scatter contract (present = past, updated in place) but exports attention as
# ONNX Runtime's GroupQueryAttention: the graph flavour for ONNX Runtime backends.
KV_MODES = ("scatter", "delta", "gqa")


def build_model(config, kv_mode: str = "scatter") -> torch.nn.Module:
    if kv_mode not in KV_MODES:
        raise ValueError(f"kv_mode must be one of {', '.join(KV_MODES)}, not '{kv_mode}'")
    cls = FAMILIES[family_of(config)]
    m = cls(config)
    m.kv_mode = kv_mode
    return m


# Buffers some checkpoints carry that we recompute from the config.
_DERIVED = ("rotary_emb.inv_freq", "rotary_emb.original_inv_freq", "embed_scale")


@torch.no_grad()
def load_weights(model: torch.nn.Module, state: dict) -> None:
    """Copy a transformers CausalLM state dict into our module.

    Our parameter names follow transformers' minus the `model.` prefix; families with other
    layouts override `convert_state_dict`. Missing lm_head means tied embeddings. A weight we
    would not use is an error: silently dropping, say, a bias gives a model that runs but is wrong.
    """
    conv = getattr(model, "convert_state_dict", None)
    sd = {}
    for k, v in state.items():
        k2 = k[len("model.") :] if k.startswith("model.") else k
        sd[k2] = v
    if conv is not None:
        sd = conv(sd)
    if "lm_head.weight" not in sd:
        sd["lm_head.weight"] = sd["embed_tokens.weight"]
    own = model.state_dict()  # tensors share storage with the parameters
    missing = [k for k in own if k not in sd]
    if missing:
        raise ValueError(f"checkpoint lacks weights the {model.family} model needs, e.g. {missing[:3]}")
    unused = [k for k in sd if k not in own and not k.endswith(_DERIVED)]
    if unused:
        raise ValueError(f"checkpoint has weights the {model.family} model does not use, e.g. {unused[:3]}")
    for k, p in own.items():
        src = sd[k]
        if tuple(src.shape) != tuple(p.shape):
            raise ValueError(f"weight '{k}' has shape {tuple(src.shape)}, the model expects {tuple(p.shape)}")
        p.copy_(src.to(p.dtype))
