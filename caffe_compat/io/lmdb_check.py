"""Checking an LMDB ``data.mdb`` before liblmdb memory-maps it, so that a truncated or corrupted database
is a :class:`~caffe_compat.errors.FormatError` instead of a SIGBUS, a SIGSEGV or an ``abort()``.

liblmdb trusts its file: it maps the whole database and follows page numbers, node offsets and data
sizes without comparing them with the file's real size.  Touching a mapped page past the end of a
truncated file kills the process with SIGBUS, and a page of the wrong type trips an ``assert`` (e.g.
``Assertion 'IS_LEAF(mp)' failed in mdb_cursor_next()``), i.e. SIGABRT.  Neither can be caught from
Python, so :func:`check_lmdb_file` reads the file with ``pread`` (never through a mapping) and walks every
page the read-only cursor of the main database can reach, checking each fact liblmdb relies on.  The
walk costs one ``pread`` per branch or leaf page (not per overflow page: record data is not read), and
its result is remembered per file identity, size and modification time.

The layout relied on (liblmdb 0.9's data format version 1, the one py-lmdb reads; 64-bit builds, native
little-endian byte order; ``P`` = 8-byte ``pgno_t``/``size_t``):

* The file is an array of pages of ``psize`` bytes; page ``n`` starts at byte ``n * psize``.
* **Page header** (16 bytes, ``PAGEHDRSZ``): ``mp_pgno`` (u64, the page's own number), ``mp_pad``
  (u16), ``mp_flags`` (u16: ``P_BRANCH 0x01``, ``P_LEAF 0x02``, ``P_OVERFLOW 0x04``, ``P_META 0x08``,
  ``P_DIRTY 0x10``, ``P_LEAF2 0x20``, ``P_SUBP 0x40``, ``P_LOOSE 0x4000``, ``P_KEEP 0x8000``), then
  either ``mp_lower``, ``mp_upper`` (u16 each: the free space between the pointer array and the nodes)
  or, on an overflow page, ``mp_pages`` (u32).  Branch and leaf pages continue with ``mp_ptrs``: one u16
  per node, the node's offset from the start of the page; ``NUMKEYS = (mp_lower - 16) / 2``.
* **Meta pages** 0 and 1 (flag ``P_META``) hold ``MDB_meta`` right after the page header (byte 16):
  ``mm_magic`` u32 = ``0xBEEFC0DE``, ``mm_version`` u32 = 1, ``mm_address`` u64, ``mm_mapsize`` u64,
  then two ``MDB_db`` records (48 bytes each, at page bytes 40 and 88): ``md_pad`` u32 (in the first
  record, the free-page database's, this is the **page size** ``mm_psize``), ``md_flags`` u16,
  ``md_depth`` u16, ``md_branch_pages``, ``md_leaf_pages``, ``md_overflow_pages``, ``md_entries``,
  ``md_root`` (u64 each; ``md_root = 2**64 - 1`` is an empty tree).  After them (byte 136) ``mm_last_pg``
  u64 (the last page in use) and ``mm_txnid`` u64.  Meta page 1 starts at byte ``psize`` of meta page
  0; liblmdb uses the meta page with the larger ``mm_txnid`` (page 0 on a tie) and, with it, the page
  size, the last page and the main database's record (the second ``MDB_db``).
* **Nodes** (2-byte aligned, inside their page): ``mn_lo``, ``mn_hi``, ``mn_flags``, ``mn_ksize`` (u16
  each), then the key (``mn_ksize`` bytes).  In a branch page the child's page number is ``mn_lo |
  mn_hi << 16 | mn_flags << 32``; in a leaf page ``mn_lo | mn_hi << 16`` is the data size and the data
  follows the key, unless ``mn_flags`` has ``F_BIGDATA`` (0x01): then the 8 bytes after the key are
  the page number of the first overflow page, whose data starts after its 16-byte header and spans
  ``OVPAGES(size) = (16 - 1 + size) // psize + 1`` pages.  ``F_SUBDATA`` (0x02) and ``F_DUPDATA`` (0x04)
  mark named and duplicate-sorted databases, which Caffe's databases never contain.
* The tree is a B+tree: every path from ``md_root`` has ``md_depth`` pages, branch pages above, leaf
  pages at the bottom; liblmdb asserts that a main-database branch page has at least two nodes and
  that a cursor moving to a sibling lands on a leaf.  Every page is reachable once.

The checks: both meta pages complete and well-formed with the same power-of-two page size in
[512, 32768]; the main database has no flags (Caffe opens it with none; no duplicates, no integer
keys); the last page and the page size stay within a 64-bit address space; every branch and leaf page
reachable from the root lies within the file and within ``mm_last_pg``, carries its own number, has the
type its depth requires, a sane ``mp_lower``/``mp_upper`` and at least one node (two on a branch page),
and each of its nodes, key and in-page data lies inside the page; every overflow range lies within the
file and ``mm_last_pg``; the number of records equals ``md_entries``.  A file can still be changed by
another process after the check; a database being written while it is read is outside what this
guards against.
"""

