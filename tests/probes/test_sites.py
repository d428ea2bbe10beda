"""Probe-site selection on the real glibc and on functions assembled here with exact bytes."""

from __future__ import annotations

import platform
import subprocess
import textwrap
from dataclasses import dataclass
from pathlib import Path

import capstone
import pytest
from capstone import x86_const as x86
from elftools.elf.elffile import ELFFile
from elftools.elf.relocation import RelocationSection

from sampler.probes.sites import ProbeSite, branch_targets_outside, choose_site, forwards_to

LIBC = Path("/lib/x86_64-linux-gnu/libc.so.6")
# The exact offsets below are those of Debian 12's glibc; other builds lay the code out differently.
glibc_236 = pytest.mark.skipif(platform.libc_ver() != ("glibc", "2.36"), reason="offsets are glibc 2.36's")


@dataclass
class Image:
    """Function bytes and symbols of one ELF file, read with pyelftools."""

    path: Path
    funcs: dict[str, tuple[int, bytes]]  # name -> (vaddr, body)
    by_addr: dict[int, list[str]]

    @classmethod
    def load(cls, path: Path, symtab: str) -> Image:
        with path.open("rb") as fh:
            elf = ELFFile(fh)
            funcs: dict[str, tuple[int, bytes]] = {}
            by_addr: dict[int, list[str]] = {}
            for sym in elf.get_section_by_name(symtab).iter_symbols():
                if sym["st_info"]["type"] != "STT_FUNC" or sym["st_shndx"] == "SHN_UNDEF":
                    continue
                sec = elf.get_section(sym["st_shndx"])
                start = sym["st_value"] - sec["sh_addr"]
                funcs[sym.name] = (sym["st_value"], sec.data()[start:start + sym["st_size"]])
                by_addr.setdefault(sym["st_value"], []).append(sym.name)
        return cls(path, funcs, by_addr)

    def site(self, name: str, **kw) -> ProbeSite:
        vaddr, body = self.funcs[name]
        return choose_site(body, vaddr, **kw)

    def symbols_at(self, vaddr: int) -> list[str]:
        return self.by_addr.get(vaddr, [])


def plt_targets(path: Path) -> dict[int, str]:
    """PLT stub vaddr -> symbol, from JUMP_SLOT relocations and the stubs' `jmp *slot(%rip)`."""
    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    md.detail = True
    with path.open("rb") as fh:
        elf = ELFFile(fh)
        rela = elf.get_section_by_name(".rela.plt")
        assert isinstance(rela, RelocationSection)
        symtab = elf.get_section(rela["sh_link"])
        slots = {
            r["r_offset"]: symtab.get_symbol(r["r_info_sym"]).name
            for r in rela.iter_relocations()
            if r["r_info_type"] == 7  # R_X86_64_JUMP_SLOT
        }
        stubs: dict[int, str] = {}
        for name in (".plt", ".plt.sec"):
            sec = elf.get_section_by_name(name)
            if sec is None:
                continue
            for insn in md.disasm(sec.data(), sec["sh_addr"]):
                op = insn.operands[0] if insn.mnemonic == "jmp" else None
                if op is None or op.type != x86.X86_OP_MEM or op.mem.base != x86.X86_REG_RIP:
                    continue
                slot = insn.address + insn.size + op.mem.disp
                if slot in slots:
                    stubs[insn.address & ~0xF] = slots[slot]  # stubs are 16-byte entries
    return stubs


@pytest.fixture(scope="module")
def libc() -> Image:
    return Image.load(LIBC, ".dynsym")


