"""A GGUF's weights at another block type, for comparing engines at the same quantization.

    python benchmarks/requantize_gguf.py SOURCE.gguf TARGET.gguf --type Q8_0

Every 2-D weight is decoded by the format's reference reader and quantized again to --type (Q8_0, Q4_0 or
Q4_1: the types gguf-py writes; or F32, the decoded values themselves, for a float32 comparison); norms and
other 1-D tensors, and the metadata (tokenizer, chat template, hyperparameters), are copied unchanged.
Quantizing SmolLM2's Q4_1 file to Q8_0 loses nothing of its
weights' resolution (Q8_0 is finer than Q4_1), so both engines then serve the same model at 8 bits.
Benchmarks only: the package reads GGUFs, it never writes them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, Keys
from gguf.quants import dequantize, quantize

WRITABLE = ("Q8_0", "Q4_0", "Q4_1", "F32")


def requantize(source: Path, target: Path, kind: str) -> Path:
    reader = GGUFReader(source)
    architecture = reader.fields[Keys.General.ARCHITECTURE].contents()
    writer = GGUFWriter(str(target), architecture)
    for field in reader.fields.values():
        if field.name == Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
    target_type = GGMLQuantizationType[kind]
    for tensor in reader.tensors:
        shape = [int(size) for size in reversed(tensor.shape.tolist())]  # torch order: [out, in]
        if len(shape) == 2:
            values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32).reshape(shape)
            writer.add_tensor(tensor.name, quantize(values, target_type), raw_dtype=target_type)
        else:
            writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path)
    parser.add_argument("target", type=Path)
    parser.add_argument("--type", choices=WRITABLE, default="Q8_0")
    args = parser.parse_args()
    requantize(args.source, args.target, args.type)
    print(f"wrote {args.target} ({args.target.stat().st_size / 2**20:.1f} MiB, {args.type})")


if __name__ == "__main__":
    main()
