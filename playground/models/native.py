"""The native CPU kernels (`kernels.c`): built once per machine with the system C compiler, loaded with ctypes.

- Matrix product: products over 1-12 rows at about the cost of reading the weights once, so verifying several
  tokens costs little more than decoding one.
- Attention: a query's result depends on its own visible keys alone (see kernels.c), so a token's logits are
  bit-identical in a plain decode step, a verifying forward, a tree and a batch.
- RMSNorm, the decoder layer's halves around attention, and the whole layer stack over a contiguous cache (`layers`,
  the cache writes included), each in one call instead of chains of small PyTorch ops.
- 16-bit panels: a product whose every weight is exactly a float16 (or bfloat16) number packs in that format; the
  kernel widens the weights as it loads them, so the sums keep their bits and a step reads half the bytes.

How they work is in docs/performance.md, what each bought in docs/results.md. The build is optional: without a C
compiler with OpenMP (or with PLAYGROUND_NATIVE=0) `kernel()` is None and the model keeps PyTorch's kernels, with the
reason in `status()`. The library is cached under $PLAYGROUND_CACHE (or ~/.cache/decoding-playground)/native, keyed
by the source, the compiler, the flags and this CPU's model and flags. It is built with -march=native, or for the
architecture PLAYGROUND_NATIVE_ARCH names (e.g. `haswell`: the AVX2 path on an AVX-512 host, as the test suite can
run on any x86 CPU to check the code an AVX2-only machine runs).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..paths import default_cache_root

SOURCE = Path(__file__).with_name("kernels.c")
SWITCH_ENV = "PLAYGROUND_NATIVE"  # "0" keeps PyTorch's kernels
ARCH_ENV = "PLAYGROUND_NATIVE_ARCH"  # a gcc -march value in place of "native", e.g. "haswell" for the AVX2 path
# -ffp-contract=off: the kernels' fused multiply-adds are explicit, so a sum's rounding never depends on which
# copy of a loop the compiler chose to fuse (see kernels.c)
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
MAX_HEAD_VECTORS = 16  # MAX_ND in kernels.c
# Panel formats, FMT_* in kernels.c: a weight every value of which is exactly a 16-bit float packs in that format.
FORMATS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
# GGUF block formats the kernel reads as stored against float32 activations (FMT_* in kernels.c): their codes
GGUF_FORMATS = {"Q8_0": 3, "Q4_1": 4}
# GGUF block formats multiplied in integers against activations quantised to 8 bits (FMT_*_X8 in kernels.c)
INTEGER_FORMATS = {"Q8_0": 5, "Q4_1": 6, "Q4_K": 7, "Q5_K": 8, "Q6_K": 9, "Q4_0": 10, "Q5_0": 11, "Q5_1": 12}
PARTS = 13  # FMT_PARTS in kernels.c: a product whose output rows come in parts of different formats
MAX_PARTS = 4
# weights and bytes of a block of each (the K-quants' super-blocks)
BLOCKS = {"Q8_0": (32, 34), "Q4_1": (32, 20), "Q4_0": (32, 18), "Q5_0": (32, 22), "Q5_1": (32, 24),
          "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}
BLOCK = 32  # weights per GGUF block (QK in kernels.c): a proposer's inputs come in multiples of it
FORMAT_NAMES = {0: "float32", 1: "float16", 2: "bfloat16", **{code: kind for kind, code in GGUF_FORMATS.items()},
                **{code: kind for kind, code in INTEGER_FORMATS.items()}, PARTS: "parts"}


class _Parts(ctypes.Structure):
    """kernels.c's `struct parts`."""

    _fields_ = [("count", ctypes.c_int32), ("formats", ctypes.c_int32 * MAX_PARTS),
                ("outs", ctypes.c_int32 * MAX_PARTS), ("data", ctypes.c_void_p * MAX_PARTS)]


