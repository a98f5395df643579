"""One LLM shared by many threads, its life cycle (close, `with`, garbage collection) and unseeded sampling.

CPU tests run the tiny model on the NumPy backend. A request run beside other threads' requests is a batch shape
away from its sequential run, which a BLAS may round differently: each thread's output must equal its sequential
run up to that rounding (tests/batch_shape.py: tokens and text up to a first difference at a near tie, or for a
seeded request at a draw that close, and from there on each token its own context's choice); what a stream yields
must equal its own final text exactly. The GPU tests allow what the server tests allow: greedy tokens
equal up to the sequential run's first near tie, and they check that a closed LLM gives its device memory back.
"""
import _thread
import gc
import signal
import threading
import time
import weakref

import numpy as np
import pytest

from batch_shape import assert_same_runs
from qwen3_reference import tiny_model_dir  # noqa: F401
from xserv import LLM, SamplingParams
from xserv.engine.config import EngineConfig
from xserv.llm import LLMClosed
from xserv.testing import agree_until_near_tie

PROMPTS = ["Hello", "The sky is", "1 2 3 4", "Once upon a time", "Paris is", "def f(x):", "Bonjour", "A B C"]


def _requests(i: int) -> list[tuple[str, str, SamplingParams]]:
    """Thread i's calls: (kind, prompt, params), greedy, seeded and streaming mixed.

    A seeded request's draws are keyed by its seed and position, not by the batch, but a draw whose Gumbel-max
    winner leads by less than a rounding may move, or whose token sits at the edge of the top-p set, may flip between
    batch shapes like a greedy near tie: so it is held to its sequential run up to a first difference at such a
    close draw, and from there on to the draws its own context's logits make (tests/batch_shape.py)."""
    prompt = PROMPTS[i % len(PROMPTS)]
    greedy = SamplingParams(temperature=0.0, max_tokens=6 + i % 4, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=6, seed=1000 + i, ignore_eos=True)
    return [("generate", prompt, greedy), ("stream", PROMPTS[(i + 3) % len(PROMPTS)], seeded),
            ("generate", prompt + " and", seeded), ("stream", prompt, greedy)]


def _run(llm: LLM, kind: str, prompt: str, params: SamplingParams):
    """The request's RequestOutput; a stream's deltas must make up its own text, exactly (one run, one rounding)."""
    if kind == "stream":
        stream = llm.stream(prompt, params)
        text = "".join(stream)
        assert text == stream.output.text, "the streamed text is not the request's text"
        return stream.output
    return llm.generate(prompt, params)[0]


def _in_threads(fn, n: int, timeout: float = 120.0) -> list:
    """fn(i) on n threads started together; their results (or the exception each raised), none left running."""
    results: list = [None] * n
    start = threading.Barrier(n)

    def body(i):
        start.wait()
        try:
            results[i] = fn(i)
        except BaseException as e:  # noqa: BLE001 - reported by the caller's assertions
            results[i] = e

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a thread hung"
    return results


def _wait_idle(llm: LLM, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = llm.engine.stats()
        if stats["num_running"] == 0 and stats["num_waiting"] == 0:
            break
        time.sleep(0.01)
    stats = llm.engine.stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0, stats


@pytest.fixture(scope="module")
def llm(tiny_model_dir):  # noqa: F811
    with LLM(str(tiny_model_dir), device="cpu", max_model_len=512, progress=False) as llm:
        yield llm


@pytest.mark.timeout(240)
def test_eight_threads_equal_their_sequential_runs(llm):
    sequential = [[_run(llm, *r) for r in _requests(i)] for i in range(8)]
    steps_before = llm.engine.host_seconds["book"]
    concurrent = _in_threads(lambda i: [_run(llm, *r) for r in _requests(i)], 8)
    for i, (want, got) in enumerate(zip(sequential, concurrent)):
        assert not isinstance(got, BaseException), f"thread {i} raised {got!r}"
        assert_same_runs(got, want, [params for _, _, params in _requests(i)], llm, f"thread {i}")
    assert llm.engine.host_seconds["book"] > steps_before
    _wait_idle(llm)
    assert llm.engine.blocks.num_free == llm.kv_cache.num_blocks


@pytest.mark.timeout(120)
def test_threads_share_steps(llm):
    """The calls of different threads run in the same engine steps (batched), not one after another."""
    seen = []

    def on_step(results):
        seen.append(llm.engine.stats()["num_running"])

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    _in_threads(lambda i: llm.generate(PROMPTS[i], params, on_step=on_step if i == 0 else None), 4)
    assert max(seen) >= 2, f"thread 0's steps never ran beside another thread's request: {seen}"


def test_on_step_runs_once_per_step_for_a_whole_call(llm):
    """generate(on_step=...) with several prompts: one call per engine step with every row of the call (the
    throughput benchmark counts steps and tokens this way)."""
    calls = []
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (6, 9, 12)]
    outs = llm.generate(PROMPTS[:3], params, on_step=lambda results: calls.append(len(results)))
    assert len(calls) == 12 and sum(calls) == sum(len(o.token_ids) for o in outs) == 27, calls


