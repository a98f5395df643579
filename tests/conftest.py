import hashlib
import os
import threading
from pathlib import Path

# Under pytest-xdist the workers share the cores: each one's BLAS gets its share of them (set before NumPy loads,
# and inherited by the servers and CLIs the tests start). The tests' matrices are small, so more BLAS threads than
# that only burn CPU (the engine tests: the same wall time with 1 thread as with 2, and 40% less CPU).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    os.environ.setdefault("OPENBLAS_NUM_THREADS",
                          str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from xserv.runtime import cuda_available  # noqa: E402

HAS_GPU = cuda_available()

# The heaviest files first (their CPU seconds on a 2-core machine without a GPU: about 20-50 each, the rest a few).
# Under README's test command (pytest-xdist: --dist loadfile --no-loadscope-reorder) each worker takes the next
# whole file in this order, so that the long ones start early and the workers finish together; whole files keep a
# module's fixtures (a server process, a loaded model) to one worker.
HEAVY_FIRST = ("test_llm_threads.py", "test_engine.py", "test_server_limits.py", "test_server.py", "test_server_edges.py",
               "test_server_structured.py", "test_fp8_kv_model.py", "test_cli.py", "test_smem_limits.py",
               "test_tp_engine.py", "test_structured.py", "test_server_tools.py", "test_server_hybrid.py",
               "test_moe_model.py", "test_sampling_op.py", "test_sampling.py")


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: without the plugin (the GPU machine) it is never called
def pytest_xdist_auto_num_workers(config):
    """`-n auto`: no workers (this process runs everything) where there is a GPU, whose tests want the device to
    themselves; else one per core, at most 4 (compile_all alone is a third of the CPU work: more workers wait)."""
    if HAS_GPU:
        return 0
    return min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the others keep their order
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _sum_in_another_order_for_some_row_counts():
    """XSERV_TEST_OTHER_BLAS=1: the CPU backend's GEMMs sum in another order (float64 sums rounded to float32)
    for about half of the row counts (a hash of the count picks which), as another BLAS, or another kernel of the same BLAS picked by the shape, may. Each
    GEMM output then moves by up to one float32 ulp, and a bf16 activation rounded from it by up to one bf16 ulp.
    A test that compares runs of different batch shapes must pass this way too: run the suite with it to find a
    bound fitted to one BLAS (tests/README.md)."""
    from xserv.ops import gemv, linear

    plain = linear.linear_reference

    def other_order(x, w):
        if not (np.asarray(x).shape[0] * 0x9E3779B1 >> 11) & 1:
            return plain(x, w)
        return (np.asarray(x, np.float64) @ linear._as_f32(w).T.astype(np.float64)).astype(np.float32)

    linear.linear_reference = gemv.linear_reference = other_order


if os.environ.get("XSERV_TEST_OTHER_BLAS") == "1":
    _sum_in_another_order_for_some_row_counts()


@pytest.fixture
def rng(request):
    """A fresh generator per test (seeded from the test name so a failure reproduces)."""
    import zlib

    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(scope="session", autouse=True)
def _parse_each_tokenizer_file_once():
    """xserv.Tokenizer.from_folder runs as it is, but the Hugging Face tokenizer it builds from a tokenizer.json is
    built once per file content and shared: parsing Qwen3's 11 MB tokenizer.json takes ~0.45 s of CPU, and the tests
    load a model (every model folder has that same file) a few dozen times. Sharing is safe because xserv only
    reads the object (encode, decode, token ids, vocabulary size); should anything set padding or truncation or
    add tokens to it, the next load parses the file again instead of handing out the changed object."""
    import tokenizers

    from xserv.tokenizer import Tokenizer

    real = tokenizers.Tokenizer
    parsed: dict[bytes, tuple[object, int]] = {}
    digests: dict[tuple, bytes] = {}  # (path, size, mtime, inode) -> content digest: each file is read once

    class ParseOnce:  # what `from tokenizers import Tokenizer` gives xserv.tokenizer inside from_folder
        @staticmethod
        def from_file(path):
            st = os.stat(path)
            file_key = (os.path.realpath(path), st.st_size, st.st_mtime_ns, st.st_ino)
            if file_key not in digests:
                digests[file_key] = hashlib.blake2b(Path(path).read_bytes(), digest_size=16).digest()
            key = digests[file_key]
            tok, vocab = parsed.get(key, (None, None))
            if tok is None or tok.padding is not None or tok.truncation is not None \
                    or tok.get_vocab_size(with_added_tokens=True) != vocab:
                tok = real.from_file(path)
                parsed[key] = tok, tok.get_vocab_size(with_added_tokens=True)
            return tok

    lock = threading.Lock()
    from_folder = Tokenizer.__dict__["from_folder"]

    def from_folder_parsing_once(cls, folder):
        with lock:  # the swap below is seen by every thread: one load at a time
            tokenizers.Tokenizer = ParseOnce
            try:
                return from_folder.__func__(cls, folder)
            finally:
                tokenizers.Tokenizer = real

    Tokenizer.from_folder = classmethod(from_folder_parsing_once)
    try:
        yield
    finally:
        Tokenizer.from_folder = from_folder