@dataclass(frozen=True)
class Kernel:
    library: ctypes.CDLL
    panel_width: int  # output rows per packed panel
    path: Path
    vector_width: int  # floats per vector register: attention needs head_dim a multiple of it
    # rows a matrix product serves per pass over a weight panel: a forward over more tokens pays another pass
    # of arithmetic (6 with AVX2, 12 with AVX-512)
    rows_per_pass: int
    halves: bool  # whether panels may hold 16-bit floats (AVX2 with F16C, or AVX-512)
    gguf: bool  # whether panels may hold GGUF Q8_0 and Q4_1 blocks against float activations (the same builds)
    # the instructions of the integer products on 8-bit activations, which every build has: "AVX-512 VNNI",
    # "AVX-512BW", "AVX-VNNI", "AVX2" or "plain C"
    dot_products: str

    def normalises(self, weight: torch.Tensor) -> bool:
        """Whether `rms_norm` serves this norm weight: float32 on the CPU, a whole number of vectors long."""
        return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 1
                and weight.shape[0] % self.vector_width == 0)

    def attends(self, head_dim: int, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether `attention` serves this head size, dtype and device."""
        return (device.type == "cpu" and dtype == torch.float32 and head_dim % self.vector_width == 0
                and head_dim <= MAX_HEAD_VECTORS * self.vector_width)


@dataclass(frozen=True)
class Panels:
    """A (out, in) CPU weight packed for `Kernel`, panel p holding output rows [p * W, (p + 1) * W), zero past `out`.
    Float formats: data (ceil(out / W), in, W), each panel transposed; float32, or float16 or bfloat16 where every
    weight is exactly one (see `pack_panels`). GGUF formats: data (ceil(out / W), panel bytes) uint8, the file's
    blocks regrouped per panel (see `pack_blocks` and kernels.c)."""

    data: torch.Tensor
    out: int
    kernel: Kernel
    in_features: int
    format: int  # the format code kernels.c reads the panels in
    # format PARTS: data holds kernels.c's `struct parts`, pointing into these, each its own rows in order
    parts: tuple[Panels, ...] = ()

    @property
    def pieces(self) -> tuple[Panels, ...]:
        """The panels of one format each that a product reads: the parts, or these panels."""
        return self.parts or (self,)

    @property
    def nbytes(self) -> int:
        """Bytes a product reads from these panels (padding rows included)."""
        return sum(p.data.numel() * p.data.element_size() for p in self.pieces)


def formats_read(products: Sequence[Panels]) -> str:
    """What a model's matrix products (their panels) read, for reports: e.g. "Q4_1 and Q8_0 blocks, 8-bit
    activations (96 MB)", "Q4_1 and Q8_0 blocks, float32 activations (96 MB)", "float32 (538 MB)"; "PyTorch's
    products" where the native kernel runs none."""
    if not products:
        return "PyTorch's products"
    names = sorted({FORMAT_NAMES[piece.format] for panels in products for piece in panels.pieces})
    codes = {piece.format for panels in products for piece in panels.pieces}
    blocks = ""
    if all(name in BLOCKS for name in names):
        integer = codes <= set(INTEGER_FORMATS.values())
        blocks = " blocks, 8-bit activations" if integer else " blocks, float32 activations"
    return f"{words(names)}{blocks} ({sum(p.nbytes for p in products) / 1e6:.0f} MB)"


def words(parts: Sequence[str], last: str = "and") -> str:
    """"a", "a and b", "a, b and c" (`last` the word before the last part); "" for none."""
    return f" {last} ".join([", ".join(parts[:-1]), parts[-1]] if len(parts) > 1 else parts)


def cpu_signature() -> str:
    """What a -march=native build depends on: the machine, and the CPU's model name and feature flags."""
    lines = []
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith(("model name", "flags", "Features", "CPU part")):
                lines.append(line)
                if len(lines) >= 2:
                    break
    except OSError:
        pass
    return "\n".join([platform.machine(), platform.processor(), *lines])


def arch() -> str:
    """The -march value PLAYGROUND_NATIVE_ARCH names ("" where unset: native)."""
    return os.environ.get(ARCH_ENV, "").strip()


def flags() -> tuple[str, ...]:
    """The compiler's flags: FLAGS, with the architecture PLAYGROUND_NATIVE_ARCH names in place of native's."""
    march = arch()
    if not march:
        return FLAGS
    if not march.replace("-", "").replace("_", "").isalnum():
        raise OSError(f"{ARCH_ENV}={march!r} is not a -march name (letters, digits, '-' and '_', e.g. haswell)")
    return tuple(f"-march={march}" if flag == "-march=native" else flag for flag in FLAGS)


def build(cache_dir: Path, compiler: str, source: Path | None = None) -> Path:
    """Compile `kernels.c` (or another version of it, as experiments/kernel_costs.py compares) into cache_dir, once per
    source, compiler and CPU; raises OSError or CalledProcessError."""
    source = SOURCE if source is None else source  # read at call time: tests swap SOURCE
    found = shutil.which(compiler)
    if found is None:
        raise OSError(f"no C compiler {compiler!r} on PATH")
    chosen = flags()
    key = hashlib.sha256("\n".join([source.read_text(encoding="utf-8"), found, *chosen, cpu_signature()])
                         .encode()).hexdigest()[:16]
    target = cache_dir / f"kernels-{key}.so"
    if target.is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: another process building the same library never sees half a file.
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        partial = Path(tmp) / target.name
        subprocess.run([found, *chosen, str(source), "-o", str(partial)], check=True, capture_output=True, text=True,
                       timeout=120)
        os.replace(partial, target)
    return target


def load(path: Path) -> Kernel:
    library = ctypes.CDLL(str(path))
    library.playground_gemm.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                        ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    library.playground_gemm.restype = None
    library.playground_panel_width.restype = ctypes.c_int
    library.playground_vector_width.restype = ctypes.c_int
    library.playground_rows_per_pass.restype = ctypes.c_int
    library.playground_formats.restype = ctypes.c_int
    library.playground_attention.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 6 + [ctypes.c_long] * 3 + [
        ctypes.c_float, ctypes.c_int]
    library.playground_attention.restype = None
    library.playground_rms_norm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 2 + [ctypes.c_float]
    library.playground_rms_norm.restype = None
    library.playground_attention_in.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                                ctypes.c_float, *[ctypes.c_void_p] * 2, *[ctypes.c_int] * 2,
                                                *[ctypes.c_void_p] * 4, *[ctypes.c_int] * 3]
    library.playground_attention_in.restype = None
    library.playground_mlp_block.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                             ctypes.c_int, *[ctypes.c_void_p] * 2, ctypes.c_float, ctypes.c_void_p,
                                             ctypes.c_int, ctypes.c_void_p, *[ctypes.c_int] * 3, ctypes.c_void_p,
                                             ctypes.c_int]
    library.playground_mlp_block.restype = None
    library.playground_layers.argtypes = [ctypes.c_void_p] + [ctypes.c_int] * 4 + [ctypes.c_void_p] * 2 + [
        ctypes.c_int] * 4 + [ctypes.c_float] + [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_void_p] * 3 + [
        ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
    library.playground_layers.restype = None
    library.playground_row_top.argtypes = [ctypes.c_void_p] + [ctypes.c_int] * 2 + [ctypes.c_long] + [
        ctypes.c_void_p] * 3 + [ctypes.c_int]
    library.playground_row_top.restype = None
    library.playground_pack_blocks.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                               ctypes.c_void_p]
    library.playground_pack_blocks.restype = None
    library.playground_panel_bytes.argtypes = [ctypes.c_int, ctypes.c_int]
    library.playground_panel_bytes.restype = ctypes.c_long
    library.playground_dot_products.restype = ctypes.c_char_p
    library.playground_read_seconds.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_int,
                                                ctypes.c_void_p]
    library.playground_read_seconds.restype = ctypes.c_double
    library.playground_dot_peak.argtypes = [ctypes.c_long, ctypes.c_int]
    library.playground_dot_peak.restype = ctypes.c_long
    library.playground_fma_peak.argtypes = [ctypes.c_long, ctypes.c_int]
    library.playground_fma_peak.restype = ctypes.c_float
    formats = library.playground_formats()
    halves = (formats >> FORMATS[torch.float16]) & 1 == 1
    gguf = all((formats >> code) & 1 for code in GGUF_FORMATS.values())
    return Kernel(library, int(library.playground_panel_width()), path, int(library.playground_vector_width()),
                  int(library.playground_rows_per_pass()), halves, gguf,
                  library.playground_dot_products().decode())


