"""moelink.__version__ is the one written in include/moelink/version.h."""

import re
from pathlib import Path

import moelink


def test_version_is_the_headers():
    header = Path(__file__).resolve().parents[2] / "include" / "moelink" / "version.h"
    want = re.search(r'#define MOELINK_VERSION "([0-9.]+)"', header.read_text()).group(1)
    assert moelink.__version__ == want
