"""Paged attention: the step's metadata and plan, and the paths a step's rows take through the KV pool."""