def default_cache_dir() -> Path:
    return default_cache_root() / "native"


_LOCK = threading.Lock()
_STATE: dict[str, object] = {}  # "kernel": Kernel | None, "status": str, once tried


def kernel() -> Kernel | None:
    """The kernel for this process, built or loaded on the first call; None where it is off or unavailable."""
    with _LOCK:
        if "status" not in _STATE:
            _STATE["kernel"], _STATE["status"] = _try_kernel()
        return _STATE["kernel"]  # type: ignore[return-value]


def status() -> str:
    """One line for reports: whether the native kernel is in use, and why not."""
    kernel()
    return str(_STATE["status"])


def _try_kernel() -> tuple[Kernel | None, str]:
    if os.environ.get(SWITCH_ENV, "1") == "0":
        return None, f"off ({SWITCH_ENV}=0): PyTorch's kernels"
    try:
        loaded = load(build(default_cache_dir(), os.environ.get("CC", "cc")))
    except subprocess.CalledProcessError as exc:
        detail = (exc.stderr or "").strip().splitlines()
        return None, f"unavailable (the C build failed: {detail[-1] if detail else exc}): PyTorch's kernels"
    except (OSError, subprocess.TimeoutExpired, AttributeError) as exc:
        return None, f"unavailable ({exc}): PyTorch's kernels"
    march = arch()
    built_for = f", built for -march={march} by {ARCH_ENV}" if march else ""
    halves = ", 16-bit where the weights are exactly 16-bit" if loaded.halves else ""
    return loaded, (f"on ({loaded.panel_width}-row panels{halves}; attention for head sizes in multiples of "
                    f"{loaded.vector_width}; {loaded.path.name}{built_for})")


