"""The environment variables a user may set, in one place: each with its type, default and one line of help, parsed
and validated here (a bad value raises ValueError naming the variable and what it accepts). The rest of xserv reads
them through this module and never through os.environ, so README's table (tests/test_settings.py checks it against
SETTINGS) is the whole list.

    from xserv import settings
    settings.FP8_ACTIVATIONS.get()          # "e4m3" or "bf16"
    settings.FP8_ACTIVATIONS.get(environ)   # from a mapping of your own (tests)

A value is read when asked for, not at import, so a variable set before the first use of what it steers takes
effect (a test's monkeypatch.setenv too). Variables that steered experiments whose question is decided are retired
(RETIRED): one set is ignored, with a one-time warning saying what always runs now.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("xserv")


@dataclass(frozen=True)
class Setting:
    name: str
    type: type  # str, int, bool or Path
    default: object  # None: unset means "not given" (e.g. XSERV_ARCH: the GPU's own)
    help: str  # one line, README's table shows it
    choices: tuple[str, ...] = ()  # str settings with a closed set of values (compared stripped and lower-cased)
    bounds: tuple[int, int] | None = None  # int settings: inclusive range

    def get(self, environ: Mapping[str, str] | None = None):
        env = os.environ if environ is None else environ
        if environ is None and not _process_env_checked:  # once: some settings are read on every eager launch
            _warn_retired(env)
        raw = env.get(self.name)
        if raw is None or not raw.strip():
            return self.default() if callable(self.default) else self.default
        return self.parse(raw)

    def parse(self, raw: str):
        value = raw.strip()
        if self.type is bool:
            if value.lower() in ("1", "true", "yes", "on"):
                return True
            if value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(f"{self.name}={raw!r}: expected 1 or 0")
        if self.type is int:
            try:
                number = int(value)
            except ValueError:
                raise ValueError(f"{self.name}={raw!r}: expected an integer") from None
            if self.bounds and not self.bounds[0] <= number <= self.bounds[1]:
                raise ValueError(f"{self.name}={number}: expected {self.bounds[0]} to {self.bounds[1]}")
            return number
        if self.type is Path:
            return Path(value).expanduser()
        if self.choices:
            value = value.lower()
            if value not in self.choices:
                raise ValueError(f"{self.name}={raw!r}: expected one of {', '.join(self.choices)}"
                                 + (f" (default {self.default})" if self.default is not None else ""))
        return value


def _default_cache_dir() -> Path:
    return Path.home() / ".cache" / "xserv"


CACHE_DIR = Setting(
    "XSERV_CACHE_DIR", Path, _default_cache_dir,
    "where compiled kernels (`cubin/`) and the bundled tiny model (`models/`) are kept; default `~/.cache/xserv`")
API_KEY = Setting(
    "XSERV_API_KEY", str, None,
    "the default of `xserv serve --api-key` and `xserv bench serve --api-key` (keeps the key out of `ps`)")
ARCH = Setting(
    "XSERV_ARCH", str, None,
    "force a lower kernel path on the GPU at hand, e.g. `sm_80` on an H100 (the portable kernels, compiled as for "
    "that arch, launches planned within that arch's shared memory); unset: the GPU's own. An unknown arch or one "
    "newer than the GPU is refused with a clear error ([docs/runtime.md](docs/runtime.md))")
FP8_ACTIVATIONS = Setting(
    "XSERV_FP8_ACTIVATIONS", str, "e4m3",
    "FP8 checkpoints: `bf16` keeps activations in bf16 for prompts and large batches (weight-only: the FP8 weights "
    "dequantized for the bf16 GEMM) instead of quantizing them to e4m3 per 128 columns (`e4m3`, the default on H100 "
    "and newer: faster prefill, but e4m3's rounding moves the logits more)",
    choices=("e4m3", "bf16"))
FP8_EXPERTS = Setting(
    "XSERV_FP8_EXPERTS", str, "bf16",
    "FP8 mixture-of-experts checkpoints (e.g. Qwen3-30B-A3B-FP8): `e4m3` keeps the whole checkpoint in FP8 on one "
    "GPU, experts and attention projections (half the experts' memory: ~31 instead of ~61 GB for the 30B-A3B) "
    "instead of dequantizing it to bf16 at load (`bf16`, the default: as fast as the bf16 checkpoint; all FP8 "
    "measured a few % slower); the experts give the same bits either way. Needs hidden and expert sizes that are "
    "multiples of 128 (every Qwen3-MoE)",
    choices=("bf16", "e4m3"))
TP_ALLREDUCE = Setting(
    "XSERV_TP_ALLREDUCE", str, "auto",
    "at `tensor_parallel_size` > 1: `auto` (the default) a one-shot kernel over CUDA peer memory for messages up to "
    "`XSERV_TP_IPC_MAX_BYTES` where every GPU pair has peer access, NCCL above; `nccl` NCCL for every all-reduce "
    "(which also means no decode step is launched ahead at tp > 1: slower batch-1 decode)",
    choices=("auto", "nccl"))
TP_IPC_MAX_BYTES = Setting(
    "XSERV_TP_IPC_MAX_BYTES", int, 64 << 10,
    "the largest all-reduce message (bytes) the peer-memory kernel takes at tp > 1; default 65536 (decode steps of "
    "up to 8 rows at the 8B / 32B widths)",
    bounds=(16, 16 << 20))
GEMM_AUTOTUNE = Setting(
    "XSERV_GEMM_AUTOTUNE", bool, True,
    "`0` skips timing cuBLASLt's candidates for small matrix products on first use (slightly faster start, maybe "
    "slower decode); default `1`")

SETTINGS: tuple[Setting, ...] = (CACHE_DIR, API_KEY, ARCH, FP8_ACTIVATIONS, FP8_EXPERTS, TP_ALLREDUCE,
                                 TP_IPC_MAX_BYTES, GEMM_AUTOTUNE)

# Variables that chose between forms of a kernel for measurement; the measurements decided (docs/kernels/moe.md,
# docs/engine.md) and only the winner remains. name -> what always runs now.
RETIRED: dict[str, str] = {
    "XSERV_MOE_FUSE_COMBINE": "the one-token MoE step always combines inside its down GEMM",
    "XSERV_MOE_DOWN_TRIGGER": "the one-token MoE down GEMM always releases the next launch when it ends (late)",
    "XSERV_TP_IPC_TRIGGER": "the all-reduce kernel always releases the next launch right after its wait (early); "
                            "XSERV_TP_ALLREDUCE=nccl is the way to leave it out",
}
_warned: set[str] = set()
_process_env_checked = False


def _warn_retired(environ: Mapping[str, str]) -> None:
    global _process_env_checked
    if environ is os.environ:
        _process_env_checked = True
    for name, now in RETIRED.items():
        if name in environ and name not in _warned:
            _warned.add(name)
            log.warning("%s is set but no longer exists and is ignored: %s.", name, now)


def check_environment(environ: Mapping[str, str] | None = None) -> dict[str, object]:
    """Every setting's value (validated: the first bad one raises); warns once about retired variables that are set."""
    env = os.environ if environ is None else environ
    _warn_retired(env)
    return {s.name: s.get(env) for s in SETTINGS}


__all__ = ["RETIRED", "SETTINGS", "Setting", "check_environment", *[
    "CACHE_DIR", "API_KEY", "ARCH", "FP8_ACTIVATIONS", "FP8_EXPERTS", "TP_ALLREDUCE", "TP_IPC_MAX_BYTES",
    "GEMM_AUTOTUNE"]]
