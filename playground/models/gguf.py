"""A GGUF file's matrices in the block formats the native kernel reads (`native.BLOCKS`: Q8_0, Q4_0, Q4_1, Q5_0,
Q5_1, Q4_K, Q5_K, Q6_K) as the file stores them, for its block panels (kernels.c). Against float32 activations it
reads Q8_0 and Q4_1 only, and Q4_0 and Q5_0 through them (`as_read`: the same weights in a few more bytes).

`save_blocks` copies each such matrix's raw blocks into the converted folder (`BLOCKS_FILE`, safetensors of uint8),
in the row order of the float32 weight transformers dequantised from the same file (llama.cpp stores q and k with
the halves of each rotary pair interleaved; transformers puts the rows back, and so do we), after checking that
the blocks dequantise to that weight value for value. `load_blocks` reads them back by name.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .checkpoint import layer_products
from .native import BLOCKS, GGUF_FORMATS, words

BLOCKS_FILE = "gguf-blocks.safetensors"
CENSUS = "matrices by format"  # the blocks file's metadata entry: the GGUF file's matrices, "Q4_1:210,Q8_0:1"
VERSION = "3"  # of what a blocks file holds (3: every format as stored); another is written again
FLOAT_FORMATS = ("F32", "F16", "BF16")  # matrices a file stores unquantised: float32 weights lose nothing
Blocks = Mapping[str, tuple[str, torch.Tensor]]  # weight name -> (format, (out, bytes) uint8 blocks)
Parts = list[tuple[str, torch.Tensor]]  # a product's blocks in parts (q, k, v), each (format, (out, bytes) uint8)


class BlocksError(ValueError):
    """The file's blocks could not be read or do not match the dequantised weights."""


def _row_orders(rows: int, hf_config: Any) -> list[np.ndarray]:
    """Row orders to try, in turn: as stored, then un-interleaved over the query heads or the key/value heads."""
    orders = [np.arange(rows)]
    for heads in (getattr(hf_config, "num_attention_heads", None), getattr(hf_config, "num_key_value_heads", None)):
        if heads and rows % (2 * heads) == 0:
            orders.append(np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(-1))
    return orders


def save_blocks(gguf_file: Path, folder: Path, weights: Mapping[str, torch.Tensor], hf_config: Any) -> int:
    """Write `folder`/BLOCKS_FILE with the blocks of every float32 Hugging Face weight in `weights` that the file
    holds in a format the kernel reads (`BLOCKS`), and the file's census of matrices by format (`census`); returns
    how many blocks. Raises BlocksError where a matrix's blocks are not that weight."""
    import gguf
    from gguf.quants import dequantize

    try:
        reader = gguf.GGUFReader(gguf_file)
        arch_field = reader.get_field("general.architecture")
        arch_name = arch_field.contents() if arch_field is not None else ""
        arch = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}.get(arch_name)
        if arch is None:
            raise BlocksError(f"weights: {gguf_file.name} names architecture {arch_name!r}, which gguf does not map")
        names = gguf.get_tensor_name_map(arch, int(hf_config.num_hidden_layers))
        stored = {t.name: t for t in reader.tensors}
    except (OSError, ValueError) as exc:
        raise BlocksError(f"weights: could not read the blocks of {gguf_file} ({exc})") from exc
    blocks: dict[str, torch.Tensor] = {}
    formats: dict[str, str] = {}
    matrices: Counter[str] = Counter()
    for name, weight in weights.items():
        tensor = stored.get(names.get_name(name, try_suffixes=(".weight",)) or "")
        if weight.dim() != 2 or tensor is None:
            continue
        kind = tensor.tensor_type.name
        matrices[kind] += 1
        if kind not in BLOCKS:
            continue
        raw = np.asarray(tensor.data).reshape(weight.shape[0], -1)  # (out, in / 32 * block bytes)
        for order in _row_orders(weight.shape[0], hf_config):
            values = dequantize(raw[order], tensor.tensor_type).reshape(weight.shape)
            if np.array_equal(values, weight.numpy()):
                blocks[name] = torch.from_numpy(np.ascontiguousarray(raw[order]))
                formats[name] = kind
                break
        else:
            raise BlocksError(f"weights: the {tensor.tensor_type.name} blocks of {tensor.name} in {gguf_file.name} do "
                              f"not dequantise to {name} in any row order tried; use --weights float32")
    partial = folder / f".{BLOCKS_FILE}.{os.getpid()}"
    census = ",".join(f"{fmt}:{count}" for fmt, count in sorted(matrices.items()))
    save_file(blocks, partial, metadata={**formats, CENSUS: census, "version": VERSION})  # never empty, as it must
    os.replace(partial, folder / BLOCKS_FILE)  # another process never reads half a file
    return len(blocks)


def q4_0_as_q4_1(raw: np.ndarray) -> np.ndarray:
    """Q4_0 blocks (rows, n * 18) as Q4_1 blocks (rows, n * 20) of the same weights: d * (q - 8) = d * q + m with
    m = -8 d, exact in float16 and in the float32 both dequantise to (d * q and 8 d need at most 15 bits)."""
    blocks = raw.reshape(-1, 18)  # (blocks, 2 bytes of d, 16 of nibbles)
    m = (blocks[:, :2].copy().view(np.float16) * np.float16(-8)).view(np.uint8)  # (blocks, 2)
    return np.concatenate([blocks[:, :2], m, blocks[:, 2:]], axis=1).reshape(len(raw), -1)


