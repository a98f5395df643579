"""`xserv serve` on the GPU: 256 concurrent streaming clients all complete, each with the text its request gets
alone (greedy), and the KV pool returns to idle afterwards."""
import asyncio

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from qwen3_reference import perturbed_model_dir  # noqa: E402,F401
from server_process import ServerProcess, stream_text  # noqa: E402


@pytest.mark.gpu
def test_256_concurrent_streams_on_the_gpu(perturbed_model_dir, rng):  # noqa: F811
    s = ServerProcess(perturbed_model_dir, "--max-model-len", "1024", device="cuda").start(timeout=600)
    try:
        idle = s.metrics()
        prompts = [rng.integers(0, 5000, int(rng.integers(3, 200))).tolist() for _ in range(32)]
        body = dict(max_tokens=32, ignore_eos=True, temperature=0.0)
        alone = []
        for p in prompts:
            r = httpx.post(s.url + "/v1/completions", json={"prompt": p, **body}, timeout=120)
            assert r.status_code == 200, r.text
            alone.append(r.json()["choices"][0]["text"])
        assert len(set(alone)) > 16

        async def all_at_once():
            async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=None)) as c:
                return await asyncio.gather(*[stream_text(c, s.url, {"prompt": prompts[i % 32], **body})
                                              for i in range(256)])

        results = asyncio.run(all_at_once())
        assert all(finish == "length" for _, finish, _ in results)
        mismatched = [i for i, (text, _, _) in enumerate(results) if text != alone[i % 32]]
        assert not mismatched, f"{len(mismatched)} of 256 streams differ from their request alone"
        m = s.metrics()
        assert m["xserv_num_requests_running"] == 0 and m["xserv_num_requests_waiting"] == 0
        assert m["xserv_kv_blocks_free"] == idle["xserv_kv_blocks_free"]
    finally:
        s.stop()
