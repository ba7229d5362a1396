"""moelink inside the serving engines users already run. Each submodule
imports its engine; `import moelink` imports none of them.

    moelink.integrations.sglang   SGLang 0.5.23: MoelinkDispatcher and the
                                  `sglang.srt.plugins` entry point that selects it
    moelink.integrations.vllm     vLLM 0.33: MoelinkPrepareAndFinalize and the
                                  `vllm.general_plugins` entry point that selects it
"""

import os

SGLANG_SWITCH_ENV = "MOELINK_SGLANG"  # "1": SGLang's pplx dispatcher runs on moelink
VLLM_SWITCH_ENV = "MOELINK_VLLM"  # "1": vLLM's DeepEP low-latency prepare/finalize runs on moelink


def sglang_plugin() -> None:
    """The `sglang.srt.plugins` entry point (pyproject.toml). SGLang calls it
    in every process at start-up; with MOELINK_SGLANG unset it returns
    without importing anything."""
    if os.environ.get(SGLANG_SWITCH_ENV, "0") != "1":
        return
    from .sglang import register

    register()


def vllm_plugin() -> None:
    """The `vllm.general_plugins` entry point (pyproject.toml). vLLM calls it
    in every process at start-up; with MOELINK_VLLM unset it returns without
    importing anything."""
    if os.environ.get(VLLM_SWITCH_ENV, "0") != "1":
        return
    from .vllm import register

    register()
