"""Multi-LoRA serving (docs/lora.md): PEFT adapters loaded and checked against the model (``adapter``), applied
to a step's rows grouped by adapter (``layers``), kept in slots and an LRU by the runner (``manager``); the
torch-free part the engine and the server share (``registry``: names, ids, paths confined to --lora-dir)."""
