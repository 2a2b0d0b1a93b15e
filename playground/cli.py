"""What every command line of the project shares (`python -m playground`, `python -m playground.train`): a parser
whose errors are one line, the model options, and user errors turned into one line and exit code 2."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path
from typing import NoReturn

from .config import DEVICES, DTYPES, FORWARDS, QUANTS, WEIGHTS, ConfigError, ModelSpec
from .models import ModelLoadError, UnsupportedModelError
from .trace import TraceError

USER_ERRORS = (ConfigError, ModelLoadError, UnsupportedModelError, TraceError)


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def shown(path: Path) -> str:
    return str(path) if len(str(path)) <= 80 else f"{str(path)[:79]}…"


def check_folder(name: str, folder: Path, create: bool = True) -> None:
    """A folder can hold what a command writes: checked before its work, not after. It exists, or (`create`) can be
    made: the nearest part of the path that exists is a folder this user may write in."""
    if folder.exists():
        if not folder.is_dir():
            raise ConfigError(f"{name}: {shown(folder)} is a file, not a folder")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise ConfigError(f"{name}: cannot write in {shown(folder)} (permission denied)")
        return
    if not create:
        raise ConfigError(f"{name}: no such folder {shown(folder)}")
    above = folder.absolute().parent
    while not above.exists():
        above = above.parent
    if not above.is_dir():
        raise ConfigError(f"{name}: {shown(above)} is a file, not a folder")
    if not os.access(above, os.W_OK | os.X_OK):
        raise ConfigError(f"{name}: cannot create {shown(folder)} (permission denied in {shown(above)})")


def check_writable(name: str, paths: list[Path], create_folders: bool = False) -> None:
    """Files can be written at `paths`: checked before a long run, not after it, by creating each (and removing it
    again where it did not exist): a folder, a device, a file name too long or a place nothing may be created is
    refused now. `create_folders`: a missing folder the command would make is fine where it can be made."""
    for path in paths:
        check_folder(name, path.parent, create_folders)
        if not path.parent.is_dir():
            continue  # made by the command; what may be written there was checked above
        try:
            if path.is_dir():
                raise ConfigError(f"{name}: {shown(path)} is a folder; give a file name")
            if path.exists() and not path.is_file():
                raise ConfigError(f"{name}: {shown(path)} is not a regular file; give a file name")
            existed = path.exists()
            with open(path, "ab"):
                pass
            if not existed:
                path.unlink()
        except OSError as exc:
            raise ConfigError(f"{name}: cannot write {shown(path)} ({exc.strerror or exc})") from None


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="embedded",
                        help="'embedded' (SmolLM2-135M-Instruct), a hub id, a local folder or a .gguf file")
    parser.add_argument("--device", default="auto", choices=DEVICES)
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument("--quant", default=None, choices=QUANTS, help="bitsandbytes quantization of linear layers")
    parser.add_argument("--weights", default="auto", choices=WEIGHTS,
                        help="what a GGUF model's products read: gguf-int8, the file's blocks (Q8_0, Q4_1; Q4_0 "
                             "and Q5_0 as Q4_1 and Q8_0) against "
                             "activations rounded to 8 bits, multiplied in integers (native CPU kernel); gguf, the "
                             "same blocks against float32 activations; float32, the weights dequantised; auto "
                             "(default): gguf-int8 where it can run, else float32")
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
    """Parse, run the chosen command, and turn user errors into one line and exit code 2, Ctrl+C into one line and
    exit code 130. A library that turns Ctrl+C's KeyboardInterrupt into another error (torch, loading weights, does)
    still ends in that one line: the interrupt is noted as it arrives."""
    args = parser.parse_args(argv)
    interrupted = False

    def interrupt(signum: int, frame: object) -> None:
        nonlocal interrupted
        interrupted = True
        raise KeyboardInterrupt

    # only where Python's own handler is in place: not where the process was started with Ctrl+C ignored
    listening = (threading.current_thread() is threading.main_thread()
                 and signal.getsignal(signal.SIGINT) is signal.default_int_handler)
    if listening:
        signal.signal(signal.SIGINT, interrupt)
    try:
        return args.func(args)
    except USER_ERRORS as exc:
        if not interrupted:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    except KeyboardInterrupt:
        pass
    except Exception:
        if not interrupted:
            raise
    finally:
        if listening and not interrupted:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl+C while the process ends adds no traceback
    print("Interrupted.", file=sys.stderr)
    return 130