# Each function ends in code the probe never reaches; only the prologue matters.
ASM = r"""
    .text
    .macro func name
    .globl \name
    .type \name, @function
\name:
    .endm
    .macro endf name
    .size \name, . - \name
    .endm

func writes_rdi
    mov %rsi, %rdi
    push %rbp
    pop %rbp
    ret
endf writes_rdi

func writes_dil
    movb $0, %dil
    push %rbp
    pop %rbp
    ret
endf writes_dil

func null_check
    test %rdi, %rdi
    je 1f
    push %rbp
    pop %rbp
1:  ret
endf null_check

func null_check32
    test %edi, %edi
    je 1f
    push %rbp
    pop %rbp
1:  ret
endf null_check32

func null_check_clobbered
    xor %edi, %edi
    test %rdi, %rdi
    je 1f
    push %rbp
    pop %rbp
1:  ret
endf null_check_clobbered

func null_check_rsi
    test %rsi, %rsi
    je 1f
    push %rbp
    pop %rbp
1:  ret
endf null_check_rsi

func nonnull_branch
    test %rdi, %rdi
    jne 1f
    push %rbp
    pop %rbp
1:  ret
endf nonnull_branch

func null_then_write
    test %rdi, %rdi
    je 1f
    mov %rsi, %rdi
    push %rbp
    pop %rbp
1:  ret
endf null_then_write

func loop_into_prologue
    mov %rdi, %rax
1:  push %rbx
    pop %rbx
    dec %rax
    jnz 1b
    ret
endf loop_into_prologue

func loop_after_site
    mov %rdi, %rax
    push %rbx
1:  pop %rbx
    dec %rax
    jnz 1b
    ret
endf loop_after_site

func sub_then_push
    sub $8, %rsp
    push %rbp
    pop %rbp
    add $8, %rsp
    ret
endf sub_then_push

func endbr_push
    endbr64
    push %rbp
    pop %rbp
    ret
endf endbr_push

func stores
    mov %rsi, -8(%rsp)
    push %rbp
    pop %rbp
    ret
endf stores

func jump_table
    mov %rdi, %rax
    push %rbx
    pop %rbx
    jmp *%rax
endf jump_table

func undecodable
    mov %rdi, %rax
    push %rbx
    pop %rbx
    ret
    .byte 0x06
endf undecodable

func far_push
    .rept 11
    mov %rdi, %rax
    .endr
    push %rbp
    pop %rbp
    ret
endf far_push

func nopl_first
    nopw 0(%rax, %rax, 1)
    mov %rsi, %rdi
    ret
endf nopl_first

func cs_nop_first
    .byte 0x66, 0x2e, 0x0f, 0x1f, 0x84, 0x00, 0x00, 0x00, 0x00, 0x00
    push %rbp
    pop %rbp
    ret
endf cs_nop_first

func pause_first
    pause
    push %r12
    pop %r12
    ret
endf pause_first

func enter_first
    enter $16, $0
    push %rbp
    leave
    ret
endf enter_first

    .protected endbr_push  # bound locally: reached by address, not through the PLT
func caller
    call writes_rdi
    jmp 1f
1:  jmp endbr_push
endf caller
"""


@pytest.fixture(scope="module")
def synth(tmp_path_factory: pytest.TempPathFactory) -> Image:
    d = tmp_path_factory.mktemp("probe_sites")
    src = d / "funcs.s"
    src.write_text(textwrap.dedent(ASM))
    lib = d / "libfuncs.so"
    subprocess.run(["gcc", "-shared", "-nostdlib", "-o", str(lib), str(src)], check=True)
    return Image.load(lib, ".symtab")


RDI = frozenset({"rdi"})


# --- glibc 2.36 -----------------------------------------------------------------------------


@glibc_236
def test_free_moves_past_null_check_to_push(libc: Image) -> None:
    for needs_return in (False, True):
        site = libc.site("free", reads=RDI, needs_return=needs_return, null_skip="rdi")
        assert site == ProbeSite(9, "push", True, "+9: push after NULL check of rdi")


@glibc_236
def test_free_without_null_skip_stops_at_the_branch(libc: Image) -> None:
    # `je` is emulated too, so it beats the single-stepped `test` at +0, but free(NULL) still fires.
    site = libc.site("free", reads=RDI, needs_return=False)
    assert (site.offset, site.mnemonic, site.emulated) == (3, "je", True)


