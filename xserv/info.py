"""`xserv info`: what a bug report needs to know about this machine's GPU setup, as plain text or JSON.

The GPU (name, compute capability, free/total memory), the kernel target and path xserv picks for it (and
XSERV_ARCH), the driver / NVRTC / nvJitLink / cuBLAS versions, the kernel cache (where, how big) and whether the
kernels a start-up compiles for this target are in it. Works without a GPU or a driver: it says "no CUDA GPU" and
still prints the compiler versions and the cache. Reads the GPU through the driver API only (no stream, no kernels
loaded, no compile).
"""
from __future__ import annotations

import json
import platform
import sys


def _try(fn, default=None):
    try:
        return fn()
    except Exception as exc:  # every probe reports what failed instead of stopping the report
        return default if default is not None else f"unavailable ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"


def _package_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _driver_version() -> str:
    from cuda.bindings import driver

    err, version = driver.cuDriverGetVersion()
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(str(err))
    text = f"CUDA {version // 1000}.{version % 1000 // 10}"
    try:  # the kernel module's release (580.159.04), where Linux shows it
        with open("/proc/driver/nvidia/version") as f:
            for word in f.readline().split():
                if word[:1].isdigit() and word.count(".") >= 1:
                    return f"{text} (kernel module {word})"
    except OSError:
        pass
    return text


def _nvrtc() -> str:
    from .runtime.compiler import nvrtc_version

    return ".".join(map(str, nvrtc_version()))


def _nvjitlink() -> str:
    from cuda.bindings import nvjitlink

    return ".".join(map(str, nvjitlink.version()))


def _cublas(have_driver: bool) -> str:
    wheel = _package_version("nvidia-cublas") or _package_version("nvidia-cublas-cu12")
    if have_driver:
        def loaded():
            from nvmath.bindings import cublasLt

            v = int(cublasLt.get_version())
            return f"{v // 10000}.{v // 100 % 100}.{v % 100}"

        return _try(loaded)
    return f"wheel {wheel} (not loaded: no driver)" if wheel else "not installed"


def _gpu(index: int = 0) -> dict:
    """Name, compute capability, target, path, memory of GPU `index` through the driver API."""
    from cuda.bindings import driver

    from . import settings
    from .runtime.arch import arch_path, pdl_enabled, target_from_env
    from .runtime.errors import check_driver

    dev = check_driver(driver.cuDeviceGet(index), "cuDeviceGet")
    name = check_driver(driver.cuDeviceGetName(256, dev), "cuDeviceGetName")
    name = bytes(name).split(b"\0", 1)[0].decode()
    attr = driver.CUdevice_attribute
    cc = tuple(check_driver(driver.cuDeviceGetAttribute(a, dev), "cuDeviceGetAttribute")
               for a in (attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                         attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR))
    gpu = {"index": index, "name": name, "compute_capability": f"{cc[0]}.{cc[1]}",
           "multiprocessors": check_driver(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                                                                       dev), "cuDeviceGetAttribute"),
           "xserv_arch": settings.ARCH.get()}
    try:
        target = target_from_env(cc, name)
        gpu.update(target=target, kernel_path=arch_path(target).value, pdl=pdl_enabled(target), error=None)
    except Exception as exc:  # UnsupportedGPU (below sm_80) or a bad XSERV_ARCH: the message users would see
        gpu.update(target=None, kernel_path=None, pdl=None, error=str(exc))

    def memory():
        ctx = check_driver(driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        try:
            check_driver(driver.cuCtxPushCurrent(ctx), "cuCtxPushCurrent")
            try:
                free, total = check_driver(driver.cuMemGetInfo(), "cuMemGetInfo")
            finally:
                driver.cuCtxPopCurrent()
        finally:
            driver.cuDevicePrimaryCtxRelease(dev)
        return {"free_bytes": int(free), "total_bytes": int(total)}

    gpu["memory"] = _try(memory)
    return gpu


def _cache(target: str | None) -> dict:
    from .runtime.compiler import (cache_dir, family_pieces, family_shapes, is_cached, list_families,
                                   startup_families)

    folder = cache_dir()
    files = list(folder.rglob("*.cubin")) if folder.is_dir() else []
    out = {"dir": str(folder), "files": len(files), "bytes": sum(f.stat().st_size for f in files),
           # the targets it holds cubins for: <family>-<target>-<key>.cubin
           "targets": sorted({f.name.rsplit("-", 2)[1] for f in files if f.name.count("-") >= 2})}
    if target is not None:
        startup = startup_families(target)
        out["target"] = target
        out["startup"] = startup
        out["startup_missing"] = _try(lambda: [f for f in startup if not is_cached(f, target)], [])
        # the pieces compiled per model shape (a start-up compiles the loaded model's): which are cached
        out["shape_pieces_cached"] = _try(lambda: [p for f in list_families() if family_shapes(f)
                                                  and f not in {n.partition(":")[0] for n in startup}
                                                  for p in family_pieces(f) if is_cached(p, target)], [])
    return out


def collect() -> dict:
    """Everything `xserv info` prints, as a dict (what --json writes)."""
    from . import __version__
    from .runtime.device import device_count

    count = device_count()
    have_driver = _try(_driver_version, "") != ""
    info = {
        "xserv": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "gpu_count": count,
        "gpus": [],
        "versions": {
            "driver": _try(_driver_version) if have_driver else "not found (no NVIDIA driver)",
            "nvrtc": _try(_nvrtc),
            "nvjitlink": _try(_nvjitlink),
            "cublas": _cublas(have_driver and count > 0),
            "cuda-bindings": _package_version("cuda-bindings"),
            "cuda-core": _package_version("cuda-core"),
            "nvmath-python": _package_version("nvmath-python"),
        },
    }
    for index in range(count):
        info["gpus"].append(_try(lambda index=index: _gpu(index)))
    first = info["gpus"][0] if info["gpus"] and isinstance(info["gpus"][0], dict) else {}
    info["cache"] = _cache(first.get("target"))
    return info


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n} B"


