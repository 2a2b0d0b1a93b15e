"""A public app (a Space, or `python app.py --public`): the model panel offers the embedded model and an
allow-list, refuses local paths without saying whether they exist, and keeps few models loaded."""

from __future__ import annotations

import pytest
from gradio_client import Client

from playground.config import ModelSpec
from playground.models import ModelLoadError
from playground.ui import build_app, launch_options, models


@pytest.fixture
def public_client(target, monkeypatch):
    monkeypatch.setenv(models.MODELS_ENV, "nobody/allowed-model")
    app = build_app(public=True)
    app.launch(prevent_thread_lock=True, quiet=True, **launch_options())
    yield Client(app.local_url, verbose=False)
    app.close()
    models.catalog.access = models.Access()


def test_a_public_app_loads_only_what_it_offers(public_client, target, tmp_path):
    summary = public_client.predict("embedded", "", "cpu", "float32", "auto", api_name="/load_model")
    assert "Target: **SmolLM2-135M-Instruct**" in summary
    refusal = "model: this public app loads only embedded, nobody/allowed-model; got "
    existing, missing = str(target.folder), str(tmp_path / "missing")
    for source in (existing, missing, "~/.ssh", "other/model", "/etc/passwd.gguf"):
        with pytest.raises(Exception, match="is not in the list of choices|" + refusal) as refused:
            public_client.predict(source, "", "cpu", "float32", "auto", api_name="/load_model")
        assert "does not exist" not in str(refused.value) and "no config.json" not in str(refused.value)
    with pytest.raises(Exception, match="draft: this public app loads only|is not in the list of choices"):
        public_client.predict("embedded", existing, "cpu", "float32", "auto", api_name="/load_model")
    # the handlers check too, whatever reaches them
    with pytest.raises(ModelLoadError, match=refusal):
        models.get_model(ModelSpec(source=existing, device="cpu"))
    # an allowed hub id is fetched (offline here: refused), and the message names no local file
    with pytest.raises(Exception, match="could not fetch 'nobody/allowed-model'") as refused:
        public_client.predict("nobody/allowed-model", "", "cpu", "float32", "auto", api_name="/load_model")
    assert str(target.folder) not in str(refused.value)


def test_a_public_app_races_no_remote_endpoint(public_client):
    """The Race tab offers no OpenAI endpoint lane, and one asked for through the API is refused before any request
    leaves: a public app reaches no other server."""
    with pytest.raises(Exception, match="is not in the list of choices|unknown: OpenAI endpoint"):
        public_client.predict("hi", ["OpenAI endpoint"], 8, 0.0, 0, "measured", "embedded", "", "cpu", "float32",
                              "auto", "http://127.0.0.1:9/v1", "", "", api_name="/race")


def test_an_allow_list_of_paths_is_refused():
    with pytest.raises(Exception, match="PLAYGROUND_MODELS: '/data/model' is not a hub id"):
        models.Access(public=True, allowed=("/data/model",))


def test_loaded_models_are_few_and_the_least_recently_used_goes(monkeypatch):
    loaded = []
    monkeypatch.setattr(models, "load_model", lambda spec: loaded.append(spec.source) or object())
    catalog = models.Catalog()
    specs = [ModelSpec(source=f"org/m{i}") for i in range(models.MAX_LOADED + 1)]
    first = catalog.get(specs[0])
    for spec in specs[1:models.MAX_LOADED]:
        catalog.get(spec)
    assert catalog.get(specs[0]) is first  # used again: now the most recent
    catalog.get(specs[-1])  # one too many: the least recently used (m1) goes
    assert catalog.get(specs[0]) is first and loaded.count("org/m1") == 1
    catalog.get(specs[1])
    assert loaded.count("org/m1") == 2
