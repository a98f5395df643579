"""`xserv bench serve`: streaming HTTP clients against a running `xserv serve` (or any OpenAI-compatible server),
like `vllm bench serve`. The workload is `xserv bench throughput`'s (the same seed gives the same random-token
prompts and output lengths, `ignore_eos`), sent to /v1/completions as token ids, all at once, at a Poisson
`--request-rate`, or with at most `--max-concurrency` in flight. Prints throughput and TTFT, TPOT (time per output
token after the first), ITL (time between streamed chunks) and end-to-end latency at p50/p90/p99.

`--json-schema FILE`: every request carries the schema as `response_format` json_schema (structured output: each
answer ends when its JSON is complete, so the output lengths are the schema's, not the workload's); the bench then
counts the answers that parse as JSON and, with `jsonschema` installed (the dev extra), those that validate."""
from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from .. import settings
from .common import add_workload_arguments, write_json
from .throughput import make_workload

QWEN3_VOCAB = 151_936


def server_url(text: str) -> str:
    """An argparse type: http(s)://HOST[:PORT][/PATH] with a port in 1-65535, checked when the command line is
    read (the HTTP client's own error for a bad one would come after the workload is built)."""
    import argparse
    from urllib.parse import urlsplit

    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"expected http://HOST[:PORT] or https://HOST[:PORT], got {text!r}")
    try:
        port = parts.port
    except ValueError:  # not a number, or above 65535
        port = -1
    if port is not None and not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"the port of {text!r} is not a port number (1-65535)")
    return text


def add_arguments(p) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--url", type=server_url, default="http://127.0.0.1:8000",
                   help="the server (default http://127.0.0.1:8000)")
    g.add_argument("--model", default=None, help="the model name to send (default: the first of /v1/models)")
    g.add_argument("--api-key", default=settings.API_KEY.get(), metavar="KEY",
                   help="sent as 'Authorization: Bearer KEY' (default: the XSERV_API_KEY environment variable)")
    g.add_argument("--timeout", type=float, default=1800.0, metavar="S", help="per-request timeout (default 1800)")
    g = p.add_argument_group("workload")
    g.add_argument("--num-prompts", type=int, default=256, metavar="N", help="requests (default 256)")
    rate = g.add_mutually_exclusive_group()
    rate.add_argument("--request-rate", type=float, default=math.inf, metavar="R",
                      help="requests per second, Poisson arrivals (default inf: all at once)")
    rate.add_argument("--max-concurrency", type=int, default=None, metavar="C",
                      help="at most C requests in flight, each new one sent as one ends")
    g.add_argument("--json-schema", default=None, metavar="FILE",
                   help="a JSON schema file: every request constrained to it (response_format json_schema); "
                        "prints how many answers parsed")
    add_workload_arguments(g)  # --seed also seeds the arrivals here


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = math.nan
    e2e: float = math.nan
    itl: list[float] = field(default_factory=list)
    text: list[str] = field(default_factory=list)  # the streamed answer, kept with --json-schema

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else math.nan


async def stream_one(client, url: str, body: dict, keep_text: bool = False) -> RequestResult:
    """One streaming /v1/completions request; times its chunks (each carries one or more new tokens)."""
    result = RequestResult(prompt_tokens=len(body["prompt"]))
    start = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message"))
                    return result
                now = time.perf_counter()
                if chunk.get("choices"):
                    if keep_text:
                        result.text.append(chunk["choices"][0].get("text") or "")
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.e2e = time.perf_counter() - start
    result.ok = last is not None
    if not result.ok:
        result.error = "no tokens streamed"
    return result


def load_schema(path: str | None) -> dict | None:
    if path is None:
        return None
    try:
        with open(path) as f:
            schema = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--json-schema {path}: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"--json-schema {path}: the schema must be a JSON object")
    return schema


