"""Tensor-parallel decode benchmarks on two GPUs (`bash tools/gpu.sh tp` runs them): the NCCL all-reduce of one
decode row, 8B-shaped batch-1 decode at TP=1 and TP=2, 32B-shaped at TP=2, and (`variants`) TP=2 with and without
decode steps launched ahead, in one process. The checkpoints are DIR/8b and DIR/32b (`xserv make-test-model --preset 8b --out DIR/8b`).

    python -m tools.bench_tp [--models DIR] [8b] [32b] [variants]      (DIR: /dev/shm/xserv-models)
"""
import sys, time
import numpy as np


def allreduce_rank(rank, uid, hidden, calls, q):
    from xserv.parallel.worker import _bind_device
    _bind_device(rank)
    from xserv.parallel.comm import NcclCommunicator
    from xserv.runtime import get_device, synchronize
    from xserv.runtime.graphs import CUDAGraph
    from xserv.runtime.timing import EventTimer
    from xserv.tensor import Tensor, bfloat16
    comm = NcclCommunicator(uid, rank, 2, 8, 16)
    x = Tensor.zeros((1, hidden), bfloat16, "cuda")
    for _ in range(50):
        comm.all_reduce(x)
    synchronize()
    timer = EventTimer()
    eager = min(timer.time_ms(lambda: [comm.all_reduce(x) for _ in range(calls)], 1) for _ in range(3)) / calls
    g = CUDAGraph()
    with g.capture():
        for _ in range(calls):
            comm.all_reduce(x)
    synchronize()
    g.replay(); synchronize()
    graphed = min(timer.time_ms(g.replay, 1) for _ in range(3)) / calls
    q.put((rank, eager * 1e3, graphed * 1e3))
    g.close(); comm.close()


def allreduce_us(hidden, calls=200):
    import multiprocessing as mp
    from xserv.parallel.comm import nccl_unique_id
    ctx = mp.get_context("spawn")
    uid, q = nccl_unique_id(), ctx.Queue()
    ps = [ctx.Process(target=allreduce_rank, args=(r, uid, hidden, calls, q)) for r in range(2)]
    [p.start() for p in ps]
    res = sorted(q.get(timeout=300) for _ in ps)
    [p.join(60) for p in ps]
    return max(r[1] for r in res), max(r[2] for r in res)


def decode(model, tp, context=512, steps=128, warmup=16, **options):
    from xserv import LLM, SamplingParams
    from xserv.bench.common import kv_bytes_per_token
    from xserv.runtime import synchronize
    max_len = context + warmup + steps + 8
    llm = LLM(model, device="cuda", max_model_len=max_len, max_num_seqs=1, kv_cache_tokens=max_len + 1024,
              tensor_parallel_size=tp, progress=False, **options)
    try:
        eng = llm.engine
        rng = np.random.default_rng(0)
        seq = eng.add_request(rng.integers(0, 150000, context).tolist(),
                              SamplingParams(temperature=0.0, max_tokens=warmup + steps + 1, ignore_eos=True))
        while seq.num_computed < len(seq.token_ids) - 1 or seq.num_output_tokens == 0:
            eng.step()
        for _ in range(warmup):
            eng.step()
        synchronize()
        t = time.perf_counter()
        for _ in range(steps):
            eng.step()
        synchronize()
        dt = (time.perf_counter() - t) / steps
        eng.abort(seq)
        m = llm.model  # rank 0's shard: per-GPU weights
        step_bytes = m.weight_bytes() + (context + warmup + steps // 2) * kv_bytes_per_token(m.config)
        return (dt, step_bytes, m.config.num_hidden_layers, m.config.hidden_size, bool(eng.runner.graphs),
                eng.num_steps_ahead)
    finally:
        llm.close()


def main():
    from pathlib import Path
    from xserv.bench.common import measure_ceilings
    from xserv.runtime import get_device
    args = sys.argv[1:]
    models = Path("/dev/shm/xserv-models")
    if "--models" in args:
        i = args.index("--models")
        models = Path(args[i + 1])
        del args[i:i + 2]
    stages = args
    for preset in ("8b", "32b"):
        wanted = preset in stages or (preset == "8b" and "variants" in stages)
        if wanted and not (models / preset / "config.json").exists():
            raise SystemExit(f"no checkpoint at {models / preset}: `xserv make-test-model --preset {preset} --out "
                             f"{models / preset}` makes one")
    m8, m32 = str(models / "8b"), str(models / "32b")
    print(f"device: {get_device().name} x2")
    ceil = measure_ceilings()
    bw = ceil["copy_bytes_per_s"]
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s (read + write, one GPU)")
    ar = {h: allreduce_us(h) for h in (4096, 5120)}
    for h, (e, g) in ar.items():
        from xserv import settings
        path = "NCCL" if settings.TP_ALLREDUCE.get() == "nccl" else "IPC one-shot (<= 64 KB)"
        print(f"{path} all-reduce [1, {h}] bf16, 2 ranks: {e:.1f} us eager, {g:.1f} us inside a CUDA graph")
    if "8b" in stages:
        r1 = decode(m8, 1)
        r2 = decode(m8, 2)
        for tp, (dt, b, L, H, graphs, _) in ((1, r1), (2, r2)):
            print(f"8B-shaped batch-1 decode, context 512, TP={tp}: {dt * 1e3:.3f} ms/step, {1 / dt:.1f} tok/s; "
                  f"roofline {b / bw * 1e3:.3f} ms ({b / bw / dt:.0%} of it); decode graphs {'on' if graphs else 'OFF'}")
        print(f"8B TP=2 / TP=1 speed-up: {r1[0] / r2[0]:.2f}x (goal >= 1.5x); all-reduces per step {2 * r2[2] + 1} "
              f"x {ar[4096][1]:.1f} us = {(2 * r2[2] + 1) * ar[4096][1] / 1e3:.3f} ms")
    if "variants" in stages:  # launch-ahead at tp > 1, same process
        base = r1[0] if "8b" in stages else decode(m8, 1)[0]
        for label, options in (("launch-ahead (default)", {}), ("no launch-ahead", {"overlap_steps": False})):
            dt, *_, ahead = decode(m8, 2, **options)
            print(f"8B TP=2, {label}: {dt * 1e3:.3f} ms/step, {1 / dt:.1f} tok/s, {base / dt:.2f}x TP=1 "
                  f"({1 / base:.1f} tok/s); steps launched ahead: {ahead}")
    if "32b" in stages:
        dt, b, L, H, graphs, _ = decode(m32, 2)
        per = (2 * L + 1) * ar[5120][1] / 1e3
        print(f"32B-shaped batch-1 decode, context 512, TP=2: {dt * 1e3:.3f} ms/step, {1 / dt:.1f} tok/s; TP=2 "
              f"roofline (per-GPU weights + KV at copy bandwidth) {b / bw * 1e3:.3f} ms: {b / bw / dt:.0%} of it "
              f"(goal >= 75%); all-reduce per step {2 * L + 1} x {ar[5120][1]:.1f} us = {per:.3f} ms "
              f"({per / (dt * 1e3):.0%} of the step); decode graphs {'on' if graphs else 'OFF'}")


if __name__ == "__main__":
    main()
