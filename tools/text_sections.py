"""Machine-code identity of a kernel family across a source change, without a GPU: every `.text*` section of its
cubin for sm_80 and sm_90a (NVRTC, no cache), hashed, over several compiles.

    python -m tools.text_sections dump FAMILY OUT.json [--runs 4] [--arches sm_80,sm_90a]
    python -m tools.text_sections compare BEFORE.json AFTER.json

Several compiles, because NVRTC 13 is not deterministic here: compiling the same moe.cu six times gave another
section for one kernel in two of them (a different kernel each time). `dump` keeps each
section's most common hash and how many compiles agreed; `compare` prints each section as same / CHANGED / new /
gone with those counts."""
from __future__ import annotations

import argparse
import hashlib
import json
import struct
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def text_sections(cubin: bytes) -> dict[str, str]:
    """Section name -> sha256 of its bytes, for every section whose name starts with .text (ELF64 section headers)."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise ValueError("not an ELF64 cubin")
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names_at = headers[shstrndx][4]

    def name(offset: int) -> str:
        start = names_at + offset
        return cubin[start:cubin.index(b"\0", start)].decode()

    return {name(h[0]): hashlib.sha256(cubin[h[4]:h[4] + h[5]]).hexdigest()
            for h in headers if name(h[0]).startswith(".text")}


def dump(family: str, arches: list[str], runs: int) -> dict:
    from xserv.runtime.compiler import compile_family

    result = {}
    for arch in arches:
        compiles = [text_sections(compile_family(family, arch, use_cache=False)) for _ in range(runs)]
        result[arch] = {}
        for section in sorted({s for c in compiles for s in c}):
            digest, agree = Counter(c.get(section) for c in compiles).most_common(1)[0]
            result[arch][section] = {"sha256": digest, "agree": f"{agree}/{runs}"}
    return result


def compare(before: dict, after: dict) -> list[str]:
    lines = []
    for arch in sorted(set(before) | set(after)):
        old, new = before.get(arch, {}), after.get(arch, {})
        for section in sorted(set(old) | set(new)):
            a, b = old.get(section), new.get(section)
            state = ("new" if a is None else "gone" if b is None
                     else "same" if a["sha256"] == b["sha256"] else "CHANGED")
            counts = " ".join(f"{w} {x['agree']}" for w, x in (("before", a), ("after", b)) if x)
            lines.append(f"{arch:7s} {state:8s} {section}  ({counts} compiles agree)")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("family")
    d.add_argument("out")
    d.add_argument("--runs", type=int, default=4)
    d.add_argument("--arches", default="sm_80,sm_90a")
    c = sub.add_parser("compare")
    c.add_argument("before")
    c.add_argument("after")
    args = ap.parse_args(argv)
    if args.cmd == "dump":
        Path(args.out).write_text(json.dumps(dump(args.family, args.arches.split(","), args.runs), indent=1))
    else:
        print("\n".join(compare(json.loads(Path(args.before).read_text()), json.loads(Path(args.after).read_text()))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
