"""Tiny LoRA adapters for the tiny model, written offline in PEFT's format (nothing downloaded,
no `peft` needed): `adapter_config.json` and `adapter_model.safetensors` with PEFT's tensor names,
which vLLM's LoRA loader (and `peft`) read.

    make_adapter("/tmp/tiny", "/tmp/ad1", seed=1)     # rank 8 on q/k/v/o_proj of every layer

The weights are drawn from `seed` large enough that greedy decoding differs from the base model
and between adapters (the LoRA proof compares tokens with vLLM's own generate).
"""

from __future__ import annotations

import json
from pathlib import Path

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def make_adapter(
    model_dir: str | Path,
    directory: str | Path,
    *,
    seed: int,
    rank: int = 8,
    alpha: int = 16,
    std: float = 0.1,
    targets: tuple[str, ...] = TARGETS,
) -> Path:
    """Write a LoRA adapter of the model in `model_dir` (its config.json) into `directory`
    (created); returns it. Deterministic for a seed."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((Path(model_dir) / "config.json").read_text())
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads", heads))
    head_dim = int(config.get("head_dim") or hidden // heads)
    shapes = {  # (in, out) of each projection
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (heads * head_dim, hidden),
    }
    unknown = sorted(set(targets) - set(shapes))
    if unknown:
        raise ValueError(f"targets {unknown} are not attention projections {sorted(shapes)}")
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(int(config["num_hidden_layers"])):
        for name in targets:
            fan_in, fan_out = shapes[name]
            key = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            a = torch.randn(rank, fan_in, generator=gen) * std
            b = torch.randn(fan_out, rank, generator=gen) * std
            tensors[f"{key}.lora_A.weight"] = a.contiguous()
            tensors[f"{key}.lora_B.weight"] = b.contiguous()
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": list(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
    return out
