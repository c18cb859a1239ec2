"""LoRA adapters served from one base model: PEFT's files (adapter.py), vLLM's LoRARequest (lora_request.py), a
bounded adapter cache (registry.py), and the per-row updates a step applies (step.py): each request's rows get
its own adapter's, the base's rows none. Nothing is imported here: the router imports the torch-free
lora_request alone."""
