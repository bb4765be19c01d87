"""Process-wide setup (app/process.py): the allocator settings for decoding."""

from __future__ import annotations

import ctypes
import platform
import subprocess
import sys

import pytest

from app import process
from conftest import ROOT


@pytest.mark.parametrize("variable", process.ALLOCATOR_VARIABLES)
def test_an_allocator_the_environment_tunes_is_left_as_it_is(monkeypatch, variable):
    def no_libc(*args, **kwargs):
        raise AssertionError("mallopt was reached although the environment tunes the allocator")

    monkeypatch.setattr(ctypes, "CDLL", no_libc)
    said = process.configure_allocator({variable: "1", "PATH": "/usr/bin"})
    assert said == f"left as the environment sets it ({variable})"


def test_an_empty_variable_is_not_a_choice_and_anything_but_glibc_is_left_alone(monkeypatch):
    class Musl:  # a C library without gnu_get_libc_version (and so without glibc's mallopt parameters)
        def __init__(self, name):
            pass

    monkeypatch.setattr(ctypes, "CDLL", Musl)
    assert process.configure_allocator({"MALLOC_ARENA_MAX": ""}) == "left alone (not glibc)"


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_glibc_takes_every_parameter():
    # In a process of its own: the settings are process-wide.
    said = subprocess.run([sys.executable, "-c", "from app.process import configure_allocator as c; print(c({}))"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    assert said.startswith("glibc: buffers under 4 MiB from the heap"), said
