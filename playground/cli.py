"""What every command line of the project shares (`python -m playground`, `python -m playground.train`): a parser
whose errors are one line, the model options, and user errors turned into one line and exit code 2."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from .config import DEVICES, DTYPES, FORWARDS, QUANTS, WEIGHTS, ConfigError, ModelSpec
from .models import ModelLoadError, UnsupportedModelError
from .trace import TraceError

USER_ERRORS = (ConfigError, ModelLoadError, UnsupportedModelError, TraceError)


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="embedded",
                        help="'embedded' (SmolLM2-135M-Instruct), a hub id, a local folder or a .gguf file")
    parser.add_argument("--device", default="auto", choices=DEVICES)
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument("--quant", default=None, choices=QUANTS, help="bitsandbytes quantization of linear layers")
    parser.add_argument("--weights", default="auto", choices=WEIGHTS,
                        help="what a GGUF model's products read: gguf, the file's Q8_0/Q4_1 blocks (native CPU "
                             "kernel, float32, each block summed apart; a fifth of the bytes); float32, dequantised; "
                             "auto (default): gguf where it can run")
    forwards = parser.add_mutually_exclusive_group()
    forwards.add_argument("--forwards", default="auto", choices=FORWARDS,
                          help="how decode forwards run: graphs, static shapes captured in CUDA graphs (CUDA only); "
                               "compiled, static with each layer's work around attention compiled by torch.compile "
                               "(captured in graphs on a CUDA GPU; compiles on first use); static, the same shapes "
                               "uncaptured (any device, for debugging); eager, each at its own shape; auto (default): "
                               "graphs on a CUDA GPU, else eager")
    forwards.add_argument("--no-graphs", dest="forwards", action="store_const", const="eager",
                          help="the same as --forwards eager")
    parser.add_argument("--cache-dir", default=None,
                        help="where converted GGUF weights are cached (default $PLAYGROUND_CACHE or "
                             "~/.cache/decoding-playground)")


def model_spec(args: argparse.Namespace) -> ModelSpec:
    return ModelSpec(source=args.model, device=args.device, dtype=args.dtype, quant=args.quant,
                     cache_dir=args.cache_dir, weights=args.weights, forwards=args.forwards)


def run_cli(parser: argparse.ArgumentParser, argv: list[str] | None) -> int:
    """Parse, run the chosen command, and turn user errors into one line and exit code 2."""
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
