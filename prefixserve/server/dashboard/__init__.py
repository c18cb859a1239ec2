"""The live cache dashboard: a static page (static/, package data) and its admin-keyed JSON snapshot.

Kept free of imports on purpose: the router serves the same static page (router/dashboard.py)
by reading these files, without importing the server or the engine.
"""