from __future__ import annotations

import os
import stat
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

from caffe_compat.errors import FormatError
from caffe_compat.io.safe_open import check_regular_file

__all__ = ["LmdbSummary", "check_lmdb_file"]

PAGEHDRSZ = 16
NODESIZE = 8
META_BYTES = PAGEHDRSZ + 136  # what liblmdb's mdb_env_read_header reads of each meta page
MDB_MAGIC = 0xBEEFC0DE
MDB_DATA_VERSION = 1
MIN_PAGESIZE, MAX_PAGESIZE = 512, 0x8000
P_INVALID = 2 ** 64 - 1
CURSOR_STACK = 32  # liblmdb's deepest cursor
ADDRESS_SPACE = 2 ** 47  # user address space of x86-64 / arm64 Linux: no mapping can be larger

P_BRANCH, P_LEAF, P_OVERFLOW, P_META, P_LEAF2, P_SUBP = 0x01, 0x02, 0x04, 0x08, 0x20, 0x40
_TYPE_BITS = P_BRANCH | P_LEAF | P_OVERFLOW | P_META | P_LEAF2 | P_SUBP
F_BIGDATA, F_SUBDATA, F_DUPDATA = 0x01, 0x02, 0x04
_DB_FLAG_NAMES = {0x02: "REVERSEKEY", 0x04: "DUPSORT", 0x08: "INTEGERKEY", 0x10: "DUPFIXED", 0x20: "INTEGERDUP",
                  0x40: "REVERSEDUP"}

_HEADER = struct.Struct("<QHHHH")  # mp_pgno, mp_pad, mp_flags, mp_lower, mp_upper
_OVERFLOW_HEADER = struct.Struct("<QHHI")  # mp_pgno, mp_pad, mp_flags, mp_pages
_META = struct.Struct("<IIQQ")  # mm_magic, mm_version, mm_address, mm_mapsize
_DB = struct.Struct("<IHHQQQQQ")  # md_pad, md_flags, md_depth, branch, leaf, overflow, entries, root
_TAIL = struct.Struct("<QQ")  # mm_last_pg, mm_txnid
_NODE = struct.Struct("<HHHH")  # mn_lo, mn_hi, mn_flags, mn_ksize
_PGNO = struct.Struct("<Q")


@dataclass(frozen=True)
class LmdbSummary:
    """What the check found: page size, the meta page in use, records, tree depth, branch/leaf/overflow
    pages reached."""

    page_size: int
    meta_page: int
    entries: int
    depth: int
    tree_pages: int
    overflow_pages: int


@dataclass(frozen=True)
class _Meta:
    page: int
    psize: int
    mapsize: int
    main: tuple
    last_pg: int
    txnid: int


_CHECKED: dict[tuple, LmdbSummary] = {}
_CHECKED_LOCK = threading.Lock()


def _bad(path, where: str, message: str) -> FormatError:
    return FormatError(f"{path}: not a valid LMDB data file: {where}: {message} (truncated or corrupt; "
                       f"nothing was memory-mapped)")


