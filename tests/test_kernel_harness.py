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