@glibc_236
@pytest.mark.parametrize("name, reads", [
    ("malloc", {"rdi"}), ("calloc", {"rdi", "rsi"}), ("realloc", {"rdi", "rsi"}),
])
def test_push_at_entry_stays_at_entry(libc: Image, name: str, reads: set[str]) -> None:
    for needs_return in (False, True):
        site = libc.site(name, reads=frozenset(reads), needs_return=needs_return)
        assert site == ProbeSite(0, "push", True, "+0: first instruction emulated")


@glibc_236
@pytest.mark.parametrize("name, reads, mnemonic", [
    ("posix_memalign", {"rdi", "rdx"}, "push"),
    ("valloc", {"rdi"}, "push"),
    ("pvalloc", {"rdi"}, "push"),
    ("memalign", {"rsi"}, "je"),
    ("aligned_alloc", {"rsi"}, "je"),
])
def test_site_after_malloc_initialized_check(libc: Image, name: str, reads: set[str], mnemonic: str) -> None:
    # These start with `cmpb $0, __malloc_initialized(%rip)`: no register but flags changes, so
    # even a return probe may sit on the next instruction (rsp is untouched until it runs).
    for needs_return in (False, True):
        site = libc.site(name, reads=frozenset(reads), needs_return=needs_return)
        assert site == ProbeSite(7, mnemonic, True, f"+7: {mnemonic} after cmp")


@glibc_236
def test_reallocarray_multiplies_into_its_arguments(libc: Image) -> None:
    site = libc.site("reallocarray", reads=frozenset({"rdi", "rsi", "rdx"}), needs_return=True)
    assert (site.offset, site.emulated) == (0, False)
    assert "mul at +3 writes rdx" in site.reason


def test_forwards_to_through_plt(libc: Image) -> None:
    plt = plt_targets(LIBC)
    vaddr, body = libc.funcs["reallocarray"]
    assert forwards_to(body, vaddr, plt, libc.symbols_at, {"realloc", "malloc"}) == {"realloc"}
    vaddr, body = libc.funcs["malloc"]
    assert forwards_to(body, vaddr, plt, libc.symbols_at, {"realloc", "malloc", "free"}) == set()


@glibc_236
def test_realloc_calls_malloc_and_free_directly(libc: Image) -> None:
    # realloc(NULL, n) tail-jumps to malloc, realloc(p, 0) calls free: by address, not via the PLT.
    vaddr, body = libc.funcs["realloc"]
    names = {"malloc", "free", "calloc"}
    assert forwards_to(body, vaddr, plt_targets(LIBC), libc.symbols_at, names) == {"malloc", "free"}


# --- synthetic functions ----------------------------------------------------------------------


def test_argument_write_before_push_keeps_entry(synth: Image) -> None:
    for name in ("writes_rdi", "writes_dil"):  # dil is the low byte of rdi
        site = synth.site(name, reads=RDI, needs_return=False)
        assert (site.offset, site.emulated) == (0, False), name
        assert "writes rdi" in site.reason
    # The same write is harmless when the program reads only rsi.
    site = synth.site("writes_rdi", reads=frozenset({"rsi"}), needs_return=True)
    assert site == ProbeSite(3, "push", True, "+3: push after mov")


def test_null_check_is_skipped_only_when_declared(synth: Image) -> None:
    plain = synth.site("null_check", reads=RDI, needs_return=False)
    assert (plain.offset, plain.mnemonic) == (3, "je")  # never past a branch it cannot prove harmless
    for name in ("null_check", "null_check32"):
        site = synth.site(name, reads=RDI, needs_return=True, null_skip="rdi")
        assert site.offset > plain.offset
        assert (site.mnemonic, site.emulated) == ("push", True), name
        assert site.reason == f"+{site.offset}: push after NULL check of rdi"


@pytest.mark.parametrize("name, branch", [("null_check_rsi", "je"), ("nonnull_branch", "jne")])
def test_other_branches_are_not_null_checks(synth: Image, name: str, branch: str) -> None:
    # Both branches are cheap sites themselves, but whatever follows them is not reached by every call.
    site = synth.site(name, reads=RDI, needs_return=False, null_skip="rdi")
    assert site == ProbeSite(3, branch, True, f"+3: {branch} after test")


