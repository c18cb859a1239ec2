"""The model families: Llama's decoder (Mistral, Qwen2/3, SmolLM3, Phi-3 as its variants) and Gemma 2/3 over it."""