def _read_meta(path, fd: int, size: int, page: int, offset: int) -> _Meta:
    where = f"meta page {page} (byte {offset})"
    if size < offset + META_BYTES:
        raise _bad(path, where, f"the file has {size} bytes, a meta page needs {META_BYTES} from byte {offset}")
    raw = os.pread(fd, META_BYTES, offset)
    if len(raw) != META_BYTES:
        raise _bad(path, where, "short read")
    pgno, _, flags, _, _ = _HEADER.unpack_from(raw, 0)
    if not flags & P_META:
        raise _bad(path, where, f"mp_flags 0x{flags:04x} lacks P_META (0x08)")
    magic, version, _, mapsize = _META.unpack_from(raw, PAGEHDRSZ)
    if magic != MDB_MAGIC:
        raise _bad(path, where, f"mm_magic 0x{magic:08x}, expected 0x{MDB_MAGIC:08X} (or an LMDB of a "
                                f"32-bit or big-endian build)")
    if version != MDB_DATA_VERSION:
        raise _bad(path, where, f"mm_version {version}, this liblmdb reads format {MDB_DATA_VERSION}")
    free_db = _DB.unpack_from(raw, 40)
    main = _DB.unpack_from(raw, 88)
    last_pg, txnid = _TAIL.unpack_from(raw, 136)
    psize = free_db[0]
    if psize < MIN_PAGESIZE or psize > MAX_PAGESIZE or psize & (psize - 1):
        raise _bad(path, f"{where} field mm_psize (byte {offset + 40})",
                   f"page size {psize}, expected a power of two in [{MIN_PAGESIZE}, {MAX_PAGESIZE}]")
    if pgno != page:
        raise _bad(path, f"{where} field mp_pgno", f"says page {pgno}")
    return _Meta(page, psize, mapsize, main, last_pg, txnid)


def _flag_names(flags: int) -> str:
    names = [name for bit, name in _DB_FLAG_NAMES.items() if flags & bit]
    return "|".join(names) or f"0x{flags:04x}"


