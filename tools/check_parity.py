"""Parity of xserv's CUDA backend with Hugging Face transformers on one checkpoint folder (GPU machine), for any
registered architecture (Qwen3ForCausalLM, LlamaForCausalLM, Qwen3MoeForCausalLM).

    python -m tools.check_parity --model DIR [--prompt-len 1000 --decode-steps 64]

0. RoPE: xserv's inverse frequencies (rope scaling included) against the transformers model's rotary embedding.
1. transformers bf16, greedy from a random prompt: the reference tokens and each step's top-2 margin.
2. xserv (CUDA): logits at every prompt position (llm.logits), then decode steps through the engine's model
   runner (eager forward, decode attention kernel) fed the reference tokens, recording each step's logits and
   argmax.
3. transformers float32 on prompt + reference tokens: logits at every position.
Reports relative L2 error per position (max and mean) for the prompt and the decode steps, transformers' own bf16
prompt logits against the same float32 run beside them (and the ratio: is xserv as close as transformers' bf16 run
is?), the worst positions of each, and whether xserv's greedy token equals transformers' bf16 one at every step
whose top-2 margin exceeds --margin. Exit status 1 when an error exceeds --tol or a confident token differs. With
--peer-factor F the bar is transformers bf16's own instead: xserv's max and mean errors (prompt and decode) at most
F x the peer's max and mean on the prompt, each bar at least --peer-floor (a mixture of experts: a routing near-tie
sends a position to other experts in any bf16 run, so a few positions differ from float32 in both; tests/
test_moe_parity_gpu.py holds the MoE variants to F = 1.5).
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def rel_err_rows(out, ref) -> np.ndarray:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return np.linalg.norm(out - ref, axis=-1) / np.linalg.norm(ref, axis=-1)


def hf_model(folder, dtype):
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    except TypeError:  # transformers < 4.56 knows only torch_dtype
        model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=dtype)
    return model.cuda().eval()


def rope_inv_freq_error(model, config) -> float:
    """Largest relative difference between transformers' rotary inverse frequencies (and attention scaling) and
    xserv's, whose table the model uses."""
    from xserv.ops.rope import rope_inv_freq

    rotary = getattr(model.model, "rotary_emb", None)
    if rotary is None:  # some transformers versions keep it per attention layer
        rotary = next(m for m in model.modules() if hasattr(m, "inv_freq"))
    theirs = rotary.inv_freq.float().cpu().numpy().astype(np.float64) * float(getattr(rotary, "attention_scaling", 1.0))
    inv, factor = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    ours = inv.astype(np.float64) * factor
    return float(np.max(np.abs(ours - theirs) / np.abs(theirs)))


def hf_greedy_bf16(folder, prompt, steps):
    import torch

    model = hf_model(folder, torch.bfloat16)
    tokens, margins = [], []
    with torch.no_grad():
        ids = torch.tensor([prompt], device="cuda")
        out = model(ids, use_cache=True)
        prompt_logits = out.logits[0].float().cpu().numpy()  # the peer's own error against float32, for scale
        past = out.past_key_values
        for _ in range(steps):
            last = out.logits[0, -1].float()
            top2 = torch.topk(last, 2).values
            tok = int(torch.argmax(last))
            tokens.append(tok)
            margins.append(float(top2[0] - top2[1]))
            out = model(torch.tensor([[tok]], device="cuda"), past_key_values=past, use_cache=True)
            past = out.past_key_values
    del model, out, past
    return tokens, np.array(margins), prompt_logits


def hf_logits_fp32(folder, ids, config):
    import torch

    model = hf_model(folder, torch.float32)
    rope_err = rope_inv_freq_error(model, config)
    with torch.no_grad():
        logits = model(torch.tensor([ids], device="cuda")).logits[0].float().cpu().numpy()
    del model
    return logits, rope_err


