"""The bodies of `prefixserve simulate` and `prefixserve plan` (cli.py builds the parser and dispatches)."""