def q5_0_as_q8_0(raw: np.ndarray) -> np.ndarray:
    """Q5_0 blocks (rows, n * 22) as Q8_0 blocks (rows, n * 34) of the same weights: d * (q - 16), q of 5 bits (the
    low four in nibbles, weight j's in byte j % 16; the high bit of weight j as bit j of a 32-bit word), becomes d
    and the 8-bit integers q - 16."""
    blocks = raw.reshape(-1, 22)  # (blocks, 2 bytes of d, 4 of high bits, 16 of nibbles)
    high = blocks[:, 2:6].copy().view("<u4") >> np.arange(32, dtype=np.uint32) & 1  # (blocks, 32)
    low = np.concatenate([blocks[:, 6:] & 15, blocks[:, 6:] >> 4], axis=1)  # (blocks, 32)
    q = (low | (high.astype(np.uint8) << 4)).astype(np.int16) - 16  # (blocks, 32) in -16..15
    return np.concatenate([blocks[:, :2], q.astype(np.int8).view(np.uint8)], axis=1).reshape(len(raw), -1)


# formats the kernel reads against float32 activations through another that holds the same weights exactly, in a
# few more bytes
READ_AS = {"Q4_0": "Q4_1", "Q5_0": "Q8_0"}
WIDEN = {"Q4_0": q4_0_as_q4_1, "Q5_0": q5_0_as_q8_0}


def load_blocks(folder: Path) -> Blocks:
    """The blocks `save_blocks` wrote, by Hugging Face weight name."""
    with safe_open(folder / BLOCKS_FILE, framework="pt") as f:
        formats = f.metadata() or {}
        return {name: (formats[name], f.get_tensor(name)) for name in f.keys()}


def census_of(folder: Path) -> Counter[str] | None:
    """The GGUF file's matrices counted by format, as `save_blocks` noted them; None where the blocks file is missing
    or of another version (write it again)."""
    try:
        with safe_open(folder / BLOCKS_FILE, framework="pt") as f:
            meta = f.metadata() or {}
    except (OSError, SafetensorError):
        return None
    note = meta.get(CENSUS)
    if note is None or meta.get("version") != VERSION:
        return None
    return Counter({fmt: int(count) for fmt, count in (part.split(":") for part in note.split(",") if part)})


def read_formats(integer: bool) -> set[str]:
    """The block formats the native kernel reads, in integer products on 8-bit activations or against float32 ones,
    those it reads through another (`READ_AS`) included."""
    return set(BLOCKS) if integer else {fmt for fmt in BLOCKS if READ_AS.get(fmt, fmt) in GGUF_FORMATS}


def as_read(blocks: Blocks, integer: bool) -> dict[str, tuple[str, torch.Tensor]]:
    """`blocks` as the kernel reads them: all as stored in integer products; against float32 activations the Q8_0
    and Q4_1 ones, and the Q4_0 and Q5_0 ones as Q4_1 and Q8_0 blocks of the same weights (`READ_AS`)."""
    if integer:
        return dict(blocks)
    return {name: (READ_AS.get(kind, kind), torch.from_numpy(WIDEN[kind](raw.numpy())) if kind in READ_AS else raw)
            for name, (kind, raw) in blocks.items() if READ_AS.get(kind, kind) in GGUF_FORMATS}


def unread(census: Counter[str], integer: bool = True) -> str | None:
    """The file's matrices the native kernel does not read as stored (in integer products where `integer`, else
    against float32 activations), as words ("16 Q4_K and 14 Q6_K"), or None."""
    read = read_formats(integer)
    return words([f"{n} {fmt}" for fmt, n in sorted(census.items())
                  if fmt not in read and fmt not in FLOAT_FORMATS]) or None


def widened(census: Counter[str]) -> str | None:
    """The file's matrices the kernel reads through another format against float32 activations (`READ_AS`), as
    words, or None: "211 Q4_0 matrices as Q4_1 (20 bytes a block of 32 instead of 18)"."""
    return words([f"{census[fmt]} {fmt} matrices as {kind} ({BLOCKS[kind][1]} bytes a block of 32 instead of "
                  f"{BLOCKS[fmt][1]})" for fmt, kind in READ_AS.items() if census.get(fmt)]) or None


def native_blocks(blocks: Blocks, num_layers: int) -> dict[str, Parts]:
    """The blocks by this project's weight names (`checkpoint.layer_products`): q, k, v as the parts of qkv, gate and
    up as those of gate/up, each in its own format (`native.pack_parts`); a product with any part missing keeps
    float32."""
    out: dict[str, Parts] = {}

    def put(name: str, parts: list[str]) -> None:
        if all(part in blocks for part in parts):
            out[name] = [blocks[part] for part in parts]

    put("embed_tokens.weight", ["model.embed_tokens.weight"])
    put("lm_head.weight", ["lm_head.weight"])
    for i in range(num_layers):
        for name, parts in layer_products(i).items():
            put(name, parts)
    return out
