"""The address of a read-only buffer, such as a key py-lmdb returns with ``buffers=True``.

``ctypes`` gives the address of a *writable* buffer only (``c_char.from_buffer``); LMDB's
keys are read-only views of LMDB's own pages. The disk tier reads the B-tree node around
such a key to find where its value lies in the file (see ``lmdb_store``), so it asks
CPython's buffer protocol directly (``Py_buffer`` is part of the stable ABI since 3.11).
"""

from __future__ import annotations

import ctypes


class _PyBuffer(ctypes.Structure):
    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_get_buffer.restype = ctypes.c_int
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = [ctypes.POINTER(_PyBuffer)]
_release_buffer.restype = None


def buffer_address(obj: object) -> int:
    """The address of ``obj``'s first byte (valid only while ``obj`` keeps its memory alive)."""
    view = _PyBuffer()
    _get_buffer(obj, ctypes.byref(view), 0)  # ctypes.pythonapi raises if obj is not a buffer
    try:
        return view.buf or 0
    finally:
        _release_buffer(ctypes.byref(view))


def peek(obj: object, offset: int, nbytes: int) -> bytes:
    """``nbytes`` bytes at ``offset`` from ``obj``'s first byte (which must be readable memory)."""
    return ctypes.string_at(buffer_address(obj) + offset, nbytes)