@pytest.mark.timeout(120)
def test_keyboard_interrupt_aborts_only_its_caller(llm):
    others = [_run(llm, *_requests(i)[0]) for i in range(3)]  # alone
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    started = threading.Event()
    results: list = [None] * 3

    def other(i):
        started.wait(30)
        results[i] = _run(llm, *_requests(i)[0])

    threads = [threading.Thread(target=other, args=(i,), daemon=True) for i in range(3)]
    for t in threads:
        t.start()

    def on_step(_):
        if not started.is_set():
            started.set()
            threading.Timer(0.05, _thread.interrupt_main).start()

    # interrupt_main raises KeyboardInterrupt only through Python's own SIGINT handler: make sure it is the one in
    # place (a pytest-xdist worker may hold another after an earlier test file's event loop: this test once failed
    # in CI with "DID NOT RAISE")
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate("Hello", long, on_step=on_step)
            time.sleep(30)  # never reached when the interrupt lands in generate(); fails the test through the timeout
    finally:
        signal.signal(signal.SIGINT, previous)
    for t in threads:
        t.join(60)
    assert_same_runs(results, others, [_requests(i)[0][2] for i in range(3)], llm, "beside the interrupted call")
    _wait_idle(llm)
    assert llm.engine.blocks.num_free == llm.kv_cache.num_blocks


class _CtrlC:
    """Ctrl-C while the main thread waits on the engine, at a known point of a request too long to finish meanwhile.

    Every engine step takes STEP_S more (a slow model: the 400-token request below needs 400 x STEP_S = 40 s, far
    past the 5 s the tests wait for the engine to go idle), and at the step that brings the request's output to
    AT_TOKENS tokens SIGINT goes to the main thread, before the step's tokens are handed over: the caller is then
    waiting (in a timed lock wait, which a real signal interrupts at once), not reading an update. The engine thread
    then sleeps GRACE_S, time for the caller's abort to reach its queue before it would start another step."""
    STEP_S, GRACE_S, AT_TOKENS = 0.1, 0.3, 3
    PARAMS = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    def __init__(self, llm):
        if threading.current_thread() is not threading.main_thread():
            pytest.skip("signals reach the main thread only, and the test does not run on it")
        self.llm, self.engine = llm, llm.engine
        self.seq = None
        self.tokens_at_signal = None

    def step(self):
        results = self.real_step()
        time.sleep(self.STEP_S)
        if self.seq is None and results:
            self.seq = results[0][0]
        if self.tokens_at_signal is None and self.seq is not None and self.seq.num_output_tokens >= self.AT_TOKENS:
            self.tokens_at_signal = self.seq.num_output_tokens
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            time.sleep(self.GRACE_S)
        return results

    def __enter__(self):
        # KeyboardInterrupt comes from Python's own SIGINT handler: make sure it is the one in place (a
        # pytest-xdist worker may hold another after an earlier test file's event loop)
        self.previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        self.real_step = self.engine.step
        self.engine.step = self.step  # the engine thread looks the method up at every step
        return self

    def __exit__(self, *exc):
        del self.engine.step
        signal.signal(signal.SIGINT, self.previous)
        self.llm.engine_thread.abort_all()  # leave the module's LLM idle for the next test, pass or fail
        _wait_idle(self.llm, timeout=60)

    def check_aborted(self):
        """Right after the interrupt: the engine idle (within 5 s, where the request would need 40 s more), the
        request ended as aborted, every KV block free, and the output no longer than at the signal, give or take
        the one step that may have begun before the abort reached the engine thread's queue (on a loaded machine
        GRACE_S may not be enough): the step in flight when a caller is interrupted always completes, no later one
        starts."""
        _wait_idle(self.llm, timeout=5.0)
        seq = self.seq
        assert self.tokens_at_signal is not None and seq is not None
        assert seq.is_finished and seq.output().finish_reason == "abort", seq.output().finish_reason
        assert self.llm.engine.blocks.num_free == self.llm.kv_cache.num_blocks
        tokens = seq.num_output_tokens
        assert tokens <= self.tokens_at_signal + 1, (tokens, self.tokens_at_signal)
        time.sleep(3 * self.STEP_S)
        assert seq.num_output_tokens == tokens


