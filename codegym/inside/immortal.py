"""Making the zygote's preloaded objects immortal, so touching them writes nothing.

After a fork, the zygote and its children share every page until one of them writes to it; the
first write copies the page (4 KiB, a page fault, a memory cgroup charge). CPython writes to an
object each time it takes or drops a reference to it, so merely *using* a function, a module's
dict, a type or a constant copies its page: measured in a jail serving cold steps, the zygote took
about 260 page faults per request (it runs json, frames and its own code while the spare child it
just forked shares its pages), and each child about 600, many of them such copies. Made immortal, a child that touches every
preloaded object copies 194 pages instead of 2,075 (`tests/test_immortal.py`), a resident session's
private memory falls from 2.11 to 1.58 MiB, and a cold step's jail CPU by 15-18 %
(docs/benchmarks.md, "A cold step").

Python 3.12 has immortal objects (PEP 683): an object whose reference count holds the immortal
value is never written by Py_INCREF or Py_DECREF and never freed. The interpreter makes its own
singletons and interned strings immortal; PEP 683 names pre-fork servers as the other use, to make
the objects loaded before forking immortal. Nothing in 3.12's Python API does that, so this writes
the value itself, into `ob_refcnt` (offset 0 of every object in a release build), for everything
reachable from the modules and the garbage collector's lists at that moment.

The collector of 3.12 moves an immortal object it meets to its permanent generation, as
`gc.freeze()` does, so a collection never scans them again (nor frees them).

What it costs: those objects are never freed. They are the preloaded libraries and the zygote's
own code, which live as long as the zygote anyway; what the zygote allocates later is unaffected.
Code that checks for a sole reference to reuse an object in place (str and bytes concatenation)
sees a large count and copies instead, as it does for the interpreter's own immortal objects.
"""

import ctypes
import gc
import sys

# `_Py_IMMORTAL_REFCNT` on a 64-bit build: its low 32 bits read as a negative int32, which is how
# Py_INCREF and Py_DECREF tell an immortal object (and an increment of it wraps to 0: no write).
IMMORTAL_REFCNT = 0xFFFFFFFF


def supported() -> bool:
    """A 64-bit CPython of the 3.12 line, the layout this writes (3.13's free-threaded build
    differs, and later versions may change the value)."""
    return (
        sys.implementation.name == "cpython"
        and sys.version_info[:2] == (3, 12)
        and sys.maxsize > 2**32
        and not hasattr(sys, "_is_gil_enabled")
        and not hasattr(sys, "gettotalrefcount")  # a debug build's objects carry extra fields
    )


def immortalize() -> int:
    """Make every object now reachable from the modules or tracked by the collector immortal;
    return how many were. Call once, after the preloads, right before `gc.freeze()`."""
    if not supported():
        return 0
    gc.collect()
    pending = gc.get_objects()
    pending.append(sys.modules)
    # The walk's own containers are left mortal: they are dropped when it returns.
    seen: set[int] = {id(pending)}
    seen.add(id(seen))
    count = 0
    write = ctypes.c_ssize_t.from_address
    while pending:
        obj = pending.pop()
        key = id(obj)
        if key in seen:
            continue
        seen.add(key)
        write(key).value = IMMORTAL_REFCNT
        count += 1
        pending.extend(gc.get_referents(obj))
    return count
