"""A GGUF file's matrices in another block format: `python -m playground.models.requantise IN OUT --format F`.

Every matrix the file stores in blocks is dequantised and quantised again: by gguf's own quantiser for Q4_0, Q4_1,
Q5_0, Q5_1 and Q8_0, by `kquants` for Q4_K, Q5_K and Q6_K. Q4_K_M mixes them as llama.cpp's quantiser does: Q6_K
for the tied output rows and for the attention values and MLP down products of the layers `more_bits` names, Q4_K
elsewhere. As in llama.cpp, a matrix whose rows are no multiple of 256 weights cannot hold K-quant blocks and takes
the format `FALLBACK` names instead. The norms and every other float tensor, and all the metadata, are copied.
Nothing can be downloaded here, so the test files of each format are made from the embedded model this way.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

import numpy as np

from ..cli import OneLineParser, check_writable, run_cli
from ..config import ConfigError
from . import kquants
from .gguf import FLOAT_FORMATS
from .kquants import QK_K

FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q4_K_M")
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}  # for rows that are no multiple of 256 weights
FILE_TYPES = {"Q4_K": "Q4_K_S", "Q5_K": "Q5_K_S"}  # the file type a file of one K-quant is called
MORE_BITS = re.compile(r"blk\.(\d+)\.(attn_v|ffn_down)\.weight$")


def more_bits(layer: int, layers: int) -> bool:
    """The layers whose attention values and MLP down products Q4_K_M keeps in Q6_K: the first and last eighth, and
    every third one between (llama.cpp's rule)."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def chosen(name: str, columns: int, fmt: str, layers: int) -> str:
    """The format tensor `name`, of rows of `columns` weights, takes in a file of `fmt`."""
    if fmt == "Q4_K_M":
        match = MORE_BITS.match(name)
        tied = name in ("output.weight", "token_embd.weight")  # the output rows (tied to the embedding here)
        fmt = "Q6_K" if tied or (match is not None and more_bits(int(match.group(1)), layers)) else "Q4_K"
    return FALLBACK[fmt] if fmt in FALLBACK and columns % QK_K else fmt


def requantise(source: Path, out: Path, fmt: str) -> Counter[str]:
    """Write `out`: `source` with its block matrices in `fmt`; the count of `out`'s tensors by format."""
    import gguf
    from gguf.quants import dequantize, quantize

    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    reader = gguf.GGUFReader(source)
    named = reader.get_field(gguf.Keys.General.ARCHITECTURE)
    arch = named.contents() if named is not None else "llama"
    writer = gguf.GGUFWriter(out, arch)
    file_type = getattr(gguf.LlamaFileType, f"MOSTLY_{FILE_TYPES.get(fmt, fmt)}")
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # the writer's own
        value = int(file_type) if field.name == gguf.Keys.General.FILE_TYPE else field.contents()
        value_type = field.types[0]
        writer.add_key_value(field.name, value, value_type,
                             sub_type=field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None)
    count = reader.get_field(f"{arch}.block_count")
    layers = int(count.contents()) if count is not None else 0
    written: Counter[str] = Counter()
    for tensor in reader.tensors:
        if tensor.tensor_type.name in FLOAT_FORMATS:  # copied as they are
            writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
            written[tensor.tensor_type.name] += 1
            continue
        values = dequantize(np.asarray(tensor.data), tensor.tensor_type)  # (rows, columns) float32
        kind = chosen(tensor.name, values.shape[-1], fmt, layers)
        blocks = kquants.quantise(values, kind) if kind in kquants.BYTES else quantize(
            values, gguf.GGMLQuantizationType[kind])  # (rows, bytes) uint8
        writer.add_tensor(tensor.name, blocks, raw_dtype=gguf.GGMLQuantizationType[kind])
        written[kind] += 1
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