async def run_clients(args, prompts: list[list[int]], out_lens: list[int], model: str | None,
                      transport=None) -> tuple[list, float]:
    """transport: httpx's, for tests (a fake server)."""
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    url = args.url.rstrip("/") + "/v1/completions"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    gate = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    arrivals = np.random.default_rng(args.seed + 1)
    schema = load_schema(getattr(args, "json_schema", None))
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=args.timeout, transport=transport) as client:
        async def one(i):
            # with a schema the answer ends where its JSON does (EOS is allowed only there)
            body = {"prompt": prompts[i], "max_tokens": out_lens[i], "ignore_eos": schema is None, "stream": True,
                    "stream_options": {"include_usage": True}, "temperature": args.temperature,
                    "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed + i}
            if model is not None:
                body["model"] = model
            if schema is not None:
                body["response_format"] = {"type": "json_schema",
                                           "json_schema": {"name": "bench", "schema": schema, "strict": True}}
            if gate is None:
                return await stream_one(client, url, body, schema is not None)
            async with gate:
                return await stream_one(client, url, body, schema is not None)

        start = time.perf_counter()
        tasks = []
        for i in range(len(prompts)):
            tasks.append(asyncio.create_task(one(i)))
            if math.isfinite(args.request_rate) and i + 1 < len(prompts):
                await asyncio.sleep(arrivals.exponential(1.0 / args.request_rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def _first_model(args) -> str | None:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        r = httpx.get(args.url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    except httpx.HTTPError as e:
        raise RuntimeError(f"cannot reach {args.url}: {e}") from None
    if r.status_code != 200:
        raise RuntimeError(f"{args.url}/v1/models answered HTTP {r.status_code}: {r.text[:200]}")
    data = r.json().get("data") or []
    return data[0]["id"] if data else None


def percentiles(values) -> dict:
    v = np.asarray([x for x in values if math.isfinite(x)], np.float64)
    if v.size == 0:
        return {"mean": math.nan, "p50": math.nan, "p90": math.nan, "p99": math.nan}
    return {"mean": float(v.mean()), "p50": float(np.percentile(v, 50)), "p90": float(np.percentile(v, 90)),
            "p99": float(np.percentile(v, 99))}


def summarize(results: list[RequestResult], elapsed: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "elapsed_s": elapsed,
        "input_tokens": in_tokens, "output_tokens": out_tokens,
        "request_throughput": len(ok) / elapsed, "output_tokens_per_s": out_tokens / elapsed,
        "total_tokens_per_s": (in_tokens + out_tokens) / elapsed,
        "ttft_s": percentiles(r.ttft for r in ok), "tpot_s": percentiles(r.tpot for r in ok),
        "itl_s": percentiles(x for r in ok for x in r.itl), "e2e_s": percentiles(r.e2e for r in ok),
    }


def count_answers(results: list[RequestResult], schema: dict) -> dict:
    """How many of the finished answers parse as JSON, and validate against the schema (None without jsonschema)."""
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    parsed = valid = 0
    for r in results:
        if not r.ok:
            continue
        try:
            value = json.loads("".join(r.text))
        except ValueError:
            continue
        parsed += 1
        if jsonschema is not None:
            try:
                jsonschema.validate(value, schema)
                valid += 1
            except jsonschema.ValidationError:
                pass
    return {"answers_parsed": parsed, "answers_valid": valid if jsonschema is not None else None}


def run(args) -> int:
    try:
        import httpx  # noqa: F401
    except ImportError:
        raise RuntimeError("xserv bench serve needs httpx: pip install httpx") from None
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0, got {args.request_rate}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    schema = load_schema(getattr(args, "json_schema", None))
    model = args.model or _first_model(args)
    prompts, out_lens = make_workload(args.num_prompts, args.input_len, args.output_len, args.seed, QWEN3_VOCAB)
    results, elapsed = asyncio.run(run_clients(args, prompts, out_lens, model))
    summary = summarize(results, elapsed)
    result = {"url": args.url, "model": model, "num_prompts": args.num_prompts,
              "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
              "max_concurrency": args.max_concurrency, "input_len": list(args.input_len),
              "output_len": list(args.output_len), "temperature": args.temperature, "top_p": args.top_p,
              "top_k": args.top_k, "seed": args.seed, **summary}
    if schema is not None:
        result["json_schema"] = args.json_schema
        result.update(count_answers(results, schema))
    print(format_summary(result))
    errors = [r.error for r in results if not r.ok]
    if errors:
        print(f"xserv: {len(errors)} requests failed; first: {errors[0]}", file=sys.stderr)
    write_json(args.json, result)
    return 0 if not errors else 1


def format_summary(r: dict) -> str:
    lines = [f"{r['url']} ({r['model']}): {r['completed']} requests ({r['failed']} failed), "
             f"{r['input_tokens']} prompt + {r['output_tokens']} output tokens in {r['elapsed_s']:.2f} s",
             f"  output {r['output_tokens_per_s']:,.0f} tok/s   total {r['total_tokens_per_s']:,.0f} tok/s   "
             f"{r['request_throughput']:.2f} req/s",
             f"  {'ms':<6}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}"]
    for key, name in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_s", "E2E")):
        s = r[key]
        lines.append(f"  {name:<6}" + "".join(f"{s[k] * 1e3:>10.1f}" for k in ("mean", "p50", "p90", "p99")))
    if "answers_parsed" in r:
        valid = "" if r["answers_valid"] is None else f", {r['answers_valid']} valid against the schema"
        lines.append(f"  json schema {r['json_schema']}: {r['answers_parsed']} of {r['completed']} answers parsed as "
                     f"JSON{valid}")
    return "\n".join(lines)
