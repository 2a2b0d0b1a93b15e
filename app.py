"""Entry point of the web app, locally (`python app.py`) and as a Hugging Face Space (app_file: app.py)."""

from playground.ui import build_app, launch_options

try:  # a GPU Space provides `spaces`; its GPU decorator then wraps the handlers that run models
    import spaces
    on_gpu = spaces.GPU
except ImportError:
    on_gpu = None

app = build_app(on_gpu)

if __name__ == "__main__":
    app.launch(**launch_options())
