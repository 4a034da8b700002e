"""The address of any buffer, read-only ones included (a host row view, a ``bytes``).

``ctypes`` gives the address of a *writable* buffer only (``c_char.from_buffer``). The disk
tier checksums rows by address (``fast_checksum.checksum_at``, which frees the GIL), from
whatever buffer it is handed, so it asks CPython's buffer protocol directly (``Py_buffer``
is part of the stable ABI since 3.11).
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
