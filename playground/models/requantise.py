"""A GGUF file's matrices in another block format: `python -m playground.models.requantise IN OUT --format F`.

Every matrix the file stores in blocks is dequantised and quantised again by gguf's own quantiser (the formats it
quantises: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0); the norms and every other float tensor, and all the metadata, are copied.
Nothing can be downloaded here, so the test files of each format are made from the embedded model this way.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import numpy as np

from ..cli import OneLineParser, check_writable, run_cli
from ..config import ConfigError

FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
FLOATS = ("F32", "F16", "BF16")  # tensors copied as they are


def requantise(source: Path, out: Path, fmt: str) -> Counter[str]:
    """Write `out`: `source` with its block matrices in `fmt`; the count of `out`'s tensors by format."""
    import gguf
    from gguf.quants import dequantize, quantize

    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    reader = gguf.GGUFReader(source)
    field = reader.get_field(gguf.Keys.General.ARCHITECTURE)
    writer = gguf.GGUFWriter(out, field.contents() if field is not None else "llama")
    file_type = getattr(gguf.LlamaFileType, f"MOSTLY_{fmt}")
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # the writer's own
        value = int(file_type) if field.name == gguf.Keys.General.FILE_TYPE else field.contents()
        kind = field.types[0]
        writer.add_key_value(field.name, value, kind,
                             sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    qtype = gguf.GGMLQuantizationType[fmt]
    written: Counter[str] = Counter()
    for tensor in reader.tensors:
        if tensor.tensor_type.name in FLOATS:
            writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
            written[tensor.tensor_type.name] += 1
            continue
        values = dequantize(np.asarray(tensor.data), tensor.tensor_type)  # (rows, columns) float32
        writer.add_tensor(tensor.name, quantize(values, qtype), raw_dtype=qtype)  # (rows, bytes) uint8
        written[fmt] += 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


def run(args: argparse.Namespace) -> int:
    if not args.source.is_file():
        raise ConfigError(f"source: {args.source} is not a file")
    check_writable("out", [args.out])
    try:
        written = requantise(args.source, args.out, args.format)
    except (ValueError, OSError) as exc:  # not a GGUF file, or one gguf cannot read
        raise ConfigError(f"source: {args.source} could not be read as a GGUF file ({exc})") from exc
    print(f"{args.out}: " + ", ".join(f"{count} {fmt}" for fmt, count in sorted(written.items())), file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m playground.models.requantise", description=__doc__.split("\n")[0])
    parser.add_argument("source", type=Path, help="a .gguf file")
    parser.add_argument("out", type=Path, help="the .gguf file to write")
    parser.add_argument("--format", required=True, choices=FORMATS, help="the block format of its matrices")
    parser.set_defaults(func=run)
    return run_cli(parser, argv)


if __name__ == "__main__":
    sys.exit(main())
