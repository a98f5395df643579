"""`xserv serve` on the GPU: 256 concurrent streaming clients all complete, each with the text its request gets
alone (greedy) up to the first near-tie of that run, and the KV pool returns to idle afterwards.

Why "up to the first near-tie": on the GPU a request's logits depend slightly on the batch around it (cuBLAS picks
its algorithm, and so its rounding, by the number of rows), so where the alone run's two best tokens are within
NEAR_TIE nats of each other, a batched run may take the other one and then go its own way. The CPU test in
test_server.py holds every stream to the CPU backend's bound (tests/batch_shape.py: a BLAS may round the NumPy
rows differently by batch shape too)."""
import asyncio

import pytest

httpx = pytest.importorskip("httpx")

from qwen3_reference import perturbed_model_dir  # noqa: E402,F401
from server_process import ServerProcess, http, skip_unless_installed, stream_text  # noqa: E402

skip_unless_installed("fastapi", "uvicorn")

NEAR_TIE = 0.1  # nats between the alone run's best and second-best token


def first_near_tie(logprobs: dict) -> int | None:
    """Text offset of the first token the alone run chose by less than NEAR_TIE (None: no such token). Two
    candidates that decode to the same text share a key in top_logprobs: that counts as a tie too."""
    for offset, top in zip(logprobs["text_offset"], logprobs["top_logprobs"]):
        best = sorted(top.values(), reverse=True)
        if len(best) < 2 or best[0] - best[1] < NEAR_TIE:
            return offset
    return None


@pytest.mark.gpu
def test_256_concurrent_streams_on_the_gpu(perturbed_model_dir, rng):  # noqa: F811
    s = ServerProcess(perturbed_model_dir, "--max-model-len", "1024", device="cuda").start(timeout=600)
    try:
        idle = s.metrics()
        prompts = [rng.integers(0, 5000, int(rng.integers(3, 200))).tolist() for _ in range(32)]
        body = dict(max_tokens=32, ignore_eos=True, temperature=0.0)
        alone, ties = [], []
        for p in prompts:
            r = http().post(s.url + "/v1/completions", json={"prompt": p, "logprobs": 5, **body}, timeout=120)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            alone.append(choice["text"])
            ties.append(first_near_tie(choice["logprobs"]))
        assert len(set(alone)) > 16

        async def all_at_once():
            async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=None)) as c:
                return await asyncio.gather(*[stream_text(c, s.url, {"prompt": prompts[i % 32], **body})
                                              for i in range(256)])

        results = asyncio.run(all_at_once())
        assert all(finish == "length" for _, finish, _ in results)
        diverged = [i for i, (text, _, _) in enumerate(results) if text != alone[i % 32]
                    and (ties[i % 32] is None or text[:ties[i % 32]] != alone[i % 32][:ties[i % 32]])]
        assert not diverged, f"{len(diverged)} of 256 streams differ from their request alone before any near-tie"
        m = s.metrics()
        assert m["xserv_num_requests_running"] == 0 and m["xserv_num_requests_waiting"] == 0
        assert m["xserv_kv_blocks_free"] == idle["xserv_kv_blocks_free"]
    finally:
        s.stop()
