"""The server's /metrics: Prometheus's text format after real requests, counters that match the engine's own, the
speculative counters under vLLM's names, and the same API key as /v1 unless it is made public."""

from __future__ import annotations

import http.client
import json

from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from playground.config import EngineParams
from playground.decoding.registry import build_proposer
from playground.prometheus import PREFIX

from .prompts import PROMPTS
from .test_server import get, running

KEY = "sekret"


def scrape(srv, key: str | None = KEY) -> tuple[int, str, dict[tuple[str, tuple], float]]:
    """GET /metrics: its status, content type and samples by (name, sorted labels)."""
    connection = http.client.HTTPConnection(srv.host, srv.port, timeout=60)
    connection.request("GET", "/metrics", headers={"Authorization": f"Bearer {key}"} if key else {})
    response = connection.getresponse()
    text = response.read().decode()
    if response.status != 200:
        return response.status, text, {}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    return response.status, response.getheader("Content-Type"), samples


def one(samples: dict, name: str, **labels: str) -> float:
    found = [v for (n, ls), v in samples.items() if n == PREFIX + name and set(labels.items()) <= set(ls)]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def test_metrics_count_what_the_engine_did(target) -> None:
    """Requests through the openai client, one refused: the counts by outcome, the tokens, the latency histograms'
    counts, the KV blocks and the speculative counters equal what the engine reports in /v1/engine."""
    proposer = build_proposer(target, "prompt-lookup")
    # as set, so that proposals are kept several tokens deep and every per-position counter is exercised
    with running(target, EngineParams(num_blocks=128, block_size=8, max_running=2, plan="as-set"), proposer=proposer,
                 api_key=KEY) as srv:
        client = OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)
        prompts = ["Repeat this list exactly: red, green, blue, red, green, blue.", PROMPTS[0], PROMPTS[6]]
        replies = [client.chat.completions.create(model="embedded", messages=[{"role": "user", "content": p}],
                                                  max_tokens=16, temperature=0) for p in prompts]
        status, _ = get(srv, "/v1/engine")
        assert status == 401  # the key guards /v1 ...
        assert scrape(srv, key=None)[0] == 401  # ... and /metrics alike
        bad = http.client.HTTPConnection(srv.host, srv.port, timeout=60)
        bad.request("POST", "/v1/completions", '{"prompt": "hi", "max_tokens": 0}',
                    {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
        assert bad.getresponse().status == 400
        connection = http.client.HTTPConnection(srv.host, srv.port, timeout=60)
        connection.request("GET", "/v1/engine", headers={"Authorization": f"Bearer {KEY}"})
        state = json.loads(connection.getresponse().read())
        status, content_type, samples = scrape(srv)
    assert status == 200 and content_type.startswith("text/plain; version=0.0.4")
    finished = {r.choices[0].finish_reason for r in replies}
    assert sum(one(samples, "request_success_total", finished_reason=reason) for reason in finished) == 3
    assert one(samples, "request_failure_total", status="400") == 1
    assert one(samples, "request_failure_total", status="401") == 2  # /v1/engine and /metrics without the key
    assert one(samples, "generation_tokens_total") == sum(r.usage.completion_tokens for r in replies)
    assert one(samples, "prompt_tokens_total") == sum(r.usage.prompt_tokens for r in replies)
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert one(samples, histogram + "_count") == 3 and one(samples, histogram + "_sum") > 0
    assert one(samples, "time_per_output_token_seconds_count") == 3
    assert one(samples, "num_requests_running") == state["running"] == 0
    assert one(samples, "num_requests_waiting") == 0
    kv = state["kv"]
    assert one(samples, "kv_blocks_used") == kv["blocks_used"]
    assert one(samples, "kv_blocks_free") == kv["blocks_total"] - kv["blocks_used"]
    assert one(samples, "num_preemptions_total") == state["preemptions"] == 0
    drafts = state["drafts"]
    assert drafts["drafts"] > 0 and 0 < drafts["accepted"] < drafts["draft_tokens"]
    assert one(samples, "spec_decode_num_drafts_total") == drafts["drafts"]
    assert one(samples, "spec_decode_num_draft_tokens_total") == drafts["draft_tokens"]
    assert one(samples, "spec_decode_num_accepted_tokens_total") == drafts["accepted"]
    per_position = [one(samples, "spec_decode_num_accepted_tokens_per_pos_total", position=str(j))
                    for j in range(len(drafts["accepted_at"]))]
    assert per_position == drafts["accepted_at"] and sum(per_position) == drafts["accepted"]
    assert per_position == sorted(per_position, reverse=True)  # a node kept at depth j + 1 had one kept at j
    assert len([count for count in per_position if count > 0]) >= 3, per_position  # kept at 3 positions or more
    counts = state["proposer"]["counts"]["copy"]
    assert drafts["accepted"] == counts["accepted"] and drafts["draft_tokens"] == counts["proposed"]


def test_public_metrics_need_no_key_and_plain_decoding_has_no_speculative_counters(target) -> None:
    with running(target, EngineParams(num_blocks=64, block_size=8, max_running=1), api_key=KEY,
                 metrics_public=True) as srv:
        status, _, samples = scrape(srv, key=None)
    assert status == 200 and one(samples, "kv_blocks_free") == 64
    assert not any(name.startswith(PREFIX + "spec_decode") for name, _ in samples)
