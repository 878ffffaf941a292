"""A training process on the CPU gives freed activations back to the OS.

glibc's malloc serves a block above its mmap threshold with a mapping of its own, unmapped when freed; smaller
blocks come from the heap, which keeps freed memory for reuse. The threshold starts at 128 KiB and rises (up to
32 MiB) each time a mapped block is freed, so from the first step on a training process takes its activations of
up to 32 MiB (a (4, 1024, 2048) fp32 hidden state is 32 MiB less 16 KiB) from the heap; as their sizes change from
step to step the heap fragments, and the process holds up to twice its live tensors: measured here, 4.1 GiB above
an idle process for a LLaMA-width LoRA step at 4 x 1024 tokens whose tensors peak at 2.1 GiB (`mmadapt plan` said
2.3 GiB). A fixed threshold (`mallopt(M_MMAP_THRESHOLD)`, which also stops the rise) unmaps every freed block of
`THRESHOLD` (16 MiB) or more, so the process's memory follows its live tensors (2.1 GiB there), as with jemalloc or
tcmalloc (which PyTorch's CPU performance guide recommends); smaller blocks stay in the heap, whose reuse keeps a
step as fast as with glibc's defaults (a lower threshold is slower: mapping fresh pages for every block). A
threshold the user chose (`MALLOC_MMAP_THRESHOLD_`) and a preloaded allocator are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
THRESHOLD = 16 << 20  # 1 MiB returns more but costs ~18% of a CPU step in page faults (4 MiB: ~10%); 16 MiB: none
PRELOADED = ("jemalloc", "tcmalloc", "mimalloc")


def return_freed_memory(threshold: int = THRESHOLD) -> str | None:
    """Fix glibc's mmap threshold at `threshold` bytes in this process. Returns what was done (one line to log), or
    None where it does not apply: not glibc (macOS, musl), another allocator preloaded (`LD_PRELOAD`), or the user's
    own `MALLOC_MMAP_THRESHOLD_` (kept as given)."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is not None:
        return None
    if any(name in os.environ.get("LD_PRELOAD", "") for name in PRELOADED):
        return None
    path = ctypes.util.find_library("c")
    if path is None:
        return None
    try:
        libc = ctypes.CDLL(path)
        if not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
            return None
        ok = libc.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(threshold))
    except OSError:
        return None
    if not ok:
        return None
    return (f"CPU memory: freed blocks of {threshold // 1024:,} KiB or more go back to the OS (glibc's mmap threshold "
            f"fixed; set MALLOC_MMAP_THRESHOLD_ to choose another)")
