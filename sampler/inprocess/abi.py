"""The Python side of the in-process sampler's ABI: sampler/inprocess/inject_abi.h, what the recorder
writes into and reads from the injected sampler (inject.c, place.c), and sampling.h, which it
includes: the sampling state, defaults and limits that the injected sampler and the preload shim
(preload.c) share.

Only this module mirrors those headers; tests/bpf/test_abi.py parses them and checks each enum,
constant and struct here against them, by the rules it applies to the BPF ABI (sampler/bpf/abi.py),
so a change on one side that the other lacks fails the suite.
"""

from __future__ import annotations

import enum

from sampler.cabi import Layout

# -- sampling.h ----------------------------------------------------------------------------------
# Defaults and limits of the mean and of the sample-rate cap (the shim's environment, the recorder's
# options: sampler/inprocess/preload.py).
SMP_DEFAULT_MEAN = 524288
SMP_MAX_MEAN = 1 << 40
SMP_DEFAULT_MAX_PER_S = 2000
SMP_MAX_MAX_PER_S = 1000000000
# The cap's windows.
SMP_NS_PER_S = 1000000000
SMP_WINDOW_MIN_SAMPLES = 64
SMP_RATE_MIN_NS = 4000000
SMP_MAX_STEP_LOG2 = 20
# The set of sampled live addresses.
SMP_SLOTS = 7
SMP_NBUCKETS_LOG2 = 15
SMP_NBUCKETS = 1 << SMP_NBUCKETS_LOG2
SMP_BUCKET_MASK = SMP_NBUCKETS - 1
SMP_MAX_PROBE = 8

# -- inject_abi.h --------------------------------------------------------------------------------
INJ_MAGIC = 0x31504D53434F4C41          # "ALOCSMP1": a placed, configured sampler
INJ_VERSION = 1
INJ_DATA_OFFSET = 0x20000               # the data's distance from the start of the code mapping
INJ_SLOTS_LOG2 = 14
INJ_SLOT_SHIFT = 16
INJ_PY_SMALL = 512
INJ_STORE_OPS = 256                     # words one stopped thread writes (place.c `store`)
INJ_STORE_PAGES = 64
INJ_STORE_STACK = 4096
INJ_STORE_AFTER_OK = 1                  # inj_store_op.flags: only when the op before it was written
INJ_STORE_DONE = 0x454E4F44             # "DONE"


class InjFn(enum.IntEnum):
    """The functions the sampler stands in for, indexes into inj_data.real (`enum inj_fn`)."""

    MALLOC = 0
    FREE = 1
    CALLOC = 2
    REALLOC = 3
    POSIX_MEMALIGN = 4
    ALIGNED_ALLOC = 5
    MEMALIGN = 6
    VALLOC = 7
    PVALLOC = 8
    NFN = 9


class PyDomain(enum.IntEnum):
    """CPython's allocator domains the sampler stands in for, indexes into inj_data.py
    (`enum inj_py_domain`)."""

    MEM = 0
    OBJ = 1
    NDOMAINS = 2


# The C names of each enum's members: `enum <c_name> { <prefix><MEMBER> ... }`.
ENUMS: dict[str, tuple[type[enum.Enum], str]] = {
    "inj_fn": (InjFn, "INJ_"),
    "inj_py_domain": (PyDomain, "INJ_PY_"),
}

# The same by name, in index order: the functions (the sampler's entries are as_<name>) and the
# domains (as_py_<domain>_<malloc|calloc|realloc|free>).
FUNCTIONS = tuple(f.name.lower() for f in InjFn if f is not InjFn.NFN)
PY_DOMAINS = tuple(d.name.lower() for d in PyDomain if d is not PyDomain.NDOMAINS)


# -- layouts -------------------------------------------------------------------------------------
SMP_THREAD = Layout("smp_thread", [("remaining", "Q"), ("mean", "Q"), ("rng", "Q"), ("seeded", "Q")])
SMP_PROCESS = Layout("smp_process", [(n, "Q") for n in (
    "base_mean", "cur_mean", "max_per_s", "win_start", "win_count", "mean_changes", "sampled", "freed", "dropped",
    "weight_bits", "var_bits", "seed_counter")])
SMP_BUCKET = Layout("smp_bucket", [("overflow", "Q"), ("key", ("Q", SMP_SLOTS))])   # aligned(64) in C
SMP_TABLE_BYTES = SMP_NBUCKETS * (SMP_BUCKET.struct.size + 1)    # the buckets, then a home count per bucket
INJ_PY_ALLOCATOR = Layout("inj_py_allocator", [(n, "Q") for n in ("ctx", "malloc", "calloc", "realloc", "free")])
INJ_DATA = Layout("inj_data", [
    ("magic", "Q"), ("version", "I"), ("pad", "I"), ("owner", "Q"), ("clock", "Q"), ("real", ("Q", len(FUNCTIONS))),
    ("py", (INJ_PY_ALLOCATOR, len(PY_DOMAINS))), ("reserved", ("Q", 8)), ("proc", (SMP_PROCESS, 1)),
], tail="slots")                        # then 1 << INJ_SLOTS_LOG2 SMP_THREADs
INJ_STORE_OP = Layout("inj_store_op", [(n, "Q") for n in ("addr", "expected", "value", "flags", "seen", "done")])
INJ_STORE_PAGE = Layout("inj_store_page", [("addr", "Q"), ("len", "Q"), ("prot", "Q"), ("write_prot", "Q"),
                                           ("err", "q")])
INJ_STORE = Layout("inj_store", [
    ("nops", "Q"), ("npages", "Q"), ("state", "Q"), ("pad", "Q"), ("pages", (INJ_STORE_PAGE, INJ_STORE_PAGES)),
    ("ops", (INJ_STORE_OP, INJ_STORE_OPS)), ("stack", ("B", INJ_STORE_STACK)),
])
LAYOUTS = [SMP_THREAD, SMP_PROCESS, SMP_BUCKET, INJ_PY_ALLOCATOR, INJ_DATA, INJ_STORE_OP, INJ_STORE_PAGE, INJ_STORE]
