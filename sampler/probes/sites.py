"""Pick the probe offset inside a function at which the kernel emulates the probed instruction.

A uprobe on an instruction the x86 kernel (6.18) emulates -- push reg, nop, jmp/call/jcc rel --
costs ~1.35 us; on anything else it single-steps out of line (~6 us, two exceptions). Moving the
probe a few bytes past the entry is only valid when it is provable from the code that every call
reaches the site exactly once (or is a call the caller declared uninteresting) with the argument
registers unchanged, and, for return probes, with the return address still at *rsp. When any of
that cannot be proven, the entry (+0) is returned.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import capstone
from capstone import x86_const as x86


@dataclass(frozen=True)
class ProbeSite:
    offset: int  # bytes from the function start
    mnemonic: str  # instruction at the site
    emulated: bool  # whether the kernel emulates it (cheap) instead of single-stepping
    reason: str  # why this offset, for logs and reports


def _register_aliases() -> tuple[dict[str, str], dict[str, str]]:
    """Map every GPR name to its 64-bit register, and each 64-bit register to its 32-bit name."""
    full: dict[str, str] = {}
    dword: dict[str, str] = {}
    for r in "abcd":
        names = (f"r{r}x", f"e{r}x", f"{r}x", f"{r}l", f"{r}h")
        full.update(dict.fromkeys(names, f"r{r}x"))
        dword[f"r{r}x"] = f"e{r}x"
    for r in ("si", "di", "bp", "sp"):
        full.update(dict.fromkeys((f"r{r}", f"e{r}", r, f"{r}l"), f"r{r}"))
        dword[f"r{r}"] = f"e{r}"
    for n in range(8, 16):
        full.update(dict.fromkeys((f"r{n}", f"r{n}d", f"r{n}w", f"r{n}b"), f"r{n}"))
        dword[f"r{n}"] = f"r{n}d"
    return full, dword


_FULL_REG, _DWORD_REG = _register_aliases()

# Instructions a site may be moved past. capstone's implicit-operand tables are incomplete for some
# instructions (it reports no register or stack effect for `enter`), so only ones whose effects it
# describes fully are accepted; everything else counts as unknown, hence unsafe.
_PASSABLE = frozenset({
    x86.X86_INS_ENDBR64, x86.X86_INS_NOP, x86.X86_INS_PUSH,
    x86.X86_INS_MOV, x86.X86_INS_MOVABS, x86.X86_INS_MOVZX, x86.X86_INS_MOVSX, x86.X86_INS_MOVSXD,
    x86.X86_INS_LEA, x86.X86_INS_ADD, x86.X86_INS_SUB, x86.X86_INS_AND, x86.X86_INS_OR,
    x86.X86_INS_XOR, x86.X86_INS_NOT, x86.X86_INS_NEG, x86.X86_INS_INC, x86.X86_INS_DEC,
    x86.X86_INS_TEST, x86.X86_INS_CMP, x86.X86_INS_SHL, x86.X86_INS_SHR, x86.X86_INS_SAR,
    x86.X86_INS_MUL, x86.X86_INS_IMUL,
})
# Of those, the ones allowed to move rsp (only when no return probe needs *rsp).
_STACK_ADJUST = frozenset({x86.X86_INS_PUSH, x86.X86_INS_SUB})
_CONTROL_GROUPS = (capstone.CS_GRP_JUMP, capstone.CS_GRP_CALL, capstone.CS_GRP_RET,
                   capstone.CS_GRP_INT, capstone.CS_GRP_IRET)


@lru_cache(maxsize=1)
def _disassembler() -> capstone.Cs:
    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    md.detail = True
    return md


def _decode(body: bytes, func_vaddr: int) -> list[capstone.CsInsn]:
    """Linear decode; capstone stops at the first byte sequence it cannot decode."""
    return list(_disassembler().disasm(body, func_vaddr))


def _legacy_prefixes(insn: capstone.CsInsn) -> set[int]:
    return {p for p in insn.prefix if p}


def _is_emulated(insn: capstone.CsInsn) -> bool:
    """Mirror of arch/x86/kernel/uprobes.c (6.18): branch_setup_xol_ops and push_setup_xol_ops."""
    b = bytes(insn.bytes)
    if len(b) == 1 and 0x50 <= b[0] <= 0x57:  # push %rax..%rdi
        return True
    if len(b) == 2 and b[0] == 0x41 and 0x50 <= b[1] <= 0x57:  # push %r8..%r15: only REX 0x41
        return True
    if insn.id == x86.X86_INS_NOP:
        # 90 (REX.B 90 is xchg, and capstone does not call it nop) or 0f 1f /0; the kernel rejects
        # cs/ds/es/ss and lock prefixes outright, and f3 90 is pause, not nop.
        opc = insn.opcode
        is_nopl = opc[0] == 0x0F and opc[1] == 0x1F and (insn.modrm >> 3) & 7 == 0
        return (opc[0] == 0x90 or is_nopl) and _legacy_prefixes(insn) <= {0x66}
    # Direct jmp/call/jcc; loop/jrcxz are not emulated, a 0x66 prefix makes the kernel refuse.
    if _direct_target(insn) is None or not _legacy_prefixes(insn) <= {0xF2}:
        return False
    op = insn.opcode
    return op[0] in (0xE8, 0xE9, 0xEB) or 0x70 <= op[0] <= 0x7F or (op[0] == 0x0F and 0x80 <= op[1] <= 0x8F)


def _direct_target(insn: capstone.CsInsn) -> int | None:
    if not (insn.group(capstone.CS_GRP_JUMP) or insn.group(capstone.CS_GRP_CALL)):
        return None
    ops = insn.operands
    return ops[0].imm if len(ops) == 1 and ops[0].type == x86.X86_OP_IMM else None


def _is_unknown_jump(insn: capstone.CsInsn) -> bool:
    """An indirect jmp that may stay inside the function (a jump table), so its targets are unknown.

    Memory-indirect jumps through %rip are tail calls through the GOT and leave the function.
    """
    if not insn.group(capstone.CS_GRP_JUMP) or _direct_target(insn) is not None:
        return False
    op = insn.operands[0]
    return not (op.type == x86.X86_OP_MEM and op.mem.base == x86.X86_REG_RIP)


def _is_null_skip(test: capstone.CsInsn, je: capstone.CsInsn, reg: str | None) -> bool:
    """`test R,R ; je` with R the 64- or 32-bit form of reg: the jump is taken only when R is 0.

    A 32-bit test comes from a compiler only when the parameter is 32 bits wide, so it is just as
    exact a zero test of the argument.
    """
    if reg is None or test.id != x86.X86_INS_TEST or je.id != x86.X86_INS_JE:
        return False
    a, b = test.operands
    if a.type != x86.X86_OP_REG or b.type != x86.X86_OP_REG or a.reg != b.reg:
        return False
    full = _FULL_REG.get(reg, reg)
    return test.reg_name(a.reg) in (full, _DWORD_REG.get(full)) and _direct_target(je) is not None


def _hazard(insn: capstone.CsInsn, watched: frozenset[str], needs_return: bool) -> str | None:
    """Why running `insn` before the probe site would change what the probe observes, if it would."""
    if any(insn.group(g) for g in _CONTROL_GROUPS):
        return "transfers control"
    if insn.id not in _PASSABLE:
        return "has effects not known to be harmless"
    try:
        _, written = insn.regs_access()
    except capstone.CsError:
        return "has unknown register effects"
    regs = {_FULL_REG.get(insn.reg_name(r), insn.reg_name(r)) for r in written}
    if regs & watched:
        return "writes " + ",".join(sorted(regs & watched))
    if "rsp" in regs and (needs_return or insn.id not in _STACK_ADJUST):
        return "moves rsp (a return probe needs the return address at *rsp)" if needs_return else "moves rsp"
    if any(op.type == x86.X86_OP_MEM and op.access & capstone.CS_AC_WRITE for op in insn.operands):
        return "writes memory"
    return None


def choose_site(
    body: bytes,
    func_vaddr: int,
    *,
    reads: frozenset[str],
    needs_return: bool,
    null_skip: str | None = None,
    max_scan: int = 32,
) -> ProbeSite:
    """Offset of the first emulated instruction that every interesting call reaches unchanged.

    body: the whole function (symbol size), so that every branch into the prologue is seen.
    reads: argument registers the BPF program reads at the site, e.g. {"rdi"} for free.
    needs_return: a return probe is attached too, so rsp must still point at the return address.
    null_skip: register whose zero value makes the call uninteresting (free(NULL)); a `test R,R; je`
      on it may be stepped over.
    Only branches inside `body` are seen: code elsewhere (a compiler-split `.cold` part) that jumps
    into the prologue would go unnoticed; such code returns past the prologue, which already ran.
    """
    insns = _decode(body, func_vaddr)
    if not insns:
        return ProbeSite(0, "(undecodable)", False, "+0: first instruction cannot be decoded")
    first = insns[0]
    if _is_emulated(first):
        return ProbeSite(0, first.mnemonic, True, "+0: first instruction emulated")

    # The jcc of a NULL check is itself a cheap site; remembered in case nothing past it is safe.
    best: ProbeSite | None = None

    def give_up(why: str) -> ProbeSite:
        if best is not None:
            return ProbeSite(best.offset, best.mnemonic, True, f"{best.reason}; not further: {why}")
        return ProbeSite(0, first.mnemonic, False, f"+0: no provably safe emulated instruction: {why}")

    # Every branch into (0, site] must be known, or the site could be reached without the entry.
    decoded = sum(i.size for i in insns)
    if decoded < len(body):
        return give_up(f"bytes at +{decoded} cannot be decoded, so branch targets are unknown")
    unknown = next((i for i in insns if _is_unknown_jump(i)), None)
    if unknown is not None:
        return give_up(f"indirect {unknown.mnemonic} at +{unknown.address - func_vaddr} has unknown targets")
    end = func_vaddr + len(body)
    inner_targets = sorted(
        t - func_vaddr for t in map(_direct_target, insns) if t is not None and func_vaddr < t < end
    )

    def blocked(off: int) -> str | None:
        if off >= max_scan:
            return f"none within the first {max_scan} bytes"
        into = next((t for t in inner_targets if t <= off), None)
        return None if into is None else f"a branch in the function targets +{into}, inside the prologue"

    # The NULL check must test the argument as passed, so its register is protected like `reads`.
    watched = frozenset(_FULL_REG.get(r, r) for r in (*reads, *filter(None, [null_skip])))
    passed: list[str] = []  # what runs before the site, for the reason text
    i = 0
    while i < len(insns):
        insn = insns[i]
        off = insn.address - func_vaddr
        if off > 0:
            why = blocked(off)
            if why is not None:
                return give_up(why)
            if _is_emulated(insn):
                after = ", ".join(passed)
                return ProbeSite(off, insn.mnemonic, True, f"+{off}: {insn.mnemonic} after {after}")
        je = insns[i + 1] if i + 1 < len(insns) else None
        if je is not None and _is_null_skip(insn, je, null_skip):
            check = f"NULL check of {null_skip}"
            je_off = je.address - func_vaddr
            if blocked(je_off) is None and _is_emulated(je):
                best = ProbeSite(je_off, je.mnemonic, True, f"+{je_off}: {je.mnemonic} of the {check}")
            passed.append(check)
            i += 2
            continue
        hazard = _hazard(insn, watched, needs_return)
        if hazard is not None:
            return give_up(f"{insn.mnemonic} at +{off} {hazard}")
        passed.append(insn.mnemonic)
        i += 1
    return give_up("the function ends first")


def branch_targets_outside(body: bytes, func_vaddr: int) -> set[int]:
    """Absolute targets of the function's direct calls and jumps that lie outside it."""
    end = func_vaddr + len(body)
    targets = (_direct_target(i) for i in _decode(body, func_vaddr))
    return {t for t in targets if t is not None and not func_vaddr <= t < end}


def forwards_to(
    body: bytes,
    func_vaddr: int,
    plt: dict[int, str],
    symbols_at: Callable[[int], list[str]],
    names: set[str],
) -> set[str]:
    """Which of `names` the function calls or tail-jumps to directly (via a PLT stub or by address).

    A probed function that forwards to another probed one (glibc's reallocarray does
    `jmp realloc@plt`) would count the same bytes twice. Symbol versions (`realloc@@GLIBC_2.2.5`)
    are ignored when comparing.
    """
    found: set[str] = set()
    for target in branch_targets_outside(body, func_vaddr):
        at = [plt[target]] if target in plt else symbols_at(target)
        found.update(name.split("@", 1)[0] for name in at)
    return found & names
