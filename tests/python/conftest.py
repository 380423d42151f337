"""A test that needs something beyond torch and gradcomp says so with @pytest.mark.needs(NAME, ...):
a Python package (a framework, mnist1d) or a program (`bible`, Debian's bible-kjv). Where one is
missing (a GPU machine with no package index, say) the test skips, naming it and how to install it;
under GRADCOMP_REQUIRE_OPTIONAL=1, which tools/test.sh sets, it fails instead, so that CI never
skips it silently."""

from __future__ import annotations

import importlib
import os
import shutil

import pytest

# name: how to install it. A name with a dot or without a program of that name is a Python module.
OPTIONAL = {
    "lightning": "pip install lightning",
    "accelerate": "pip install accelerate",
    "transformers": "pip install transformers",
    "mnist1d": "pip install mnist1d",
    "tokenizers": "pip install tokenizers",
    "bible": "apt-get install bible-kjv",
}
PROGRAMS = {"bible"}


def missing(name: str) -> str | None:
    """Why NAME is not usable here, or None."""
    if name in PROGRAMS:
        return None if shutil.which(name) else f"the program {name} is not installed ({OPTIONAL[name]})"
    try:
        importlib.import_module(name)
    except ImportError as error:
        return f"{name} is not importable ({error}; {OPTIONAL.get(name, 'pip install ' + name)})"
    return None


def pytest_configure(config):
    config.addinivalue_line("markers", "needs(*names): the optional packages or programs the test needs")


def pytest_runtest_setup(item):
    for marker in item.iter_markers("needs"):
        for name in marker.args:
            reason = missing(name)
            if reason is None:
                continue
            if os.environ.get("GRADCOMP_REQUIRE_OPTIONAL") == "1":
                pytest.fail(f"{reason}; GRADCOMP_REQUIRE_OPTIONAL=1 requires it")
            pytest.skip(reason)
