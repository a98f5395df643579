"""tools/text_sections.py: the .text sections of a real cubin, and the comparison's verdicts."""
from tools.text_sections import compare, text_sections


def test_text_sections_of_a_cubin_name_its_kernels():
    from xserv.runtime.compiler import compile_family

    sections = text_sections(compile_family("cast", "sm_80", extra_options=("--Ofast-compile=max",), use_cache=False))
    assert sections and all(name.startswith(".text.") and len(h) == 64 for name, h in sections.items())


def test_compare_says_same_changed_new_and_gone():
    entry = lambda h: {"sha256": h, "agree": "4/4"}  # noqa: E731
    before = {"sm_80": {".text.a": entry("1"), ".text.b": entry("2"), ".text.c": entry("3")}}
    after = {"sm_80": {".text.a": entry("1"), ".text.b": entry("9"), ".text.d": entry("4")}}
    states = {line.split()[2]: line.split()[1] for line in compare(before, after)}
    assert states == {".text.a": "same", ".text.b": "CHANGED", ".text.c": "gone", ".text.d": "new"}
