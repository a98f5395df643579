"""xserv/settings.py: the environment variables a user may set, parsed and validated in one place, README's table in
step with them, and no other module of the package reading os.environ."""
from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from xserv import settings

ROOT = Path(__file__).resolve().parents[1]


def readme_table() -> dict[str, str]:
    """README's "Environment variables" table: variable -> meaning, for the rows naming one XSERV_ variable."""
    text = (ROOT / "README.md").read_text()
    table = text[text.index("**Environment variables:**"):].split("\n\n")[1]
    rows = {}
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|", 1)]
        match = re.fullmatch(r"`(XSERV_[A-Z0-9_]+)`", cells[0])
        if match:
            rows[match.group(1)] = cells[1].strip()
    return rows


def test_readme_lists_exactly_the_settings_with_their_help():
    assert readme_table() == {s.name: s.help for s in settings.SETTINGS}


def test_every_setting_is_described_and_defaults_when_unset():
    names = [s.name for s in settings.SETTINGS]
    assert len(set(names)) == len(names) and all(n.startswith("XSERV_") for n in names)
    assert not set(names) & set(settings.RETIRED)
    for s in settings.SETTINGS:
        assert s.help and "\n" not in s.help and s.type in (str, int, bool, Path)
        assert s.get({}) == (s.default() if callable(s.default) else s.default)
        assert s.get({s.name: "  "}) == s.get({})  # set but empty: the default
        if s.choices:
            assert s.default in s.choices


def test_values_are_parsed_and_bad_ones_name_the_variable_and_what_it_takes():
    assert settings.FP8_ACTIVATIONS.get({"XSERV_FP8_ACTIVATIONS": " BF16 "}) == "bf16"
    assert settings.TP_ALLREDUCE.get({"XSERV_TP_ALLREDUCE": "NCCL"}) == "nccl"
    assert settings.TP_IPC_MAX_BYTES.get({"XSERV_TP_IPC_MAX_BYTES": "16384"}) == 16384
    assert settings.GEMM_AUTOTUNE.get({"XSERV_GEMM_AUTOTUNE": "0"}) is False
    assert settings.CACHE_DIR.get({"XSERV_CACHE_DIR": "~/x"}) == Path.home() / "x"
    assert settings.ARCH.get({}) is None and settings.ARCH.get({"XSERV_ARCH": "sm_80"}) == "sm_80"
    with pytest.raises(ValueError, match=r"XSERV_FP8_EXPERTS='fp4': expected one of bf16, e4m3 \(default bf16\)"):
        settings.FP8_EXPERTS.get({"XSERV_FP8_EXPERTS": "fp4"})
    with pytest.raises(ValueError, match="XSERV_TP_ALLREDUCE='ring': expected one of auto, nccl"):
        settings.TP_ALLREDUCE.get({"XSERV_TP_ALLREDUCE": "ring"})
    for bad in ("lots", "8", str(1 << 30)):
        with pytest.raises(ValueError, match="XSERV_TP_IPC_MAX_BYTES"):
            settings.TP_IPC_MAX_BYTES.get({"XSERV_TP_IPC_MAX_BYTES": bad})
    with pytest.raises(ValueError, match="XSERV_GEMM_AUTOTUNE='maybe': expected 1 or 0"):
        settings.GEMM_AUTOTUNE.get({"XSERV_GEMM_AUTOTUNE": "maybe"})
    with pytest.raises(ValueError, match="XSERV_FP8_ACTIVATIONS"):
        settings.check_environment({"XSERV_FP8_ACTIVATIONS": "fp16"})


def test_the_consumers_read_through_the_settings(monkeypatch):
    from xserv.models.qwen3_moe import fp8_experts_kept
    from xserv.ops.fp8_linear import w8a8_enabled
    from xserv.parallel.ipc import max_bytes_from_env, mode_from_env
    from xserv.runtime.compiler import cache_dir

    monkeypatch.setenv("XSERV_FP8_ACTIVATIONS", "bf16")
    monkeypatch.setenv("XSERV_CACHE_DIR", "/tmp/xserv-settings-test")
    assert not w8a8_enabled() and cache_dir() == Path("/tmp/xserv-settings-test/cubin")
    assert fp8_experts_kept({"XSERV_FP8_EXPERTS": "e4m3"}) and not fp8_experts_kept({})
    assert mode_from_env({}) == "auto" and max_bytes_from_env({}) == 64 << 10
    monkeypatch.setenv("XSERV_FP8_EXPERTS", "yes")
    with pytest.raises(ValueError, match="XSERV_FP8_EXPERTS='yes'"):
        fp8_experts_kept()


def test_a_retired_variable_warns_once_and_changes_nothing(monkeypatch, caplog):
    monkeypatch.setattr(settings, "_warned", set())
    monkeypatch.setattr(settings, "_process_env_checked", False)
    monkeypatch.setenv("XSERV_MOE_FUSE_COMBINE", "0")
    with caplog.at_level(logging.WARNING, logger="xserv"):
        assert settings.FP8_EXPERTS.get() == "bf16"
        assert settings.TP_ALLREDUCE.get() == "auto"
    warnings = [r.getMessage() for r in caplog.records if "XSERV_MOE_FUSE_COMBINE" in r.getMessage()]
    assert settings._process_env_checked
    assert len(warnings) == 1 and "no longer exists" in warnings[0] and "combines inside its down GEMM" in warnings[0]
    assert set(settings.RETIRED) == {"XSERV_MOE_FUSE_COMBINE", "XSERV_MOE_DOWN_TRIGGER", "XSERV_TP_IPC_TRIGGER"}


def test_no_module_but_settings_reads_the_environment():
    offenders = []
    for path in sorted((ROOT / "xserv").rglob("*.py")):
        if path.name == "settings.py" and path.parent.name == "xserv":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"os\.environ\b|os\.getenv\(|\bgetenv\(", line):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert offenders == []
