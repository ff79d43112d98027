"""The model: a Llama-family decoder on PyTorch, paged attention, and loading from HF folders and GGUF files."""