def xserv_logits(folder, prompt, forced):
    from xserv import LLM
    from xserv.engine.batch import SeqChunk

    total = len(prompt) + len(forced)
    llm = LLM(folder, device="cuda", max_model_len=total + 16, kv_cache_tokens=total + 256, cuda_graphs=False,
              max_num_seqs=8)
    t0 = time.perf_counter()
    prefill = llm.logits(prompt)
    t_prefill = time.perf_counter() - t0
    # decode steps one token at a time through the runner's eager forward (the decode attention kernel), into
    # blocks borrowed from the engine's pool
    runner, blocks = llm.runner, llm.engine.blocks
    table = blocks.allocate(blocks.blocks_for(total))
    runner.forward([SeqChunk(prompt, 0, table, "none")])
    decode, argmax = [], []
    for i, tok in enumerate(forced):
        row = runner.forward([SeqChunk([tok], len(prompt) + i, table, "last")]).numpy()[0].copy()
        decode.append(row)
        argmax.append(int(np.argmax(row)))
    blocks.free(table)
    del llm, runner, blocks
    gc.collect()
    from xserv.runtime import empty_cache

    empty_cache()
    return prefill, np.stack(decode), argmax, t_prefill


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a checkpoint folder of a registered architecture")
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tol", type=float, default=2e-2, help="largest allowed relative L2 error per position")
    ap.add_argument("--margin", type=float, default=0.1, help="top-2 logit margin above which tokens must agree")
    ap.add_argument("--peer-factor", type=float, default=None, metavar="F",
                    help="the bar is F x transformers bf16's own max and mean error on the prompt (e.g. 1.5) "
                         "instead of --tol")
    ap.add_argument("--peer-floor", type=float, default=1e-2, help="the least --peer-factor bar (default 1e-2)")
    ap.add_argument("--worst", type=int, default=5, help="positions listed with the largest errors (default 5)")
    args = ap.parse_args(argv)

    import torch

    from xserv.models.registry import config_from_pretrained
    from xserv.runtime import get_device

    folder = str(Path(args.model).expanduser())
    config = config_from_pretrained(folder)
    rng = np.random.default_rng(args.seed)
    prompt = rng.integers(0, min(config.vocab_size, 151643), args.prompt_len).tolist()
    print(f"device: {get_device().name} (torch sees {torch.cuda.get_device_name()})")
    print(f"model: {folder}  {config.ARCHITECTURE} layers={config.num_hidden_layers} hidden={config.hidden_size} "
          f"heads={config.num_attention_heads}/{config.num_key_value_heads} head_dim={config.head_dim} "
          f"vocab={config.vocab_size} rope_scaling={config.rope_scaling}")
    if getattr(config, "num_experts", 0):
        sparse = getattr(config, "sparse_layers", None)
        print(f"  mixture of experts: {config.num_experts_per_tok} of {config.num_experts} experts per token, width "
              f"{config.moe_intermediate_size}, norm_topk_prob={config.norm_topk_prob}, decoder_sparse_step="
              f"{config.decoder_sparse_step}, mlp_only_layers={list(config.mlp_only_layers)}"
              + (f", sparse layers {len(sparse)} of {config.num_hidden_layers}" if sparse is not None else ""))

    t = time.perf_counter()
    ref_tokens, margins, hf_bf16_prompt = hf_greedy_bf16(folder, prompt, args.decode_steps)
    gc.collect()
    torch.cuda.empty_cache()
    print(f"transformers bf16 greedy: {args.decode_steps} steps in {time.perf_counter() - t:.1f}s")

    prefill, decode, xs_argmax, t_prefill = xserv_logits(folder, prompt, ref_tokens)
    print(f"xserv: prompt logits in {t_prefill:.2f}s")

    ref, rope_err = hf_logits_fp32(folder, prompt + ref_tokens, config)
    print(f"RoPE inverse frequencies x attention scaling, max relative difference to transformers: {rope_err:.2e}")
    gc.collect()
    torch.cuda.empty_cache()
    err_prefill = rel_err_rows(prefill, ref[:len(prompt)])
    err_decode = rel_err_rows(decode, ref[len(prompt):])
    err_hf_bf16 = rel_err_rows(hf_bf16_prompt, ref[:len(prompt)])

    # xserv's greedy choice for step 0 comes from the last prompt position; for step i > 0 from the decode step fed
    # reference token i-1 (decode row i-1). transformers' float32 logits are aligned the same way.
    xs_tokens = np.array([int(np.argmax(prefill[-1]))] + xs_argmax[:-1])
    ref_steps = ref[len(prompt) - 1:len(prompt) - 1 + len(ref_tokens)]
    confident = margins > args.margin
    agree = xs_tokens == np.array(ref_tokens)
    bad_steps = np.nonzero(confident & ~agree)[0].tolist()
    print()
    print(f"{'what':<28}{'positions':>10}{'max rel err':>14}{'mean rel err':>14}{'worst at':>10}")
    for name, err, offset in (("prompt logits (llm.logits)", err_prefill, 0),
                              ("decode-step logits", err_decode, len(prompt)),
                              ("(peer) transformers bf16", err_hf_bf16, 0)):
        print(f"{name:<28}{len(err):>10}{err.max():>14.3e}{err.mean():>14.3e}{int(err.argmax()) + offset:>10}")
    ratio_max, ratio_mean = err_prefill.max() / err_hf_bf16.max(), err_prefill.mean() / err_hf_bf16.mean()
    print(f"xserv / transformers bf16 on the prompt: max {ratio_max:.2f}x, mean {ratio_mean:.2f}x")
    for name, err in (("xserv prompt", err_prefill), ("transformers bf16 prompt", err_hf_bf16)):
        worst = np.argsort(err)[::-1][:args.worst]
        print(f"  worst positions, {name}: " + ", ".join(f"{int(i)} ({err[i]:.2e})" for i in worst)
              + f"; positions above {args.tol}: {int((err > args.tol).sum())}")
    both = int(((err_prefill > args.tol) & (err_hf_bf16 > args.tol)).sum())
    print(f"  positions above {args.tol} in both runs: {both}")
    print(f"greedy tokens vs transformers bf16: {int(confident.sum())} steps with top-2 margin > {args.margin}, "
          f"{int((confident & agree).sum())} agree; all steps: {int(agree.sum())}/{len(agree)} agree")
    # transformers' bf16 margins are read off bf16 logits (one bf16 step is 0.125 for logits in [16, 32)), so a
    # "confident" bf16 decision can be a near-tie in exact arithmetic: the float32 run says which side is right.
    fp32_top = np.argmax(ref_steps, axis=-1)
    fp32_sorted = np.sort(ref_steps, axis=-1)
    fp32_margin = fp32_sorted[:, -1] - fp32_sorted[:, -2]
    print(f"argmax vs transformers float32: xserv {int((xs_tokens == fp32_top).sum())}/{len(agree)}, "
          f"transformers bf16 {int((np.array(ref_tokens) == fp32_top).sum())}/{len(agree)}")
    if bad_steps:
        print("  confident disagreements at steps " + ", ".join(
            f"{s} (xserv {xs_tokens[s]}, hf {ref_tokens[s]}, hf bf16 margin {margins[s]:.3f}; float32 picks "
            f"{fp32_top[s]} by {fp32_margin[s]:.3f})" for s in bad_steps))
    tol_max, tol_mean = args.tol, float("inf")  # the mean is at most the max: --tol bounds both
    if args.peer_factor is not None:
        tol_max = max(args.peer_floor, args.peer_factor * err_hf_bf16.max())
        tol_mean = max(args.peer_floor, args.peer_factor * err_hf_bf16.mean())
    ok = (err_prefill.max() <= tol_max and err_decode.max() <= tol_max and err_prefill.mean() <= tol_mean
          and err_decode.mean() <= tol_mean and not bad_steps and rope_err < 1e-6)
    if args.peer_factor is None:
        print("PASS" if ok else "FAIL", f"(tolerance {args.tol})")
    else:
        print("PASS" if ok else "FAIL", f"(max error <= {tol_max:.3e}, mean <= {tol_mean:.3e}: {args.peer_factor} x "
              f"transformers bf16's own, at least {args.peer_floor})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