@pytest.mark.timeout(120)
def test_keyboard_interrupt_in_generate_aborts_at_once(llm):
    """Ctrl-C while generate() waits: its request is aborted right away (engine idle, KV blocks back, no token after
    the interrupt but the step in flight). Red when generate() aborts its requests on `Exception` only (a
    KeyboardInterrupt is a BaseException): the request then runs on to its 400 tokens behind the caller's back."""
    with _CtrlC(llm) as ctrl_c:
        with pytest.raises(KeyboardInterrupt):
            llm.generate("Hello", ctrl_c.PARAMS)
        ctrl_c.check_aborted()
    assert llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=4))[0].token_ids  # still serves


@pytest.mark.timeout(120)
def test_keyboard_interrupt_while_reading_a_stream_aborts_at_once(llm):
    """Ctrl-C while a caller waits for a TextStream's next delta: its request is aborted the same way. Red when
    TextStream.__next__ aborts on `Exception` only: the stream object is still referenced (here by the test, in
    an application by the frame the interrupt unwinds through), so nothing else ends its request."""
    with _CtrlC(llm) as ctrl_c:
        stream = llm.stream("Hello", ctrl_c.PARAMS)
        deltas = []
        with pytest.raises(KeyboardInterrupt):
            for delta in stream:
                deltas.append(delta)
        ctrl_c.check_aborted()
        rest = list(stream)  # what had come before the abort, then the end (no wait for more)
        assert stream.output.finish_reason == "abort" and "".join(deltas + rest) == stream.output.text
    assert "".join(llm.stream("Hello", SamplingParams(temperature=0.0, max_tokens=4)))


@pytest.mark.timeout(60)
def test_exception_in_on_step_ends_only_that_call(llm):
    params = SamplingParams(temperature=0.0, max_tokens=20)
    want = llm.generate("The sky is", params)[0]

    def boom(_):
        raise RuntimeError("boom")

    def call(i):
        if i == 0:
            return llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=30), on_step=boom)
        return llm.generate("The sky is", params)[0]

    got = _in_threads(call, 3)
    assert isinstance(got[0], RuntimeError) and str(got[0]) == "boom"
    assert not any(isinstance(g, BaseException) for g in got[1:]), got
    assert_same_runs(got[1:], [want, want], params, llm, "beside the failing call")
    _wait_idle(llm)


@pytest.mark.timeout(60)
def test_a_call_from_on_step_is_refused_not_deadlocked(llm):
    def reenter(_):
        llm.logits([1, 2])

    with pytest.raises(RuntimeError, match="on_step"):
        llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=4), on_step=reenter)
    _wait_idle(llm)
    assert llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=4))[0].token_ids