def check_lmdb_file(data_file: str | os.PathLike, display: str | os.PathLike | None = None) -> LmdbSummary:
    """Check the LMDB data file ``data_file`` as the module docstring says, before anything maps it;
    FormatError naming the file (``display``, default ``data_file``), the page, node or record, and the
    field, when liblmdb could not read it safely.  A result is remembered per file identity, size and
    modification time."""
    data_file = Path(data_file)
    path = display if display is not None else data_file
    check_regular_file(data_file, "an LMDB database")
    try:
        fd = os.open(data_file, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise FormatError(f"{path}: cannot open the LMDB data file ({exc.strerror or exc})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # swapped for something else since the check
            raise FormatError(f"{path}: the LMDB data file is not a regular file")
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        with _CHECKED_LOCK:
            known = _CHECKED.get(key)
        if known is not None:
            return known
        summary = _check(path, fd, st.st_size)
    except OSError as exc:
        raise FormatError(f"{path}: cannot read the LMDB data file ({exc.strerror or exc})") from None
    finally:
        os.close(fd)
    with _CHECKED_LOCK:
        _CHECKED[key] = summary
    return summary


def _check(path, fd: int, size: int) -> LmdbSummary:
    if size == 0:
        raise _bad(path, "byte 0", "the file is empty")
    first = _read_meta(path, fd, size, 0, 0)
    psize = first.psize
    second = _read_meta(path, fd, size, 1, psize)
    if second.psize != psize:
        raise _bad(path, "meta page 1 field mm_psize", f"page size {second.psize}, meta page 0 says {psize}")
    if size < 2 * psize:
        raise _bad(path, "meta page 1", f"the file has {size} bytes, both meta pages need {2 * psize}")
    meta = second if second.txnid > first.txnid else first
    where = f"meta page {meta.page}"
    if (meta.last_pg + 1) * psize > ADDRESS_SPACE:
        raise _bad(path, f"{where} field mm_last_pg", f"last page {meta.last_pg} of {psize} bytes is beyond any "
                                                      f"address space")
    _, flags, depth, _, _, _, entries, root = meta.main
    if flags:
        raise FormatError(f"{path}: the LMDB's main database has flags {_flag_names(flags)} ({where} field "
                          f"md_flags); Caffe's Datum databases have none (one value per key)")
    if root == P_INVALID:
        if depth or entries:
            raise _bad(path, f"{where} main database", f"an empty tree with md_depth {depth} and md_entries "
                                                       f"{entries}")
        return LmdbSummary(psize, meta.page, 0, 0, 0, 0)
    if not 1 <= depth <= CURSOR_STACK:
        raise _bad(path, f"{where} field md_depth", f"tree depth {depth}, expected 1 to {CURSOR_STACK}")
    in_file = size // psize  # complete pages in the file
    limit = min(in_file, meta.last_pg + 1)  # pages liblmdb may touch and the file really holds

    def page_bound(pgno: int, what: str) -> None:
        if pgno < 2 or pgno >= limit:
            reason = (f"page {pgno} is past the end of the file ({in_file} pages of {psize} bytes: truncated?)"
                      if pgno >= in_file else f"page {pgno} is past mm_last_pg {meta.last_pg}"
                      if pgno > meta.last_pg else f"page {pgno} is a meta page")
            raise _bad(path, what, reason)

    page_bound(root, f"{where} field md_root")
    seen: set[int] = set()
    records = overflow = 0
    stack = [(root, 0, f"{where} md_root")]
    while stack:
        pgno, level, parent = stack.pop()
        if pgno in seen:
            raise _bad(path, f"page {pgno} (from {parent})", "reached twice: the tree is not a tree")
        seen.add(pgno)
        page = os.pread(fd, psize, pgno * psize)
        here = f"page {pgno} (byte {pgno * psize}, from {parent})"
        if len(page) != psize:
            raise _bad(path, here, "short read: the file shrank while it was checked")
        own, _, pflags, lower, upper = _HEADER.unpack_from(page, 0)
        if own != pgno:
            raise _bad(path, f"{here} field mp_pgno", f"the page says it is page {own}")
        leaf = level == depth - 1
        kind = pflags & _TYPE_BITS
        if kind != (P_LEAF if leaf else P_BRANCH):
            raise _bad(path, f"{here} field mp_flags", f"0x{pflags:04x}, expected a {'leaf' if leaf else 'branch'} "
                                                       f"page at depth {level + 1} of {depth}")
        if lower < PAGEHDRSZ or (lower - PAGEHDRSZ) % 2 or lower > upper or upper > psize:
            raise _bad(path, f"{here} fields mp_lower/mp_upper", f"{lower}/{upper} in a page of {psize} bytes")
        count = (lower - PAGEHDRSZ) // 2
        if count < (1 if leaf else 2):
            raise _bad(path, here, f"{count} node(s) in a {'leaf' if leaf else 'branch'} page")
        offsets = struct.unpack_from(f"<{count}H", page, PAGEHDRSZ)
        children = []
        for index, ptr in enumerate(offsets):
            node = f"{here} node {index}"
            if ptr % 2 or ptr < upper or ptr + NODESIZE > psize:
                raise _bad(path, f"{node} (mp_ptrs[{index}])", f"offset {ptr} outside the page's nodes "
                                                               f"[{upper}, {psize})")
            lo, hi, nflags, ksize = _NODE.unpack_from(page, ptr)
            end = ptr + NODESIZE + ksize
            if end > psize:
                raise _bad(path, f"{node} field mn_ksize", f"a key of {ksize} bytes at offset {ptr} runs past the "
                                                           f"page")
            if not leaf:
                children.append((lo | hi << 16 | nflags << 32, f"{node} (branch)"))
                continue
            dsize = lo | hi << 16
            record = f"{here} node {index}, record {records}"
            if nflags & (F_SUBDATA | F_DUPDATA):
                raise FormatError(f"{path}: {record}: mn_flags 0x{nflags:x} marks a named or duplicate-sorted "
                                  f"database; Caffe's Datum databases hold one plain value per key")
            if nflags & F_BIGDATA:
                if end + 8 > psize:
                    raise _bad(path, f"{record} (F_BIGDATA)", "the overflow page number runs past the page")
                first_ov = _PGNO.unpack_from(page, end)[0]
                pages = (PAGEHDRSZ - 1 + dsize) // psize + 1
                page_bound(first_ov, f"{record}: overflow page")
                if first_ov * psize + PAGEHDRSZ + dsize > size or first_ov + pages - 1 > meta.last_pg:
                    raise _bad(path, f"{record}: overflow pages {first_ov}..{first_ov + pages - 1}",
                               f"{dsize} bytes of data run past the end of the file ({size} bytes: truncated?)"
                               if first_ov * psize + PAGEHDRSZ + dsize > size
                               else f"past mm_last_pg {meta.last_pg}")
                overflow += pages
            elif end + dsize > psize:
                raise _bad(path, f"{record} field mn_lo/mn_hi", f"{dsize} bytes of data at offset {end} run past "
                                                                f"the page")
            records += 1
        for child, origin in reversed(children):  # key order: leftmost child popped first
            page_bound(child, f"{origin}: child page")
            stack.append((child, level + 1, origin))
    if records != entries:
        raise _bad(path, f"{where} field md_entries", f"says {entries} records, the tree holds {records}")
    return LmdbSummary(psize, meta.page, records, depth, len(seen), overflow)
