"""Tiny random configs and reference models per family, for tests (ours and other packages').

The configs are small enough to run in milliseconds yet keep what tends to break: grouped-query
attention (kv_heads < heads), sliding windows short enough that a test crosses them (mixed with
full layers where the family allows), partial rotary for phi3, softcapping for gemma3.
"""

from __future__ import annotations

import torch

VOCAB = 256
MAX_POS = 512
WINDOW = 8

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=MAX_POS,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def tiny_config(family: str, seed: int = 0):
    """A small transformers config of `family` (any name in specedge.models.FAMILIES).

    `seed` varies the random parts of a config (phi3's longrope factors); weights are seeded
    by whoever builds the model (see `tiny_hf_model`)."""
    import transformers as tf

    c = dict(_COMMON)
    if family == "llama":
        # Tied embeddings and llama3 rope scaling, as in SmolLM2 / Llama 3.2.
        return tf.LlamaConfig(
            **{**c, "tie_word_embeddings": True},
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500_000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    if family == "mistral":
        return tf.MistralConfig(**c, sliding_window=WINDOW)
    if family == "qwen2":
        # Layers from max_window_layers on slide; the first one stays full.
        return tf.Qwen2Config(
            **{**c, "num_hidden_layers": 3}, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
        )
    if family == "qwen3":
        return tf.Qwen3Config(
            **{**c, "num_hidden_layers": 3, "tie_word_embeddings": True},
            head_dim=16,
            use_sliding_window=True,
            sliding_window=WINDOW,
            max_window_layers=1,
        )
    if family == "phi3":
        return tf.Phi3Config(
            **c, partial_rotary_factor=0.5, sliding_window=WINDOW, pad_token_id=0, bos_token_id=1, eos_token_id=2
        )
    if family in ("gemma3_text", "gemma3"):
        text = tf.Gemma3TextConfig(
            **{**c, "num_hidden_layers": 4, "tie_word_embeddings": True},
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
            },
        )
        if family == "gemma3_text":
            return text
        vision = tf.SiglipVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        )
        return tf.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    raise ValueError(f"no tiny config for family '{family}'")


def phi3_longrope_config(seed: int = 0, original_max: int = 16):
    """Phi-3 with longrope whose original context is tiny, so a test can cross into the long
    factors."""
    import transformers as tf

    g = torch.Generator().manual_seed(seed)
    rot = int(16 * 0.5)  # head_dim 16, partial rotary 0.5
    short = (1.0 + torch.rand(rot // 2, generator=g)).tolist()
    long = (2.0 + 4.0 * torch.rand(rot // 2, generator=g)).tolist()
    return tf.Phi3Config(
        **{**_COMMON, "max_position_embeddings": 4 * original_max},
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        original_max_position_embeddings=original_max,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10_000.0,
            "partial_rotary_factor": 0.5,
            "short_factor": short,
            "long_factor": long,
            "original_max_position_embeddings": original_max,
        },
    )


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int = 0, std: float = 0.15) -> torch.nn.Module:
    """Give every parameter a seeded random value. transformers' init (std 0.02, norms at 1 or
    0) leaves attention nearly uniform and norm weights trivial, which would hide mask and
    norm-offset mistakes."""
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
        if name.endswith("norm.weight") or "layernorm" in name:
            p.copy_(p.float() + 0.3 * noise)
        else:
            p.copy_(std * noise)
    return model


def tiny_hf_model(family: str, seed: int = 0, config=None, attn_implementation: str | None = None):
    """transformers' model for `tiny_config(family)` (or `config`) in eval mode, fp32, with
    seeded weights. Attention softcapping needs attn_implementation="eager" (sdpa ignores it)."""
    from transformers import AutoModelForCausalLM

    cfg = config if config is not None else tiny_config(family, seed)
    torch.manual_seed(seed)
    kw = {"attn_implementation": attn_implementation} if attn_implementation else {}
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, **kw).eval()
    return randomize_(m, seed)