def test_null_check_must_test_the_argument(synth: Image) -> None:
    site = synth.site("null_check_clobbered", reads=frozenset({"rsi"}), needs_return=False, null_skip="rdi")
    assert (site.offset, site.emulated) == (0, False)
    assert "xor at +0 writes rdi" in site.reason


def test_null_check_branch_is_the_fallback(synth: Image) -> None:
    site = synth.site("null_then_write", reads=RDI, needs_return=False, null_skip="rdi")
    assert (site.offset, site.mnemonic, site.emulated) == (3, "je", True)
    assert site.reason.startswith("+3: je of the NULL check of rdi; not further: mov at +5 writes rdi")


def test_branch_into_prologue_keeps_entry(synth: Image) -> None:
    site = synth.site("loop_into_prologue", reads=frozenset({"rsi"}), needs_return=False)
    assert (site.offset, site.emulated) == (0, False)
    assert "targets +3" in site.reason
    # A loop that starts after the site does not reach it again.
    site = synth.site("loop_after_site", reads=frozenset({"rsi"}), needs_return=False)
    assert (site.offset, site.mnemonic) == (3, "push")


def test_stack_adjustment_only_without_return_probe(synth: Image) -> None:
    site = synth.site("sub_then_push", reads=RDI, needs_return=False)
    assert site == ProbeSite(4, "push", True, "+4: push after sub")
    site = synth.site("sub_then_push", reads=RDI, needs_return=True)
    assert (site.offset, site.emulated) == (0, False)
    assert "moves rsp" in site.reason


def test_endbr64_is_stepped_over(synth: Image) -> None:
    for needs_return in (False, True):
        site = synth.site("endbr_push", reads=RDI, needs_return=needs_return)
        assert site == ProbeSite(4, "push", True, "+4: push after endbr64")


def test_memory_store_keeps_entry(synth: Image) -> None:
    site = synth.site("stores", reads=RDI, needs_return=False)
    assert (site.offset, site.emulated) == (0, False)
    assert "writes memory" in site.reason


@pytest.mark.parametrize("name, why", [
    ("jump_table", "indirect jmp at +5 has unknown targets"),
    ("undecodable", "bytes at +6 cannot be decoded"),
])
def test_unknown_branch_targets_keep_entry(synth: Image, name: str, why: str) -> None:
    site = synth.site(name, reads=frozenset({"rsi"}), needs_return=False)
    assert (site.offset, site.emulated) == (0, False)
    assert why in site.reason


def test_scan_limit(synth: Image) -> None:
    site = synth.site("far_push", reads=frozenset({"rsi"}), needs_return=False)
    assert (site.offset, site.emulated) == (0, False)
    assert "first 32 bytes" in site.reason
    site = synth.site("far_push", reads=frozenset({"rsi"}), needs_return=False, max_scan=64)
    assert (site.offset, site.mnemonic) == (33, "push")


@pytest.mark.parametrize("name, offset, mnemonic, emulated", [
    ("nopl_first", 0, "nop", True),     # 66 0f 1f 44 00 00
    ("cs_nop_first", 10, "push", True),  # the kernel will not emulate (or even probe) a cs-prefixed nop
    ("pause_first", 0, "pause", False),  # f3 90 is not a nop, and not known to be harmless here
    ("enter_first", 0, "enter", False),  # capstone reports no effects for enter: unknown
])
def test_first_instruction_forms(synth: Image, name: str, offset: int, mnemonic: str, emulated: bool) -> None:
    site = synth.site(name, reads=RDI, needs_return=True)
    assert (site.offset, site.mnemonic, site.emulated) == (offset, mnemonic, emulated)


def test_branch_targets_outside(synth: Image) -> None:
    vaddr, body = synth.funcs["caller"]
    plt = plt_targets(synth.path)
    stub = next(a for a, n in plt.items() if n == "writes_rdi")
    assert branch_targets_outside(body, vaddr) == {stub, synth.funcs["endbr_push"][0]}  # not the jmp 1f
    names = {"writes_rdi", "endbr_push", "stores"}
    assert forwards_to(body, vaddr, plt, synth.symbols_at, names) == {"writes_rdi", "endbr_push"}
