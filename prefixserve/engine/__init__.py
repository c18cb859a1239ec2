"""The engine: requests, scheduling, the model runner and the step loop."""