def narrowest(weight: torch.Tensor) -> torch.dtype:
    """float16 or bfloat16 where every value of the float32 `weight` is exactly one (float16 first: it keeps more
    of the significand), else float32."""
    head = weight[:1]  # (1, in): one row settles most weights, which are not 16-bit, without converting them whole
    for dtype in (torch.float16, torch.bfloat16):
        if torch.equal(head.to(dtype).float(), head) and torch.equal(weight.to(dtype).float(), weight):
            return dtype
    return torch.float32


def pack_panels(weight: torch.Tensor, kernel: Kernel, narrow: bool = True) -> Panels:
    """`weight` (out, in) float32 on the CPU, packed for `kernel` (a copy: the weight itself is unchanged); in 16
    bits where `narrow`, the kernel reads them and every value is exactly one, which gives every product the same
    bits from half the bytes (a checkpoint saved in float16 or bfloat16, such as the shipped draft)."""
    out, in_features = weight.shape
    width = kernel.panel_width
    padded = -(-out // width) * width
    source = weight.detach()
    if narrow and kernel.halves:
        source = source.to(narrowest(source))
    if padded != out:
        source = torch.cat((source, source.new_zeros(padded - out, in_features)))  # (padded, in)
    data = source.reshape(padded // width, width, in_features).transpose(1, 2).contiguous()  # (P, in, W)
    return Panels(data, out, kernel, in_features, FORMATS[data.dtype])


def pack_blocks(blocks: torch.Tensor, kind: str, in_features: int, kernel: Kernel, integer: bool = False) -> Panels:
    """A weight of `out` rows stored as GGUF blocks, blocks (out, in / block weights * block bytes) uint8 as the file
    holds them (row-major, `kind` one of `BLOCKS`), regrouped per panel for `kernel` (see kernels.c): every product
    sums each block apart, its bits those of one output and one row alone. Where `integer`, the products quantise x
    to 8 bits per block of 32 and sum q * q_x in integers (every build has them); else x stays float32 (Q8_0 and Q4_1
    only, `GGUF_FORMATS`)."""
    codes = INTEGER_FORMATS if integer else GGUF_FORMATS
    if kind not in codes:
        raise ValueError(f"{kind} blocks run only in integer products on 8-bit activations")
    code, (per, size) = codes[kind], BLOCKS[kind]
    out, width, count = blocks.shape[0], kernel.panel_width, in_features // per
    if in_features % per or blocks.shape[1] != count * size:
        raise ValueError(f"{kind} blocks for {in_features} inputs need {count * size} bytes a row, got "
                         f"{tuple(blocks.shape)}")
    panel_bytes = int(kernel.library.playground_panel_bytes(code, in_features))
    data = torch.empty(-(-out // width), panel_bytes, dtype=torch.uint8)  # (P, panel bytes)
    rows = blocks.contiguous()
    kernel.library.playground_pack_blocks(rows.data_ptr(), out, in_features, code, data.data_ptr())
    return Panels(data, out, kernel, in_features, code)


def pack_parts(parts: Sequence[tuple[str, torch.Tensor]], in_features: int, kernel: Kernel,
               integer: bool = False) -> Panels:
    """A weight whose rows come in parts (format, blocks) (q, k and v, or gate and up), packed as one product: one
    set of panels where every part is in one format, else each part packed apart (`pack_blocks`) and read as one
    product of parts, each part's outputs in its own columns."""
    if len({kind for kind, _ in parts}) == 1:
        return pack_blocks(torch.cat([blocks for _, blocks in parts]), parts[0][0], in_features, kernel, integer)
    if len(parts) > MAX_PARTS:
        raise ValueError(f"a product of {len(parts)} parts in different formats: at most {MAX_PARTS}")
    pieces = tuple(pack_blocks(blocks, kind, in_features, kernel, integer) for kind, blocks in parts)
    described = _Parts(len(pieces), (ctypes.c_int32 * MAX_PARTS)(*[p.format for p in pieces]),
                       (ctypes.c_int32 * MAX_PARTS)(*[p.out for p in pieces]),
                       (ctypes.c_void_p * MAX_PARTS)(*[p.data.data_ptr() for p in pieces]))
    data = torch.frombuffer(bytearray(bytes(described)), dtype=torch.uint8)  # the struct's bytes
    return Panels(data, sum(p.out for p in pieces), kernel, in_features, PARTS, pieces)


def quantise_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """A (out, in) float weight, in a multiple of 32, as GGUF Q8_0 blocks (out, in / 32 * 34) uint8, rounded by
    gguf's own quantiser: how a proposer's float weights join the target's integer products."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    values = weight.detach().float().cpu().numpy()  # (out, in)
    return torch.from_numpy(quantize(values, GGMLQuantizationType.Q8_0))  # (out, in / 32 * 34)


def panel_linear(x: torch.Tensor, panels: Panels, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., in) float32 on the CPU @ the packed weight^T (+ bias): (..., out)."""
    in_features = panels.in_features
    rows = x.numel() // in_features
    flat = x.reshape(rows, in_features).contiguous()  # (N, in): the kernel reads whole rows
    y = torch.empty(rows, panels.out, dtype=torch.float32)  # (N, out)
    if rows:
        panels.kernel.library.playground_gemm(flat.data_ptr(), rows, in_features, panels.data.data_ptr(),
                                              panels.format, panels.out, y.data_ptr(), torch.get_num_threads())
    y = y.reshape(*x.shape[:-1], panels.out)
    return y if bias is None else y + bias


FMA_CHAINS = 12  # ACC in kernels.c


def fma_peak(kernel: Kernel, threads: int, seconds: float = 0.2) -> float:
    """This processor's most fused multiply-adds a second on `threads` threads (`playground_fma_peak`: independent
    chains in registers, nothing read from memory), the best of a few runs of about `seconds` each."""
    return _peak(kernel.library.playground_fma_peak, FMA_CHAINS * kernel.vector_width, threads, seconds)


def dot_peak(kernel: Kernel, threads: int, seconds: float = 0.2) -> float:
    """This processor's most 8-bit integer multiply-adds a second on `threads` threads through the integer
    products' instruction (`playground_dot_peak`: 4 * vector width of them an instruction), the best of a few runs."""
    return _peak(kernel.library.playground_dot_peak, FMA_CHAINS * 4 * kernel.vector_width, threads, seconds)


def _peak(run: Callable[[int, int], object], per_rep: int, threads: int, seconds: float) -> float:
    """The most operations a second `run(reps, threads)` reaches (`per_rep` of them a rep on each thread): reps
    doubled until a run takes `seconds`, then two more runs, the best kept."""
    reps, best = 1 << 16, 0.0
    while True:
        start = time.perf_counter()
        run(reps, threads)
        elapsed = time.perf_counter() - start
        best = max(best, reps * per_rep * threads / elapsed)
        if elapsed >= seconds:
            break
        reps *= 2
    for _ in range(2):
        start = time.perf_counter()
        run(reps, threads)
        best = max(best, reps * per_rep * threads / (time.perf_counter() - start))
    return best


def read_bandwidth(kernel: Kernel, threads: int, megabytes: int = 512) -> float:
    """Bytes a second `threads` threads read from memory (`playground_read_seconds`: a buffer far larger than the
    caches, one load a cache line, the fastest of 5 passes)."""
    buffer = torch.ones(megabytes << 20, dtype=torch.uint8)  # touched, so its pages exist
    sink = ctypes.c_long(0)
    seconds = kernel.library.playground_read_seconds(buffer.data_ptr(), buffer.numel(), threads, 5, ctypes.byref(sink))
    return buffer.numel() / seconds


def row_top(kernel: Kernel, logits: torch.Tensor,
            normalise: bool) -> tuple[list[int], torch.Tensor, torch.Tensor | None]:
    """Per row of logits (N, V) float32 on the CPU, V >= 1: the argmax (the first of equal maxima; the first NaN,
    as torch.argmax), the maximum (N,) and, when `normalise`, the sum over the row of exp(logit - maximum) (N,)."""
    rows, cols = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    argmax = torch.empty(rows, dtype=torch.int32)
    top = torch.empty(rows)
    total = torch.empty(rows) if normalise else None
    kernel.library.playground_row_top(logits.data_ptr(), rows, cols, logits.stride(0), argmax.data_ptr(),
                                      top.data_ptr(), None if total is None else total.data_ptr(),
                                      torch.get_num_threads())
    return argmax.tolist(), top, total


def rms_norm(kernel: Kernel, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (..., D) float32 on the CPU, RMS-normalised over D and scaled by weight (D,); D a multiple of the vector
    width (see `Kernel.normalises`)."""
    d = x.shape[-1]
    flat = x.reshape(-1, d).contiguous()  # (N, D)
    y = torch.empty_like(flat)
    if flat.numel():
        kernel.library.playground_rms_norm(flat.data_ptr(), weight.data_ptr(), y.data_ptr(), flat.shape[0], d, eps)
    return y.view(x.shape)


def attention_in(kernel: Kernel, x: torch.Tensor, norm_weight: torch.Tensor, eps: float, qkv: Panels,
                 bias: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, rope_heads: int,
                 head_dim: int) -> torch.Tensor:
    """A decoder layer before attention, in one call: rms_norm(x) @ Wqkv^T (+ bias), then RoPE (see
    transformer.apply_rope, same bits) on the first rope_heads heads. x (..., E) float32 contiguous; cos and sin
    (..., D), one row per row of x. Returns (..., out)."""
    d = x.shape[-1]
    rows = x.numel() // d
    if cos.numel() != rows * head_dim or sin.numel() != rows * head_dim:
        raise ValueError(f"cos and sin need one row of {head_dim} per row of x ({rows}), got {tuple(cos.shape)}")
    normed = torch.empty(rows, d, dtype=torch.float32)  # (N, E) scratch
    y = torch.empty(*x.shape[:-1], qkv.out, dtype=torch.float32)  # (..., out)
    cos, sin = cos.contiguous(), sin.contiguous()  # held here: a copy must outlive the call that reads it
    kernel.library.playground_attention_in(
        x.data_ptr(), rows, d, norm_weight.data_ptr(), eps, normed.data_ptr(), qkv.data.data_ptr(), qkv.format,
        qkv.out, None if bias is None else bias.data_ptr(), y.data_ptr(), cos.data_ptr(), sin.data_ptr(), rope_heads,
        head_dim, torch.get_num_threads())
    return y


def mlp_block(kernel: Kernel, x: torch.Tensor, attn: torch.Tensor, o_proj: Panels, norm_weight: torch.Tensor,
              eps: float, gate_up: Panels, down: Panels) -> None:
    """A decoder layer after attention, in one call, x (..., E) float32 contiguous updated in place:
    x += attn (..., H*D) @ Wo^T, then x += down(silu(gate) * up) over rms_norm(x), gate_up packing [gate | up]."""
    d = x.shape[-1]
    rows = x.numel() // d
    inter = gate_up.out // 2
    attn = attn.contiguous()
    scratch = torch.empty(rows * (2 * d + 3 * inter), dtype=torch.float32)
    kernel.library.playground_mlp_block(
        x.data_ptr(), rows, d, attn.data_ptr(), o_proj.in_features, o_proj.data.data_ptr(), norm_weight.data_ptr(),
        eps, gate_up.data.data_ptr(), inter, down.data.data_ptr(), o_proj.format, gate_up.format, down.format,
        scratch.data_ptr(), torch.get_num_threads())


def attention(kernel: Kernel, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor | None,
              new_tokens: int) -> torch.Tensor:
    """Softmax(q k^T / sqrt(D)) v over the keys each query sees; float32 on the CPU (see `Kernel.attends`).

    q (B, Hkv, R, D), R = G * new_tokens with row r the query of new token r % new_tokens (query heads sharing a KV
    head stacked); keys, values (B, Hkv, L, D) views of the cache with the same strides and contiguous rows;
    visible (B, T, L) bool or None (every key). Returns (B, Hkv, R, D).
    """
    b, hkv, rows, d = q.shape
    key_len = keys.shape[2]
    if keys.stride() != values.stride() or keys.stride(-1) != 1:
        keys, values = keys.contiguous(), values.contiguous()
    q = q.contiguous()
    mask = None
    if visible is not None:
        mask = visible.contiguous().view(torch.uint8)  # (B, T, L): bool is one byte
    out = torch.empty_like(q)  # (B, Hkv, R, D)
    if q.numel():
        kernel.library.playground_attention(
            q.data_ptr(), keys.data_ptr(), values.data_ptr(), None if mask is None else mask.data_ptr(),
            out.data_ptr(), b, hkv, rows, new_tokens, key_len, d, keys.stride(0), keys.stride(1), keys.stride(2),
            d ** -0.5, torch.get_num_threads())
    return out


@dataclass(frozen=True)
class LayerStack:
    """Every decoder layer's weights as the pointers `layers` reads: 7 per layer (input norm, q/k/v panels, q/k/v
    bias or null, output panels, post-attention norm, gate/up panels, down panels), and the formats of its 4 panels.
    `keep` holds what they point into, so the pointers stay valid while the stack lives."""

    kernel: Kernel
    pointers: ctypes.Array  # (layers * 7,) void pointers
    formats: ctypes.Array  # (layers * 4,) ints: the q/k/v, output, gate/up and down panels' formats
    keep: tuple[torch.Tensor, ...]
    num_layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    parts: dict[tuple[int, int], LayerStack] = field(default_factory=dict, compare=False, repr=False)

    def part(self, first: int, last: int) -> LayerStack:
        """Layers first..last-1 alone, as a stack of their own (a forward that stops between layers), made once."""
        if (first, last) not in self.parts:
            pointers = (ctypes.c_void_p * (7 * (last - first)))(*self.pointers[7 * first : 7 * last])
            formats = (ctypes.c_int * (4 * (last - first)))(*self.formats[4 * first : 4 * last])
            self.parts[first, last] = LayerStack(self.kernel, pointers, formats, self.keep, last - first, self.heads,
                                                 self.kv_heads, self.head_dim, self.intermediate, self.eps)
        return self.parts[first, last]


def layer_stack(kernel: Kernel, weights: list[tuple[torch.Tensor, Panels, torch.Tensor | None, Panels,
                                                     torch.Tensor, Panels, Panels]],
                heads: int, kv_heads: int, head_dim: int, eps: float) -> LayerStack:
    """The stack for per-layer (input norm weight, qkv, qkv bias, o, post-attention norm weight, gate/up, down), every
    product packed for `kernel` and every norm one it serves."""
    keep = tuple(kept for layer in weights for t in layer if t is not None
                 for kept in ((t.data, *(p.data for p in t.parts)) if isinstance(t, Panels) else (t,)))
    flat = [None if t is None else (t.data if isinstance(t, Panels) else t).data_ptr()
            for layer in weights for t in layer]
    pointers = (ctypes.c_void_p * len(flat))(*flat)
    codes = [panels.format for layer in weights for panels in (layer[1], layer[3], layer[5], layer[6])]
    formats = (ctypes.c_int * len(codes))(*codes)
    return LayerStack(kernel, pointers, formats, keep, len(weights), heads, kv_heads, head_dim,
                      weights[0][5].out // 2, eps)


def layers(stack: LayerStack, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
           values: torch.Tensor, starts: tuple[int, ...], key_len: int, visible: torch.Tensor | None,
           slots: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Run every layer of `stack` in one native call (see kernels.c), x (B, T, E) float32 contiguous updated in
    place; cos, sin (B, T, 1, D) as `Transformer.rope` gives them; visible (B, T, L) bool or None (every key
    visible). keys, values: the cache rows of this forward (layers, B, Hkv, Tmax, D), the new tokens of row b
    written from slot starts[b]; or, with `slots` = (write (B*T,), read (B, L)) int64, a paged pool
    (layers, S, Hkv, D), token i written to slot write[i] and row b's key j read from slot read[b, j]."""
    b, t, d = x.shape
    n, hd = b * t, stack.heads * stack.head_dim
    qkv_out = (stack.heads + 2 * stack.kv_heads) * stack.head_dim
    # contiguous rows: slots of head_dim floats; a pool: slots of kv_heads x head_dim floats
    inner = (stack.head_dim, 1) if slots is None else (stack.kv_heads * stack.head_dim, stack.head_dim, 1)
    if keys.stride() != values.stride() or keys.stride()[-len(inner):] != inner:
        raise ValueError(f"keys and values need the same strides with contiguous slots, got {keys.stride()} and "
                         f"{values.stride()}")
    mask = None if visible is None else visible.contiguous().view(torch.uint8)  # (B, T, L): bool is one byte
    scratch = torch.empty(n * (3 * d + qkv_out + 3 * hd + 3 * stack.intermediate), dtype=torch.float32)
    cos, sin = cos.contiguous(), sin.contiguous()  # held here: a copy must outlive the call that reads it
    if slots is None:
        write = read = gathered = None
        seq_stride, head_stride, slot_stride = keys.stride(1), keys.stride(2), 0
    else:
        write, read = (s.to(torch.int64).contiguous() for s in slots)
        # the pool's keys and values of every row, copied into contiguous rows for attention
        gathered = torch.empty(2 * b * stack.kv_heads * key_len * stack.head_dim, dtype=torch.float32)
        seq_stride, head_stride, slot_stride = 0, 0, keys.stride(1)
    stack.kernel.library.playground_layers(
        x.data_ptr(), b, t, d, stack.num_layers, stack.pointers, stack.formats, stack.heads, stack.kv_heads,
        stack.head_dim, stack.intermediate, stack.eps, cos.data_ptr(), sin.data_ptr(), keys.data_ptr(),
        values.data_ptr(), keys.stride(0), seq_stride, head_stride, (ctypes.c_int * b)(*starts),
        None if write is None else write.data_ptr(), None if read is None else read.data_ptr(), slot_stride,
        None if gathered is None else gathered.data_ptr(), key_len, None if mask is None else mask.data_ptr(),
        stack.head_dim ** -0.5, scratch.data_ptr(), torch.get_num_threads())
