"""Tokenizers: a Hugging Face tokenizer.json with its chat template, and one rebuilt from a GGUF file's metadata."""
