"""A client of nri-accel's metrics endpoint over real HTTP, for tests.

Stands for Prometheus scraping /metrics and for kubelet's HTTP probes. get() one path;
scrape() /metrics, parsed with prometheus_client's own parser (so a malformed
exposition fails the test); wait_for() a probe's status; logged_address() reads the
address a daemon started with `--metrics-address 127.0.0.1:0 --log-file FILE` bound,
from its `metrics_serving` log line. Addresses are "host:port" or "[v6]:port" (what
str(nri_accel.metrics.Address) gives). Everything here blocks: from async code, go
through asyncio.to_thread, so that the event loop under test keeps ticking.
"""

from __future__ import annotations

import http.client
import json
import time
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Answer:
    status: int
    content_type: str
    text: str


def get(address: str, path: str, *, accept: str = "", method: str = "GET",
        timeout: float = 5.0) -> Answer:
    conn = http.client.HTTPConnection(address, timeout=timeout)
    try:
        conn.request(method, path, headers={"Accept": accept} if accept else {})
        response = conn.getresponse()
        return Answer(response.status, response.getheader("Content-Type", ""),
                      response.read().decode())
    finally:
        conn.close()


class Samples:
    """The samples of one scrape by name (with its _total, _bucket... suffix) and labels."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.values: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                self.values[s.name, frozenset(s.labels.items())] = s.value

    def value(self, name: str, **labels: str) -> float:
        """The sample `name{labels}`; KeyError (listing the names seen) when absent."""
        key = (name, frozenset(labels.items()))
        if key not in self.values:
            raise KeyError(f"{name}{labels} not scraped; names: "
                           f"{sorted({n for n, _ in self.values})}")
        return self.values[key]

    def labelled(self, name: str) -> dict[frozenset[tuple[str, str]], float]:
        """Every sample of `name`, by its labels."""
        return {labels: v for (n, labels), v in self.values.items() if n == name}


def scrape(address: str) -> Samples:
    answer = get(address, "/metrics")
    if answer.status != 200:
        raise AssertionError(f"GET /metrics: {answer.status} {answer.text!r}")
    return Samples(answer.text)


def wait_for(address: str, path: str, status: int, *, timeout: float = 10.0) -> Answer:
    """GET `path` until it answers `status`; AssertionError with the last answer if it
    does not within `timeout` seconds (a deadline for hangs, not a speed check)."""
    deadline = time.monotonic() + timeout
    while True:
        answer = get(address, path)
        if answer.status == status or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    if answer.status != status:
        raise AssertionError(f"GET {path}: still {answer.status} {answer.text!r} "
                             f"after {timeout} s, waiting for {status}")
    return answer


def logged_address(log_file: str | Path, *, timeout: float = 10.0) -> str:
    """The address in the first `metrics_serving` line of a JSON log file, waiting for
    it to be written."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            lines = Path(log_file).read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            lines = []
        for line in lines:
            if '"metrics_serving"' in line:
                event = json.loads(line)
                if event.get("event") == "metrics_serving":
                    return str(event["address"])
        if time.monotonic() > deadline:
            raise AssertionError(f"no metrics_serving line in {log_file} after {timeout} s")
        time.sleep(0.02)