@pytest.mark.timeout(60)
def test_logits_beside_running_requests(llm):
    ids = llm.tokenizer.encode("The capital of France is")
    alone = llm.logits(ids)
    got = _in_threads(lambda i: llm.logits(ids) if i % 2 else _run(llm, *_requests(i)[0]), 4)
    for i in (1, 3):  # a logits call is a forward of its own, the same shape as alone: the same bits
        np.testing.assert_array_equal(got[i], alone)
    first = _requests(0)[0]  # ran beside thread 2's request: a batch shape away from alone
    assert_same_runs([got[0]], [_run(llm, *first)], first[2], llm, "beside logits calls")


def test_closed_llm_raises_and_releases(tiny_model_dir):  # noqa: F811
    with LLM(str(tiny_model_dir), device="cpu", max_model_len=256, progress=False) as llm:
        llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=4))
        engine = weakref.ref(llm.engine)
        model = weakref.ref(llm.model)
        thread = llm._state.thread._thread
        assert thread.is_alive()
    assert llm.closed and not thread.is_alive()
    llm.close()  # idempotent
    gc.collect()
    assert engine() is None and model() is None, "the engine or model outlived close()"
    for use in (lambda: llm.generate("Hi"), lambda: llm.stream("Hi"), lambda: llm.logits([1, 2]),
                lambda: llm.engine):
        with pytest.raises(LLMClosed, match="closed"):
            use()


def test_cached_memory_goes_back_after_the_engine_is_unreachable(tiny_model_dir, monkeypatch):  # noqa: F811
    """The order that makes close() return device memory: by the time the allocator's cached blocks go back to the
    driver, nothing may hold the engine any more (else its buffers are still in use and nothing is freed; the GPU
    test measures the memory, this one pins the order on any machine)."""
    import xserv.llm as llm_module

    llm = LLM(str(tiny_model_dir), device="cpu", max_model_len=256, progress=False)
    llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=4))
    engine, model = weakref.ref(llm.engine), weakref.ref(llm.model)
    seen = []
    monkeypatch.setattr(llm_module, "_give_back_cached_memory", lambda: seen.append((engine(), model())))
    monkeypatch.setattr(llm_module, "_open_on_cuda", 1)
    llm._state.device = "cuda"  # as a GPU LLM is released (the engine itself stays on the CPU)
    llm.close()
    assert seen == [(None, None)], "the cached memory was given back while the engine or model was still reachable"


def test_dropped_llm_stops_its_thread(tiny_model_dir):  # noqa: F811
    llm = LLM(str(tiny_model_dir), device="cpu", max_model_len=256, progress=False)
    llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=4))
    thread = llm._state.thread._thread
    engine = weakref.ref(llm.engine)
    del llm
    gc.collect()
    thread.join(10)
    assert not thread.is_alive() and engine() is None


def test_unseeded_sampling_differs_between_runs_seeded_repeats(llm):
    """A fresh engine (a new process, a re-run cell) samples unseeded requests afresh; a seed repeats them; an
    engine-wide seed makes unseeded requests repeat across engines."""
    from engine_driver import generate
    from xserv.engine.llm_engine import LLMEngine

    def first_request(config: EngineConfig, params: SamplingParams) -> list[int]:
        config = config.replace(max_num_seqs=2)  # small sampler state: seven engines are made here
        engine = LLMEngine.from_model(llm.model, llm.tokenizer, config, context_len=256, eos_token_ids=[])
        return generate(engine, [llm.tokenizer.encode("Hello")], [params])[0].token_ids

    free = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    # 16 draws over a near-uniform 151k vocabulary: equal only by a miracle
    assert first_request(EngineConfig(), free) != first_request(EngineConfig(), free)
    seeded = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=7)
    assert first_request(EngineConfig(), seeded) == first_request(EngineConfig(), seeded)
    assert first_request(EngineConfig(seed=5), free) == first_request(EngineConfig(seed=5), free)
    assert llm.generate("Hello", seeded)[0].token_ids == first_request(EngineConfig(), seeded)


