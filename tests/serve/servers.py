"""Servers for the tests: a real `psr serve` process (as vLLM's RemoteOpenAIServer), and
the same app in this process (uvicorn in a thread) where a test needs the model itself."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai

START_TIMEOUT_S = 300  # loading under a busy CI machine


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Base:
    url: str

    def client(self, **kw: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, **kw)

    def http(self, **kw: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kw.pop("timeout", 120), **kw)

    def metrics(self, **kw: Any) -> dict[str, float]:
        """`/metrics` as {'name{labels}': value}, without the `model_name` label every
        series carries (checked to be there)."""
        text = httpx.get(f"{self.url}/metrics", timeout=30, **kw).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, value = line.rsplit(" ", 1)
                assert 'model_name="' in key, line
                key = re.sub(r'model_name="[^"]*",?', "", key).replace("{}", "")
                out[key.replace(",}", "}")] = float(value)
        return out

    def wait_until(self, what: Callable[[dict[str, float]], bool], timeout: float = 60) -> None:
        """Poll /metrics until `what(metrics)` holds."""
        deadline = time.monotonic() + timeout
        while not what(m := self.metrics()):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting on /metrics: {m}")
            time.sleep(0.02)


class RemoteServer(_Base):
    """`python -m psr.cli serve ARGS` on a free loopback port, polled on /health until it
    answers 200, killed by close()."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "psr.cli", "serve", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
        try:
            self._wait_healthy()
        except BaseException:
            self.close()
            raise

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"psr serve exited ({self.proc.returncode}):\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"psr serve did not become healthy:\n{self.log()}")
            time.sleep(0.1)

    def log(self) -> str:
        return Path(self._log.name).read_text()

    def request_lines(self, request_id: str) -> list[str]:
        return [line for line in self.log().splitlines() if re.search(rf"\b{request_id}\b", line)]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        os.unlink(self._log.name)


class InProcessServer(_Base):
    """The app over `loader` (an Engine's), served by uvicorn in a daemon thread."""

    def __init__(
        self,
        loader: Callable[[], Any],
        name: str = "test",
        max_queue: int = 16,
        options: Any = None,
        parallel: int | None = 1,
        **engine: Any,
    ) -> None:
        import uvicorn

        from psr.serve.app import create_app
        from psr.serve.metrics import Metrics
        from psr.serve.worker import Engine

        self.engine = Engine(
            loader, max_queue=max_queue, metrics=Metrics(name), parallel=parallel, **engine
        )
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            create_app(self.engine, served_name=name, options=options),
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            access_log=False,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.01)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)
        assert not self.thread.is_alive(), "the in-process server did not stop"
