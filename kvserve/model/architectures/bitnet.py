"""BitNet b1.58 (microsoft/bitnet-b1.58-2B-4T-bf16): Llama's layers with an RMSNorm over the heads' output before
o_proj (``attn_sub_norm``) and one over act(gate) * up before the down projection (``ffn_sub_norm``), a relu2-gated
MLP. The weights as a float checkpoint holds them, run as transformers runs a BitNet config without a
``quantization_config``; the ternary-packed checkpoints (quant_method "bitnet": weights packed 4 to a byte with a scale,
activations quantized to int8 per token on the fly) are refused at load as every other quantization scheme is."""

from kvserve.model.architectures import Architecture, register

register(Architecture("BitNetForCausalLM", lambda d: {"attn_sub_norm": True, "mlp_sub_norm": True,
                                                      "hidden_act": d.get("hidden_act") or "relu2"}))
