"""moelink inside the serving engines users already run. Each submodule
imports its engine; `import moelink` imports none of them.

    moelink.integrations.sglang   SGLang 0.5.23: MoelinkDispatcher and the
                                  `sglang.srt.plugins` entry point that selects it
"""

import os

SGLANG_SWITCH_ENV = "MOELINK_SGLANG"  # "1": SGLang's pplx dispatcher runs on moelink


def sglang_plugin() -> None:
    """The `sglang.srt.plugins` entry point (pyproject.toml). SGLang calls it
    in every process at start-up; with MOELINK_SGLANG unset it returns
    without importing anything."""
    if os.environ.get(SGLANG_SWITCH_ENV, "0") != "1":
        return
    from .sglang import register

    register()
