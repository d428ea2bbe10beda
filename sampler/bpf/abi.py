"""The Python side of bpf/abi.h: every value and record layout shared with the BPF programs.

Only this module mirrors the header; tests/bpf/test_abi.py parses abi.h and checks each enum, constant
and struct here against it, so a change on one side that the other lacks fails the suite. The
structs are `sampler.cabi.Layout`s, as are the in-process sampler's (sampler/inprocess/abi.py).
"""

from __future__ import annotations

import enum

from sampler.cabi import Layout

# -- constants -----------------------------------------------------------------------------------
STACK_CHUNK = 1024
VM_WINDOW_SHIFT = 30
SHIFT_MIN, SHIFT_MAX = -6, 10
WTAB_STEPS = 64
WTAB_MAX_X = 24
WTAB_N = WTAB_STEPS * WTAB_MAX_X + 1
WTAB_SHIFT = 20
FNF_DELEGATES = 0x100
TORCH_TAG = 1 << 63
USDT_SPECS = 1024
USDT_MAX_ARGS = 3
USDT_FAMILY_LINK = 0x10000
CK_CONV_SHIFT = 8
CK_SRC_SHIFT = 12
CK_STACK = 0x10000
CK_NULL_SKIP = 0x20000
# Compile-time parameters' defaults (the loader passes the configured values with -D).
STACK_BYTES = 16384
PY_MAX = 96
UW_FRAMES = 128
UW_PENDING = 0xFFFFFFFF
UW_MAPS = 256
TARGETS_MAX = 4096
FAMILY_MAX = 1024
FAMILIES_MAX = 3072
UW_ROWS_LOG2 = 23
UW_PAGE_SHIFT = 12
UW_PAGE_ROWS_LOG2 = 9


# -- enums ---------------------------------------------------------------------------------------
class EvType(enum.IntEnum):
    ALLOC = 1
    FREE = 2
    VM = 3
    PROC = 4
    CUDA = 5            # a CUDA runtime/driver call (cuda.bpf.c; sampler/gpu/cuda.py)


class Source(enum.IntEnum):
    MALLOC = 1
    MMAP = 2
    FAULT = 3
    CUDA = 4            # EV_CUDA records: the layer (runtime)
    CUDA_DRIVER = 5     # (driver)
    TORCH = 6           # sampled tensors of PyTorch's caching allocator (tagged addresses)
    PYTHON = 7          # sampled objects of CPython's small-object allocator (the injected sampler)


class EvFlag(enum.IntFlag):
    FIRST_IS_IP = 1
    SAMPLED = 2
    STACK_ERR = 4
    PY_MISS = 8
    PY_TRUNC = 16
    SITE_MODULE = 32
    CONT_BP_UNKNOWN = 64
    CONT_IMPRECISE = 128


class TargetFlag(enum.IntFlag):
    SYSCALLS = 1
    FAULTS = 2
    FAMILY = 4
    HOLD = 8
    FORKED = 16


class Fn(enum.IntEnum):
    """Allocator functions and the USDT probes that stand for them (`enum fn_id`)."""

    MALLOC = 1
    CALLOC = 2
    REALLOC = 3
    REALLOCARRAY = 4
    POSIX_MEMALIGN = 5
    ALIGNED_ALLOC = 6
    MEMALIGN = 7
    VALLOC = 8
    PVALLOC = 9
    NEW = 10
    FREE = 11
    DELETE = 12
    USDT_ALLOC = 13
    USDT_FREE = 14
    TORCH_ALLOC = 15
    TORCH_FREE = 16
    PY_ALLOC = 17
    USDT_UNFREE = 18    # an EV_FREE record that undoes the thread's last otel_memory:free

    @property
    def frees(self) -> bool:
        return self in (Fn.FREE, Fn.DELETE, Fn.USDT_FREE, Fn.TORCH_FREE)


class VmOp(enum.IntEnum):
    MMAP = 1
    MUNMAP = 2
    MREMAP = 3
    BRK = 4
    MADVISE = 5
    MPROTECT = 6


class ProcOp(enum.IntEnum):
    FORK = 1
    EXEC = 2
    EXIT = 3
    ENTRY = 4


class Counter(enum.IntEnum):
    """Per-CPU counters (`enum counter`); hits are at HITS + fn_id and VM_HITS + vm_op."""

    LOST_EVENTS = 0
    LIVE_FULL = 1
    PENDING_FULL = 2
    SAMPLED = 3
    STACK_ERR = 4
    PY_MISS = 5
    FAULTS = 6
    CUDA_CALLS = 7
    VM_SUPPRESSED = 8
    FAMILY_FULL = 9
    HITS = 16
    VM_HITS = 48
    N = 64


