"""The shipped Grafana dashboard (dashboards/grafana/tokenos.json) against what the server exports: every
series and label its PromQL names is in a real /metrics scrape of the app, after traffic."""

from __future__ import annotations

from tests.fixtures.dashboards import dashboard_problems, expressions, load_dashboard
from tests.fixtures.metrics import EngineRun, value


def scrape_after_traffic(make_client, fake_engine) -> str:
    client = make_client(fake_engine)
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200
    # The fake engine answers without an output processor: play one request down AsyncLLM's metrics path.
    EngineRun(fake_engine.metrics).run("r", "hello", 3, cached=2)
    r = client.get("/metrics")
    assert r.status_code == 200
    return r.text


def test_every_dashboard_query_is_answered_by_the_served_metrics(make_client, fake_engine):
    text = scrape_after_traffic(make_client, fake_engine)
    assert value(text, "vllm:e2e_request_latency_seconds_count", model_name="fake-model") == 1
    assert value(text, "vllm:request_prompt_tokens_sum", model_name="fake-model") == 5
    assert dashboard_problems(text) == []


def test_the_check_catches_unknown_series_and_labels(make_client, fake_engine):
    text = scrape_after_traffic(make_client, fake_engine)
    wrong = {
        "panels": [
            {"targets": [{"expr": "rate(vllm:no_such_thing_total[5m])"}]},
            {"targets": [{"expr": 'sum by (pod) (vllm:num_requests_running{gpu="0"})'}]},
            {"targets": [{"expr": "rate(vllm:e2e_request_latency_seconds[5m])"}]},  # a histogram's bare name
        ]
    }
    assert dashboard_problems(text, wrong) == [
        "vllm:no_such_thing_total is not exported",
        "vllm:num_requests_running has no label 'gpu'",
        "no series in 'sum by (pod) (vllm:num_requests_running{gpu=\"0\"})' has label 'pod'",
        "vllm:e2e_request_latency_seconds is not exported",
    ]


def test_the_dashboard_is_a_grafana_dashboard_over_the_model_and_engine_labels():
    dashboard = load_dashboard()
    panels = dashboard["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        area = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not area & cells, f"{panel['title']} overlaps another panel"
        cells |= area
        if panel["type"] != "row":
            assert panel["targets"] and panel["datasource"]["uid"] == "${datasource}", panel["title"]
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert variables == {"datasource", "model_name", "engine"}
    # Every query is scoped to the chosen model and engine.
    for expr in expressions(dashboard):
        if not expr.startswith("label_values"):
            assert 'model_name=~"$model_name"' in expr and 'engine=~"$engine"' in expr, expr
    titles = " ".join(p["title"] for p in panels).lower()
    for topic in (
        "e2e",
        "first token",
        "inter-token",
        "throughput",
        "scheduler",
        "kv cache",
        "prefix cache",
        "preemptions",
        "prompt length",
        "generation length",
        "finish reason",
        "queue time",
    ):
        assert topic in titles, topic
