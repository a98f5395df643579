"""`python -m tools.kernel_harness` on a machine without a GPU: the hint names commands and options that exist."""
import re

import pytest


@pytest.mark.parametrize("argv", [["check", "rmsnorm"], ["bench", "rmsnorm"], ["ceilings"], ["compile"], ["sizes"]])
def test_without_a_gpu_the_hint_names_options_that_exist(argv, monkeypatch, capsys):
    import xserv.runtime
    from tools.kernel_harness import build_parser, main

    monkeypatch.setattr(xserv.runtime, "cuda_available", lambda: False)
    assert main(argv) == 2
    err = capsys.readouterr().err
    suggested = re.findall(r"`python -m tools\.kernel_harness ([^`]+)`", err)
    assert suggested and "Traceback" not in err, err
    for command in suggested:
        args = build_parser().parse_args(command.split())  # an option that does not exist: SystemExit(2)
        assert args.arch == "sm_90a"


def test_an_op_brings_its_fused_twins_unless_shapes_or_a_variant_are_given():
    """`bench gemv_fp8` also runs the FP8 one-row fused entries' ops (with_ops), each a spec of its own; --shapes or
    --variant keep it to the op named."""
    from tools.harness_specs import all_specs
    from tools.kernel_harness import _op_names, build_parser

    specs = all_specs()
    twins = specs["gemv_fp8"].with_ops
    assert twins and all(specs[n].family == "gemv_fp8" for n in twins)
    fused_kernels = {k for n in twins for k in specs[n].kernels}
    assert {"gemv_fp8_row_rmsnorm_bf16", "gemv_fp8_row_bf16_add", "gemv_fp8_row_rmsnorm_silu_mul"} <= fused_kernels
    parse = build_parser().parse_args
    assert _op_names(specs, parse(["bench", "gemv_fp8", "--graph"])) == ["gemv_fp8", *twins]
    assert _op_names(specs, parse(["bench", "gemv_fp8", "--shapes", "1x64x64"])) == ["gemv_fp8"]
    assert _op_names(specs, parse(["check", "gemv_fp8", "--variant", "soft"])) == ["gemv_fp8"]