class UsdtArgKind(enum.IntEnum):
    CONST = 1
    REG = 2
    DEREF = 3


class UsdtKind(enum.IntEnum):
    ALLOC = 1
    FREE = 2
    TORCH_ALLOC = 3
    TORCH_FREE = 4
    PY_ALLOC = 5
    UNFREE = 6


class UwKind(enum.IntEnum):
    CFA_RSP = 0
    CFA_RBP = 1
    CFA_DEREF_RBP = 2
    SIGNAL = 3
    ENTRY = 4
    UNSUPPORTED = 5
    NO_CFI = 6
    PLT = 7


class UwBp(enum.IntEnum):
    SAME = 0
    CFA = 1
    RBP = 2
    UNKNOWN = 3


class UwStop(enum.IntEnum):
    NONE = 0
    ENTRY = 1
    NO_CFI = 2
    BAD_FRAME = 3
    READ = 4
    NO_TABLE = 5
    NO_MAP = 6
    SIGNAL = 7
    UNSUPPORTED = 8
    DEEP = 9            # from NO_TABLE on: handed over to user space with a copy of the stack


class CudaConv(enum.IntEnum):
    OUT = 0
    PITCH = 1
    ARGS = 2


# The C names of each enum's members: `enum <c_name> { <prefix><MEMBER> ... }`.
ENUMS: dict[str, tuple[type[enum.Enum], str]] = {
    "ev_type": (EvType, "EV_"),
    "ev_source": (Source, "SRC_"),
    "ev_flags": (EvFlag, "EVF_"),
    "target_flags": (TargetFlag, "TGT_"),
    "fn_id": (Fn, "FN_"),
    "vm_op": (VmOp, "VM_"),
    "proc_op": (ProcOp, "PROC_"),
    "counter": (Counter, "C_"),
    "usdt_arg_kind": (UsdtArgKind, "USDT_"),
    "usdt_kind": (UsdtKind, "USDT_"),
    "cuda_conv": (CudaConv, "CV_"),
    "uw_kind": (UwKind, "UWK_"),
    "uw_bp": (UwBp, "UWB_"),
    "uw_stop": (UwStop, "UWS_"),
}


# -- record layouts ------------------------------------------------------------------------------
EV_HDR = Layout("ev_hdr", [
    ("type", "B"), ("source", "B"), ("op", "H"), ("pid", "I"), ("tid", "I"), ("pad", "H"), ("flags", "H"),
    ("ts", "Q"), ("addr", "Q"), ("size", "Q"), ("weight", "Q"), ("arg", "Q"), ("ret", "Q"),
])
EV_STACK = Layout("ev_stack", [
    ("h", (EV_HDR, 1)), ("ip", "Q"), ("sp", "Q"), ("bp", "Q"), ("ra_slot", "Q"), ("ra", "Q"),
    ("stack_len", "H"), ("npy", "H"), ("npc", "H"), ("stop", "B"), ("pad", "B"),
], tail="data")
UW_ROW = Layout("uw_row", [("pc", "I"), ("cfa_off", "h"), ("kind", "B"), ("bp_off8", "B")])
UW_MAP = Layout("uw_map", [("start", "Q"), ("end", "Q"), ("bias", "Q"), ("row_lo", "I"), ("row_n", "I"),
                           ("page_lo", "I"), ("page_n", "I"), ("page_first", "I"), ("pad", "I")])
UW_PROC = Layout("uw_proc", [("slot", "I"), ("n", "I")])
TARGET = Layout("target", [("flags", "I"), ("shift", "i"), ("budget", "I"), ("members", "I")])
PY_LAYOUT = Layout("py_layout", [
    ("version", "I"), ("tstate_frame", "H"), ("cframe_frame", "H"), ("frame_code", "H"), ("frame_back", "H"),
    ("frame_instr", "H"), ("frame_entry", "H"),
])
USDT_ARG = Layout("usdt_arg", [
    ("val", "q"), ("reg_off", "H"), ("kind", "B"), ("size", "B"), ("is_signed", "B"), ("pad", ("B", 3)),
])
USDT_SPEC = Layout("usdt_spec", [("arg", (USDT_ARG, USDT_MAX_ARGS)), ("nargs", "I"), ("kind", "I"), ("fn", "I"),
                                  ("source", "I")])
LAYOUTS = [EV_HDR, EV_STACK, TARGET, PY_LAYOUT, USDT_ARG, USDT_SPEC, UW_ROW, UW_MAP, UW_PROC]