def format_text(info: dict) -> str:
    lines = [f"xserv {info['xserv']} (Python {info['python']}, {info['platform']})"]
    if not info["gpus"]:
        lines.append("GPU:          no CUDA GPU (no device or no driver): xserv runs on the CPU (--device cpu)")
    for gpu in info["gpus"]:
        if not isinstance(gpu, dict):
            lines.append(f"GPU:          {gpu}")
            continue
        lines.append(f"GPU {gpu['index']}:        {gpu['name']}, compute capability {gpu['compute_capability']}, "
                     f"{gpu['multiprocessors']} SMs")
        forced = f" (XSERV_ARCH={gpu['xserv_arch']})" if gpu["xserv_arch"] else ""
        if gpu["error"]:
            lines.append(f"kernels:      none{forced}: {gpu['error']}")
        else:
            lines.append(f"kernels:      target {gpu['target']}, {gpu['kernel_path']} path, "
                         f"PDL {'on' if gpu['pdl'] else 'off'}{forced}")
        mem = gpu["memory"]
        lines.append(f"memory:       {_size(mem['free_bytes'])} free of {_size(mem['total_bytes'])}"
                     if isinstance(mem, dict) else f"memory:       {mem}")
    v = info["versions"]
    lines += [f"driver:       {v['driver']}", f"NVRTC:        {v['nvrtc']}", f"nvJitLink:    {v['nvjitlink']}",
              f"cuBLAS:       {v['cublas']}",
              "packages:     " + ", ".join(f"{k} {v[k] or 'missing'}" for k in ("cuda-bindings", "cuda-core",
                                                                              "nvmath-python"))]
    cache = info["cache"]
    held = f"; for {', '.join(cache['targets'])}" if cache["targets"] else ""
    lines.append(f"kernel cache: {cache['dir']} ({cache['files']} cubins, {_size(cache['bytes'])}{held})")
    if "target" in cache:
        missing = cache["startup_missing"]
        n = len(cache["startup"])
        state = (f"all {n} cached" if not missing else
                 f"{len(missing)} of {n} not cached (the first LLM() compiles them): {', '.join(missing)}")
        lines.append(f"start-up kernels for {cache['target']}: {state}")
        pieces = cache["shape_pieces_cached"]
        lines.append("model-shape pieces cached: " + (", ".join(pieces) if pieces else
                                                       "none (the first LLM() compiles its model's)"))
    return "\n".join(lines)


def main(as_json: bool = False, out=None) -> int:
    out = out or sys.stdout
    info = collect()
    out.write((json.dumps(info, indent=2) if as_json else format_text(info)) + "\n")
    return 0
