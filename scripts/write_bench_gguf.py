"""A GGUF file of a benchmark model's dummy weights, for llama.cpp (and kvserve) to serve the same bits.

``scripts/write_bench_models.py`` writes config-only folders that kvserve and vLLM serve with
``--load-format dummy``. llama.cpp has no dummy loader, so this script draws the same weights
(``kvserve.model.dummy.dummy_weights``, same seed) and writes them as llama.cpp's converter would:
llama.cpp's tensor names, q/k rows permuted for the ``llama`` architecture, every matrix (embedding
included) in one type, Q8_0 or Q4_0 (gguf-py's reference quantizers), norms in F32. kvserve serves
the file with ``--quantization auto`` (it keeps Q8_0/Q4_0 as stored), so both engines read the
same bytes per token.

The tokenizer is the embedded model's (its GGUF fields copied), padded with ordinary tokens up to the
model's vocab_size, since llama.cpp sizes the embedding by the token list.

    python scripts/write_bench_gguf.py MODEL_DIR --type q8_0|q4_0 [--out FILE] [--seed 0]

Supported: configs whose architecture llama.cpp names ``llama``, ``qwen2`` or ``qwen3`` (the registry's
``Architecture.gguf``); tensor names come from ``gguf_names.hf_to_gguf_name``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import gguf
import numpy as np
import torch

from kvserve.model.architectures import get_architecture
from kvserve.model.dummy import checkpoint_dtype, dummy_weights
from kvserve.model.gguf_names import hf_to_gguf_name
from kvserve.model.loader import load_model_config, resolve_model_path
from kvserve.model.rotary import rope_inv_freq

GGUF_ARCHS = ("llama", "qwen2", "qwen3")  # llama.cpp architectures whose metadata this script writes in full
TYPES = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}


def permute_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order for the architectures it permutes (kvserve's loader undoes it)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def add_tokenizer(writer: gguf.GGUFWriter, vocab_size: int) -> None:
    """The embedded model's tokenizer fields, the token list padded to ``vocab_size``."""
    source = gguf.GGUFReader(str(resolve_model_path(None)))
    fields = source.fields

    def strings(key: str) -> list[str]:
        f = fields[key]
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

    def scalar(key: str) -> int:
        f = fields[key]
        return int(f.parts[f.data[0]][0])

    tokens = strings("tokenizer.ggml.tokens")
    types = [int(fields["tokenizer.ggml.token_type"].parts[i][0]) for i in fields["tokenizer.ggml.token_type"].data]
    if len(tokens) > vocab_size:
        raise SystemExit(f"the embedded tokenizer has {len(tokens)} tokens, more than vocab_size {vocab_size}")
    pad = vocab_size - len(tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    # ordinary tokens that no merge reaches: prompts encode as before, and each generated one is text, so
    # every server streams (and counts) every token
    writer.add_token_list(tokens + [f"reserved{i}" for i in range(pad)])
    writer.add_token_types(types + [gguf.TokenType.NORMAL] * pad)
    writer.add_token_merges(strings("tokenizer.ggml.merges"))
    writer.add_bos_token_id(scalar("tokenizer.ggml.bos_token_id"))
    writer.add_eos_token_id(scalar("tokenizer.ggml.eos_token_id"))
    writer.add_unk_token_id(scalar("tokenizer.ggml.unknown_token_id"))
    writer.add_pad_token_id(scalar("tokenizer.ggml.padding_token_id"))
    writer.add_add_bos_token(False)
    writer.add_add_space_prefix(False)
    template = fields["tokenizer.chat_template"]
    writer.add_chat_template(bytes(template.parts[template.data[0]]).decode("utf-8"))


def write(model_dir: Path, qtype: str, out: Path, seed: int) -> None:
    config = load_model_config(model_dir)
    arch = get_architecture(config.architecture)
    if arch.gguf not in GGUF_ARCHS:
        raise SystemExit(f"{config.architecture}: this script writes llama.cpp's {', '.join(GGUF_ARCHS)} only")
    start = time.perf_counter()
    weights = dummy_weights(config, checkpoint_dtype(model_dir), seed)
    writer = gguf.GGUFWriter(str(out), arch=arch.gguf)
    writer.add_name(model_dir.name)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(float(config.rope_theta))
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type") == "llama3":  # as llama.cpp's converter: each rotary pair's frequency divisor
        plain, scaled = (rope_inv_freq(config.rotary_dim, float(config.rope_theta), s)[0] for s in (None, scaling))
        writer.add_tensor("rope_freqs.weight", (plain / scaled).numpy())
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type({"q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[qtype])
    add_tokenizer(writer, config.vocab_size)
    for name in list(weights):
        w = weights.pop(name).to(torch.float32).numpy()
        target = hf_to_gguf_name(name, arch)
        if target is None:
            raise SystemExit(f"{name}: no GGUF name for it")
        if arch.gguf_permuted and ".attn_q." in target:
            w = permute_rotary(w, config.num_attention_heads)
        elif arch.gguf_permuted and ".attn_k." in target:
            w = permute_rotary(w, config.num_key_value_heads)
        if w.ndim == 2:
            writer.add_tensor(target, gguf.quants.quantize(w, TYPES[qtype]), raw_dtype=TYPES[qtype])
        else:
            writer.add_tensor(target, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"{out}: {out.stat().st_size / 2**30:.2f} GiB, {qtype}, seed {seed}, {time.perf_counter() - start:.0f} s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", type=Path, help="a folder written by scripts/write_bench_models.py")
    parser.add_argument("--type", choices=sorted(TYPES), default="q8_0")
    parser.add_argument("--out", type=Path, help="default: MODEL_DIR/../NAME.TYPE.gguf")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = args.out or args.model_dir.parent / f"{args.model_dir.name}.{args.type.upper()}.gguf"
    write(args.model_dir, args.type, out, args.seed)


if __name__ == "__main__":
    main()
