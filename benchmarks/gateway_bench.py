"""Gateway overhead per call and throughput with many requests in flight.

A local OpenAI-compatible server (uvicorn, its own process) answers every request at
once, so what is measured is the client side. In the same run, against the same
server, with the same request body:

- bare:    an asyncio loop of httpx.AsyncClient POSTs;
- openai:  the `openai` client alone (the HTTP stack the gateway uses: httpx2);
- gateway: `Gateway.chat` with the cache off (template, key, record, retries, slots).

Throughput runs N requests with `--in-flight` of them at a time. The gateway's own cost
per call is its CPU time per call less the openai client's: CPU time, unlike wall time,
barely moves when other work shares the machine. Each round runs every client, a different
one first, and the best of each is kept. Prints, never asserts.

Note: httpx's connection pool slows down as requests in flight grow (here about 900
req/s at 1, 400 at 8, 80-140 at 64), so at 64 in flight the bare loop is not a floor;
the openai line is the fair comparison for the gateway.

    python benchmarks/gateway_bench.py [--requests 2000] [--in-flight 64] [--rounds 3]

Target (the project brief): gateway / openai client throughput >= 0.9 with 64 or more in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import socket
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import uvicorn

from trajforge.llm import Gateway, Prompt, load_prompt
from trajforge.schemas.config import EndpointSettings, LLMSettings

MODEL = "bench-model"
ANSWER = (
    b'{"id":"bench","object":"chat.completion","created":0,"model":"bench-model","choices":[{"index":0,'
    b'"message":{"role":"assistant","content":"{\\"label\\": \\"GOOD\\"}"},"finish_reason":"stop"}],'
    b'"usage":{"prompt_tokens":40,"completion_tokens":6,"total_tokens":46}}'
)
PROMPT = """
version: 1
sampling: {max_tokens: 16}
messages:
  - role: system
    content: You judge one step of a GUI agent. Answer with one JSON object.
  - role: user
    content: "Step {{ n }}: the agent clicked Save on the settings page."
"""


async def _instant(scope: dict, receive: Callable, send: Callable) -> None:
    """An OpenAI-compatible chat endpoint in shape only: reads the request, answers the same completion."""
    if scope["type"] != "http":
        return
    more = True
    while more:
        more = (await receive()).get("more_body", False)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(ANSWER)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": ANSWER})


def _serve(port: int) -> None:
    uvicorn.run(
        _instant,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        access_log=False,
        backlog=4096,
        timeout_keep_alive=120,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Score:
    rate: float  # requests per second, `in_flight` at a time
    latency_us: float  # mean wall time of a call, one at a time
    cpu_us: float  # this process's CPU time per call, `in_flight` at a time: robust to a busy machine

    def best(self, other: Score) -> Score:
        return Score(max(self.rate, other.rate), min(self.latency_us, other.latency_us), min(self.cpu_us, other.cpu_us))


async def _run(call: Callable[[int], Awaitable[object]], total: int, in_flight: int) -> tuple[float, float]:
    """Wall and CPU seconds for `total` calls with `in_flight` workers each taking the next call."""
    counter = iter(range(total))

    async def worker() -> None:
        for n in counter:
            await call(n)

    start, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker() for _ in range(in_flight)))
    return time.perf_counter() - start, time.process_time() - cpu


def _body(prompt: Prompt, n: int) -> dict[str, object]:
    """What the gateway sends for request n, so the bare clients send the same bytes."""
    rendered = prompt.render(n=n)
    return {
        "model": MODEL,
        "messages": [{"role": m.role, "content": m.text} for m in rendered.messages],
        "temperature": 0.0,
        "top_p": 1.0,
        "max_tokens": 16,
    }


async def bench(url: str, total: int, in_flight: int, gateway: Gateway, prompt: Prompt, turn: int) -> dict[str, Score]:
    """One round: each client's score. The clients take turns going first (`turn`): measured in a fixed order,
    the one that ran last read 0.87 twice in three runs and 0.92-0.94 when it ran first."""
    async with httpx.AsyncClient(base_url=url, limits=httpx.Limits(max_connections=in_flight), timeout=30) as http:
        client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=30)

        async def bare(n: int) -> None:
            response = await http.post("/chat/completions", json=_body(prompt, n))
            response.raise_for_status()
            response.json()

        async def sdk(n: int) -> None:
            await client.chat.completions.create(**_body(prompt, n))  # type: ignore[call-overload]

        async def gw(n: int) -> None:
            await gateway.chat(prompt.render(n=n))

        out = {}
        single = min(300, total)
        clients = [("bare", bare), ("openai", sdk), ("gateway", gw)]
        for name, call in clients[turn % 3:] + clients[:turn % 3]:
            await _run(call, min(200, total), in_flight)  # warm connections
            seconds, cpu = await _run(call, total, in_flight)
            one_at_a_time, _ = await _run(call, single, 1)
            out[name] = Score(total / seconds, one_at_a_time / single * 1e6, cpu / total * 1e6)
        await client.close()
        await gateway.aclose()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    port = _free_port()
    server = multiprocessing.Process(target=_serve, args=(port,), daemon=True)
    server.start()
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.post(f"{url}/chat/completions", json={}, timeout=1)
            break
        except httpx.HTTPError:
            assert time.monotonic() < deadline, "bench server did not start"
            time.sleep(0.1)

    settings = LLMSettings(
        endpoints={"bench": EndpointSettings(base_url=url, model=MODEL, max_concurrency=args.in_flight, timeout_s=30)},
        default="bench",
        cache=False,
    )
    best: dict[str, Score] = {}
    try:
        with tempfile.TemporaryDirectory() as folder:
            (Path(folder) / "bench.yaml").write_text(PROMPT)
            prompt = load_prompt("bench", Path(folder))
        for turn in range(args.rounds):
            with Gateway(settings) as gateway:
                result = asyncio.run(bench(url, args.requests, args.in_flight, gateway, prompt, turn))
            for name, score in result.items():
                best[name] = best[name].best(score) if name in best else score
    finally:
        server.terminate()
        server.join()

    print(f"{args.requests} requests, {args.in_flight} in flight, best of {args.rounds} rounds, server answers at once")
    print(f"{'client':<9} {'req/s':>8} {'CPU µs/call':>12} {'µs/call, 1 in flight':>21}")
    for name, score in best.items():
        print(f"{name:<9} {score.rate:>8.0f} {score.cpu_us:>12.0f} {score.latency_us:>21.0f}")
    bare, sdk, gw = best["bare"], best["openai"], best["gateway"]
    print(f"gateway CPU per call over the openai client it wraps: {gw.cpu_us - sdk.cpu_us:.0f} µs")
    print(f"throughput ratio gateway/bare httpx: {gw.rate / bare.rate:.2f}")
    print(f"throughput ratio gateway/openai client: {gw.rate / sdk.rate:.2f} (target >= 0.9)")


if __name__ == "__main__":
    main()