# ---- GPU ------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_cuda_threads_equal_sequential_up_to_near_ties(tiny_model_dir):  # noqa: F811
    with LLM(str(tiny_model_dir), device="cuda", max_model_len=1024, kv_cache_tokens=16384,
             progress=False) as llm:
        params = [SamplingParams(temperature=0.0, max_tokens=24 + i, ignore_eos=True, logprobs=2) for i in range(8)]
        alone = [llm.generate(PROMPTS[i], params[i])[0] for i in range(8)]
        streams = ["".join(llm.stream(PROMPTS[i], params[i])) for i in range(8)]
        assert streams == [o.text for o in alone]  # the same request in one process: exact

        def call(i):
            """(streamed text or None, the RequestOutput)"""
            if i % 2:
                stream = llm.stream(PROMPTS[i], params[i])
                text = "".join(stream)
                return text, stream.output
            return None, llm.generate(PROMPTS[i], params[i])[0]

        got = _in_threads(call, 8)
        for i, g in enumerate(got):
            assert not isinstance(g, BaseException), f"thread {i} raised {g!r}"
            text, out = g
            assert text is None or text == out.text, f"thread {i}: the streamed text is not the request's text"
            assert agree_until_near_tie(alone[i], out, 1e-2), f"thread {i}"
        _wait_idle(llm)
        assert llm.engine.blocks.num_free == llm.kv_cache.num_blocks


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_cuda_memory_comes_back_after_close(tiny_model_dir):  # noqa: F811
    """Five LLMs in a row in one process (closed, left by `with`, dropped): free memory after each is within 1% of
    what it was before it, and each gets the same KV cache from free memory. A first LLM goes before them: the
    first in a process also loads kernel modules and makes the cuBLAS handle, which stay for the process (their
    size is printed), so the KV cache it sizes from free memory may be a few blocks larger."""
    from xserv.runtime import get_device

    device = get_device()
    make = lambda: LLM(str(tiny_model_dir), device="cuda", max_model_len=1024, progress=False)  # noqa: E731
    params = SamplingParams(temperature=0.0, max_tokens=8)
    free_at_start = device.memory_info()[0]
    with make() as first:
        first_kv = first.kv_cache.num_tokens
        assert first.generate("Hello", params)[0].token_ids
    kept = free_at_start - device.memory_info()[0]
    sizes, report = [], []
    for i in range(5):
        free_before = device.memory_info()[0]
        if i == 4:
            llm = make()
            sizes.append(llm.kv_cache.num_tokens)
            held = device.memory_info()[0]
            assert llm.generate("Hello", params)[0].token_ids
            del llm
            gc.collect()
        else:
            with make() as llm:
                sizes.append(llm.kv_cache.num_tokens)
                held = device.memory_info()[0]
                assert llm.generate("Hello", params)[0].token_ids
                assert "".join(llm.stream("Hi", params))
        free_after = device.memory_info()[0]
        report.append((free_before >> 20, held >> 20, free_after >> 20))
        assert abs(free_after - free_before) <= 0.01 * free_before, report
        assert held < 0.5 * free_before, report  # the KV cache really took most of the memory while open
    print(f"\n{device.name}: the first LLM of the process kept {kept / 2**20:.1f} MiB (modules, cuBLAS) and sized "
          f"{first_kv} KV tokens; then free MiB before / while held / after, per LLM: {report}; KV tokens: {sizes}")
    assert len(set(sizes)) == 1, sizes


def test_chat_constraint_applies_after_the_think_block(llm):
    """LLM.chat with thinking on: the think block comes first (pushed through by logit_bias), the schema binds the
    answer after it, as the server does (the tiny model's output is noise: only the grammar makes the JSON)."""
    import json

    from xserv.structured import StructuredOutput

    think, end = (llm.tokenizer.token_to_id(t) for t in ("<think>", "</think>"))
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    params = SamplingParams(temperature=1.0, max_tokens=40, seed=3, structured=StructuredOutput.json_schema(schema),
                            logit_bias={think: 100.0, end: 100.0})
    out = llm.chat([{"role": "user", "content": "A digit?"}], params, enable_thinking=True)[0]
    assert out.token_ids[:2] == [think, end], out.token_ids[:4]
    answer = llm.tokenizer.decode(out.token_ids[2:], skip_special_tokens=True).strip()
    assert 0 <= json.loads(answer)["n"] <= 9 and out.finish_reason == "stop", answer
