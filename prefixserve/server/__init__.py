"""The OpenAI-compatible HTTP server: app wiring (api.py), routes, admin endpoints, the dashboard."""
