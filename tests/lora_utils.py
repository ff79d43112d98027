"""LoRA adapters written by PEFT on tiny random transformers models, with PEFT's merged model as the reference."""

from __future__ import annotations

import copy

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(hf_model, folder, seed: int, r: int = 8, alpha: float = 16, targets=ALL_TARGETS,
                  rslora: bool = False, **extra):
    """Save a random (non-trivial: B is not zero) LoRA adapter of ``hf_model`` in ``folder``; returns PEFT's
    merged model (the base model with the adapter folded into its weights)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False,
                        use_rslora=rslora, **extra)
    peft_model = get_peft_model(copy.deepcopy(hf_model), config)
    peft_model.save_pretrained(folder)
    return peft_model.merge_and_unload().eval()
