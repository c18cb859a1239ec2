"""Weight formats: Hugging Face checkpoints, GGUF files, and weights kept quantized in memory."""
